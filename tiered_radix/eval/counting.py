"""RULER's aggregation tasks: common-words (``cwe``) and frequent-words (``fwe``) extraction.

The haystack *is* the signal here, so a policy that drops tokens uniformly loses the counts.
"""

from __future__ import annotations

import random

from . import words
from .sample import Sample, TokenCounter, fit, register

CWE_COMMON = 10
FWE_TOP = 3


@register("cwe")
def common_words(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    """A numbered word list: ``CWE_COMMON`` words repeated ``f`` times, the rest 3 times each."""
    pool = words.ADJECTIVES + words.NOUNS
    pool = rng.sample(pool, len(pool)) + words.made_up_words(rng, 2000)
    common, rare = pool[:CWE_COMMON], pool[CWE_COMMON:]
    freq = min(30, max(4, length // 80))
    seed = rng.random()

    def build(n: int) -> str:
        items = common * freq + rare[:n] * 3
        random.Random(f"{seed}/{n}").shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return (
            "Below is a numbered list of words. In these words, some appear more often than "
            f"others. Memorize the ones that appear most often.\n{listing}\nQuestion: What "
            f"are the {CWE_COMMON} most common words in the above list? Answer with the "
            "words only."
        )

    text, n = fit(build, length, count, limit=len(rare))
    meta = {"common_freq": freq, "rare": n, "tokens": count(text)}
    return Sample("cwe", length, index, (text,), tuple(common), "all", 96, meta)


@register("fwe")
def frequent_words(rng: random.Random, length: int, index: int, count: TokenCounter) -> Sample:
    """Made-up words with Zipf(2) counts over 50 ranks; the top ``FWE_TOP`` are the answer."""
    vocab = words.made_up_words(rng, 50)
    mass = [1.0 / (r + 1) ** 2 for r in range(len(vocab))]
    seed = rng.random()

    def build(n: int) -> str:
        # Counts are fixed by n, not sampled, so the top three always differ (61/15/7% shares).
        counts = [int(n * m / sum(mass)) for m in mass]
        items = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(f"{seed}/{n}").shuffle(items)
        return (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appearing coded words.\n"
            f"{' .... '.join(items)}\nQuestion: Ignore the dots '....'. What are the three "
            "most frequently appearing words in the above coded text? Answer with the "
            "words only."
        )

    text, n = fit(build, length, count)
    return Sample(
        "fwe",
        length,
        index,
        (text,),
        tuple(vocab[:FWE_TOP]),
        "all",
        48,
        {"draws": n, "tokens": count(text)},
    )
