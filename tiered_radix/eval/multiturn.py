"""Multi-turn recall: a fact stated in turn 1 and asked for in the last turn.

Run through a chat session, turn 2 and 3 reuse turn 1's cached prefix, so the fact must survive
the policy's routing across turns (and any eviction done while answering turn 2).
"""

from __future__ import annotations

import random

from . import words
from .ruler import NEEDLE, Filler, haystack
from .sample import Sample, TokenCounter, fit, register

DOCUMENT = (
    "Here is a document. Read it carefully; I will ask you questions about it later.\n"
    "{context}\nFor now, reply with OK."
)
DISTRACTOR = "According to the document, what colour is the sky? Answer in one word."
RECALL = (
    "What is the special magic number for {key} mentioned in the document from my first "
    "message? Answer with the number only."
)


@register("multiturn")
def multiturn(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    (key,), (value,), depth = words.keys(rng, 1), words.numbers(rng, 1), rng.random()
    build = haystack(Filler("noise", rng), [(depth, NEEDLE.format(key=key, value=value))])
    first, n = fit(lambda n: DOCUMENT.format(context=build(n)), length, count)
    turns = (first, DISTRACTOR, RECALL.format(key=key))
    meta = {
        "haystack": "noise",
        "depth": depth,
        "depths": [depth],
        "sentences": n,
        "tokens": count(first),
        "keys": [key],
    }
    return Sample("multiturn", length, index, turns, (value,), "all", 32, meta)
