"""The list-rebuild memory bench (bench/decode_lists_memory.py) on a tiny batch: each way
builds the lists of its synthetic h2o-shaped pool and says how many candidate entries it built;
the layer runs build the same buffers as the whole at once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import decode_lists_memory as bench  # noqa: E402


@pytest.mark.parametrize("way", bench.WAYS)
def test_each_way_counts_the_entries_it_built(way):
    lengths = [5, 9, 3]
    r = bench.one(way, lengths, context=16)
    B, longest = (4, 16) if way == "context" else (3, 9)  # context: a padding request of 16
    assert r["entries"] == bench.L * B * bench.H * longest * bench.W
    assert r["runs"] >= 1 and r["seconds"] >= 0 and r["peak_over_resident_bytes"] >= 0


def test_layer_runs_fill_the_buffers_as_one_build_does():
    from tiered_radix.adapters.sglang import graph, trizone

    lengths = [5, 9, 3]
    pool, views = bench.pool_and_views(lengths)
    bufs = []
    for max_entries in (1 << 30, 1):
        g = graph.GraphDecode(pool, 3, sum(lengths) + 3, 16, side_output=False)
        g.load(3, trizone.candidate_chunks(pool, views, lengths, g.n_max, True, max_entries))
        bufs.append((g.full_ptr.clone(), g.full_end.clone(), g.slots.clone(), g.units.clone()))
    for a, b in zip(*bufs, strict=True):
        assert torch.equal(a, b)
    kept = int(bufs[0][0][0, 3 * bench.H])  # every token of every request listed in layer 0
    assert kept == bench.H * sum(lengths)
