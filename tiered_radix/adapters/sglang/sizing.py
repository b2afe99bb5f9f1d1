"""How many token slots and blocks a tiered pool gets: more slots in the same bytes.

Sizing (:func:`logical_tokens`, :func:`plan_blocks`): SGLang sizes a full-precision pool at
``N0`` tokens from free memory. With a ``fraction`` budget ``f`` the allocator gets
``N = floor(N0 / f)`` logical slots and the pool spends the same bytes, ``f * N`` tokens' worth
of full rows per layer: ``max(share_full, MIN_FULL_SHARE)`` of it as row blocks, the rest as
ledger blocks. Byte and token budgets are per-request caps with no per-token ratio, so they keep
``N = N0`` (no expansion). A full region too small for the tokens in flight (prefill happens at
full precision before routing) raises :class:`~.pool.PoolFullError` at write time.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_radix.formats.layout import uniform_page_nbytes
from tiered_radix.policy.model import Budget, Policy, RankAllocation

from .reps import Layout

MIN_FULL_SHARE = 0.25  # rows for protected / recent / in-flight tokens, whatever the shares say


@dataclass(frozen=True)
class PoolBlocks:
    full: int  # row blocks per layer ([W, d] K and V of one head)
    quant: int  # ledger blocks per layer


def logical_tokens(stock_tokens: int, budget: Budget) -> int:
    """Allocator slots for a pool whose bytes would hold ``stock_tokens`` full tokens."""
    return int(stock_tokens / budget.value) if budget.kind == "fraction" else stock_tokens


def plan_blocks(
    size: int, head_num: int, head_dim: int, itemsize: int, policy: Policy, budget: Budget
) -> PoolBlocks:
    """Blocks per layer for ``size`` logical slots (see the module docstring)."""
    lay = Layout.of(policy)
    frac = budget.value if budget.kind == "fraction" else 1.0
    phys = frac * size * head_num * head_dim * 2 * itemsize  # bytes per layer
    row_bytes = 2 * lay.window * head_dim * itemsize
    if lay.quant is None:
        return PoolBlocks(max(1, int(phys // row_bytes)), 0)
    a = policy.allocate
    share = (
        a.shares[0]
        if isinstance(a, RankAllocation) and lay.engine_tiers[0] in (t.name for t in policy.tiers)
        else 0.0
    )
    share = max(share, MIN_FULL_SHARE)
    q_bytes = uniform_page_nbytes(
        lay.quant.bits, lay.window, head_dim, min(lay.v_group, head_dim)
    )  # one ledger page
    return PoolBlocks(
        max(1, int(share * phys // row_bytes)), max(1, int((1 - share) * phys // q_bytes))
    )
