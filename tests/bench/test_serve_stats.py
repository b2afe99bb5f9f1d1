"""The serving benchmark's statistics (bench/serving/stats.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from serving.stats import hit_rate, percentile, reprefilled, summarize  # noqa: E402


def rec(**kw) -> dict:
    base = dict(conversation=0, turn=0, ok=True, error=None, start_s=0.0, end_s=1.0, ttft_s=0.1,
                tpot_s=0.01, prompt_tokens=100, cached_tokens=0, output_tokens=10,
                prior_tokens=0, recalled=None, answer="")  # fmt: skip
    return base | kw


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    rng = random.Random(0)
    xs = [rng.expovariate(1.0) for _ in range(101)]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([3.0, 1.0], 50) == 2.0
    assert percentile([5.0], 99) == 5.0


def test_percentile_edges():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_hit_rate_counts_successful_requests_only():
    records = [rec(prompt_tokens=100, cached_tokens=0), rec(prompt_tokens=300, cached_tokens=200),
               rec(ok=False, prompt_tokens=0, cached_tokens=0)]  # fmt: skip
    assert hit_rate(records) == pytest.approx(200 / 400)
    assert hit_rate([rec(ok=False)]) is None


def test_reprefilled_is_lost_history():
    records = [
        rec(turn=0, prompt_tokens=1000, cached_tokens=0, prior_tokens=0),  # new history
        rec(turn=1, prompt_tokens=1200, cached_tokens=1100, prior_tokens=1100),  # all hit
        rec(turn=2, prompt_tokens=1400, cached_tokens=300, prior_tokens=1300),  # 1000 lost
    ]
    assert reprefilled(records) == 1000


def test_summarize():
    records = [
        rec(turn=0, start_s=1.0, end_s=2.0, ttft_s=0.5, tpot_s=0.02, output_tokens=30),
        rec(turn=1, start_s=2.0, end_s=5.0, ttft_s=1.5, tpot_s=0.04, output_tokens=50,
            prompt_tokens=200, cached_tokens=150, prior_tokens=130, recalled=True),
        rec(conversation=1, turn=1, start_s=2.5, end_s=4.0, ttft_s=1.0, tpot_s=None,
            output_tokens=1, recalled=False),
        rec(conversation=2, turn=0, ok=False, start_s=0.0, end_s=9.0, ttft_s=None, tpot_s=None,
            output_tokens=0, prompt_tokens=0),
    ]  # fmt: skip
    s = summarize(records)
    assert s["requests"] == 4 and s["errors"] == 1
    assert s["duration_s"] == pytest.approx(4.0)  # 1.0 .. 5.0, the failed request excluded
    assert s["output_tok_s"] == pytest.approx(81 / 4.0)
    assert s["ttft_p50_s"] == pytest.approx(1.0)
    assert s["ttft_p99_s"] == pytest.approx(float(np.percentile([0.5, 1.5, 1.0], 99)))
    assert s["tpot_p50_ms"] == pytest.approx(30.0)
    assert s["hit_rate"] == pytest.approx(150 / 400)
    assert s["reprefilled_tokens"] == 0
    assert s["recall"] == 0.5 and s["recall_n"] == 2


def test_summarize_all_failed():
    s = summarize([rec(ok=False)])
    assert s["output_tok_s"] is None and s["ttft_p50_s"] is None and s["recall"] is None
