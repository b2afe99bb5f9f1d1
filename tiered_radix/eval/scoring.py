"""RULER's string-match scoring and confidence intervals for a mean score.

Per sample (case-insensitive substring tests on the cleaned prediction):

- ``string_match_all``: the fraction of reference strings found (1.0 only if all are found);
- ``string_match_part``: 1.0 if any reference string is found.

A task's score is the mean over samples, reported in percent by :mod:`report`. Intervals:
Wilson's score interval when every sample scored 0 or 1, else a seeded percentile bootstrap.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean(prediction: str) -> str:
    """Drop control characters (RULER strips non-printable output) and outer whitespace."""
    return _CONTROL.sub("", prediction).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    if not references:
        raise ValueError("a sample needs at least one reference answer")
    pred = clean(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    if not references:
        raise ValueError("a sample needs at least one reference answer")
    pred = clean(prediction).lower()
    return float(any(r.lower() in pred for r in references))


METRICS = {"all": string_match_all, "part": string_match_part}


def score(prediction: str, references: Sequence[str], metric: str = "all") -> float:
    """One sample's score in [0, 1] under ``metric`` ("all" or "part")."""
    try:
        fn = METRICS[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}; expected one of {sorted(METRICS)}") from None
    return fn(prediction, references)


def wilson(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (default 95%)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0 or n successes the bound is exactly 0 or 1; the formula only rounds near it.
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    return lo, 1.0 if successes == n else min(1.0, centre + half)


def bootstrap(
    scores: Sequence[float], *, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (seeded, so reports are reproducible)."""
    if not scores:
        raise ValueError("bootstrap needs at least one score")
    rng, n = random.Random(seed), len(scores)
    means = sorted(sum(rng.choices(scores, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * (resamples - 1))], means[math.ceil((1 - tail) * (resamples - 1))]


def mean_ci(scores: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)`` of per-sample scores in [0, 1]; 95% interval."""
    if not scores:
        raise ValueError("no scores to summarise")
    mean = sum(scores) / len(scores)
    if all(s in (0.0, 1.0) for s in scores):
        return (mean, *wilson(round(sum(scores)), len(scores)))
    return (mean, *bootstrap(scores))
