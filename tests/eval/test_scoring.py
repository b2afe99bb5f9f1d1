"""String-match scoring (RULER's definitions) and the confidence intervals."""

from __future__ import annotations

import itertools

import pytest

from tiered_radix.eval.scoring import (
    bootstrap,
    mean_ci,
    score,
    string_match_all,
    string_match_part,
    wilson,
)


def test_match_all_is_the_fraction_found():
    refs = ["1234567", "7654321", "5555555", "9999999"]
    assert string_match_all("1234567 and 7654321", refs) == 0.5
    assert string_match_all("none here", refs) == 0.0
    assert string_match_all("9999999, 5555555, 7654321; 1234567", refs) == 1.0


def test_match_part_is_any():
    refs = ["apple", "pear"]
    assert string_match_part("I like PEARS", refs) == 1.0
    assert string_match_part("", refs) == 0.0
    assert string_match_part("plum", refs) == 0.0


def test_case_whitespace_and_control_characters():
    assert string_match_all("  Answer: HOLLOW-Lamp\n", ["hollow-lamp"]) == 1.0
    # RULER drops non-printable output before matching
    assert string_match_all("12\x0034\x1b567", ["1234567"]) == 1.0
    assert string_match_all("123 4567", ["1234567"]) == 0.0  # no fuzzy matching
    assert string_match_all("12345678", ["1234567"]) == 1.0  # substring, as in RULER


def test_errors():
    with pytest.raises(ValueError, match="at least one reference"):
        string_match_all("x", [])
    with pytest.raises(ValueError, match="unknown metric"):
        score("x", ["x"], "exact")
    with pytest.raises(ValueError):
        wilson(3, 2)
    with pytest.raises(ValueError):
        mean_ci([])


def test_wilson_known_values():
    # Textbook values (Newcombe 1998, Table I; Brown, Cai & DasGupta 2001).
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)


@pytest.mark.parametrize("n", [1, 3, 7, 20])
def test_wilson_symmetry_and_containment(n):
    for k in range(n + 1):
        lo, hi = wilson(k, n)
        lo2, hi2 = wilson(n - k, n)
        assert lo == pytest.approx(1 - hi2) and hi == pytest.approx(1 - lo2)
        assert 0 <= lo <= k / n <= hi <= 1


def test_bootstrap_against_exhaustive_resampling():
    scores = [0.0, 0.25, 0.5, 1.0]
    n = len(scores)
    means = sorted(sum(c) / n for c in itertools.product(scores, repeat=n))  # all 4^4 resamples
    exact_lo = means[int(0.025 * (len(means) - 1))]
    exact_hi = means[-1 - int(0.025 * (len(means) - 1))]
    lo, hi = bootstrap(scores, resamples=20000, seed=1)
    step = 0.25 / n  # resample means lie on this grid
    assert abs(lo - exact_lo) <= step + 1e-12 and abs(hi - exact_hi) <= step + 1e-12
    assert bootstrap(scores, seed=5) == bootstrap(scores, seed=5)


def test_mean_ci_picks_the_interval():
    m, lo, hi = mean_ci([1.0, 1.0, 0.0, 1.0])
    assert m == 0.75 and (lo, hi) == wilson(3, 4)
    m, lo, hi = mean_ci([0.5, 0.75, 1.0, 0.25])
    assert m == 0.625 and 0.25 <= lo < m < hi <= 1.0
