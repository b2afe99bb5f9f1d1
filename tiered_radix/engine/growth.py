"""How a request's engine tensors make room for the tokens that keep arriving.

Tier maps, ledger-copy masks, ``cumulative`` sums and channel sets are held per (layer, head,
unit or token) and grow with a request (prefill chunks, then a token a decode step). Growing
copies what is held, so capacity grows geometrically, by at least :data:`GROWTH`: a request of
``T`` tokens pays ``O(T)`` copied elements in all and holds at most ``GROWTH`` times what it
uses. The SGLang pool's sizing reserves that factor for every slot
(:mod:`tiered_radix.adapters.sglang.sizing`): a smaller factor is more tokens for the same memory,
at the price of more (smaller) copies; 1.25 copies each element at most four times on average.
"""

from __future__ import annotations

import math

GROWTH = 1.25


def grown(capacity: int, needed: int) -> int:
    """The capacity that holds ``needed``: ``capacity`` when it does, else the larger of
    ``needed`` and ``GROWTH`` times ``capacity``."""
    if needed <= capacity:
        return capacity
    return max(needed, math.ceil(capacity * GROWTH))
