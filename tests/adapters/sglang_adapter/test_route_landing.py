"""Under ``--kv-overlap`` a decode step's routing is planned at once and lands (units and blocks
move) at the next step's metadata, so the host never waits for the device when it routes: the
step after it still reads the old tiers, and once it lands the tiers, owner states and bytes
are those of the serial order's routing."""

from __future__ import annotations

import torch
from sglang_sim import require

require("sglang.srt.mem_cache.radix_cache")

from test_backend import Harness  # noqa: E402

from tiered_radix.adapters.sglang.options import KVOptions  # noqa: E402

POLICY = """
policy: landing
budget: 40%
units: window(size=4)
protect: {sinks: 0, recent: 4}
scores:
  score: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=4)
  evicted: evict
allocate: {method: rank, by: score, shares: {full: 50%, int2: 50%}}
schedule: every(2)
ledger: write_once
"""


def tiers(h: Harness, rid: str) -> list[torch.Tensor]:
    store = h.backend.sessions[rid].store
    return [store.tiers(li).clone() for li in range(h.sim.L)]


def test_an_overlapped_routing_lands_one_step_late_as_the_serial_one():
    serial, late = Harness(policy=POLICY), Harness(policy=POLICY, options=KVOptions(overlap=True))
    runs = []
    for h in (serial, late):
        req = h.start("a", list(range(1, 39)))
        h.step([req], [req.origin_input_ids], extend=True)
        h.step([req], [[50]], extend=False)
        before = tiers(h, "a")
        h.step([req], [[51]], extend=False)  # decode step 1: its routing is due
        runs.append((h, req, before, tiers(h, "a")))
    (_, _, b0, routed), (_, _, b1, pending) = runs
    assert all(torch.equal(x, y) for x, y in zip(b0, b1, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(b0, routed, strict=True))  # it moved
    assert all(torch.equal(x, y) for x, y in zip(b1, pending, strict=True))  # not yet
    assert late.backend.landing is not None
    for h, req, _, _ in runs:
        h.step([req], [[52]], extend=False)  # no routing due; the late one lands first
    assert late.backend.landing is None
    assert all(torch.equal(x, y) for x, y in zip(tiers(serial, "a"), tiers(late, "a"), strict=True))
    assert torch.equal(serial.sim.pool.owner_all, late.sim.pool.owner_all)
    assert serial.sim.pool.bytes_used() == late.sim.pool.bytes_used()
    assert serial.backend.stats()["demote"] == late.backend.stats()["demote"] > 0
