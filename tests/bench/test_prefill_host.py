"""The CPU prefill timing's batch plan (bench/prefill_host.py): SGLang's chunked prefill order,
every prompt token in exactly one batch, no batch over the chunk."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import prefill_host  # noqa: E402


def test_one_request_a_batch_when_prompt_and_chunk_match():
    plan = prefill_host.batches(prompt=8192, n=3, chunk=8192)
    assert plan == [[(0, 0, 8192)], [(1, 0, 8192)], [(2, 0, 8192)]]


def test_a_long_prompt_is_cut_and_the_next_request_fills_the_rest():
    plan = prefill_host.batches(prompt=300, n=2, chunk=256)
    assert plan == [[(0, 0, 256)], [(0, 256, 44), (1, 0, 212)], [(1, 212, 88)]]
    for prompt, n, chunk in ((1000, 3, 128), (64, 5, 100), (7, 1, 3)):
        plan = prefill_host.batches(prompt, n, chunk)
        assert all(sum(k for _, _, k in b) <= chunk for b in plan)
        for r in range(n):  # each request's tokens once, in order
            runs = [(s, k) for b in plan for q, s, k in b if q == r]
            assert [s for s, _ in runs] == [sum(k for _, k in runs[:i]) for i in range(len(runs))]
            assert sum(k for _, k in runs) == prompt
