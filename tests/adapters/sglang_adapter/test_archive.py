"""``evict(archive=...)`` in the SGLang pool: an owner that evicts a window keeps its ledger copy
(state ``S_A``, read by nobody); the next turn borrows it quantized; routings that need ledger
blocks take them from archived copies before degrading a move."""

from __future__ import annotations

import torch
from sglang_sim import POLICY, Sim, require
from test_radix import PROMPT, demote_all, nan_equal

require("sglang.srt.mem_cache.radix_cache")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from tiered_radix.adapters.sglang import usage  # noqa: E402
from tiered_radix.adapters.sglang.reps import S_A, S_EVICT, S_FULL, S_Q  # noqa: E402
from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402

ARCHIVE = POLICY.replace("evicted: evict", "evicted: evict(archive=int2)").replace(
    "tiny-qevict", "tiny-archive"
)
EVICT, INT2 = 2, 1  # engine tiers of the tiny policy


def test_an_evicting_owner_archives_and_reads_nothing():
    plain, arch = Sim(), Sim(policy=ARCHIVE)
    for sim in (plain, arch):
        sim.start("a", PROMPT)
        demote_all(sim, "a", [1], dst=INT2)
        demote_all(sim, "a", [0, 2], dst=EVICT)
    for li in range(arch.L):
        # the request reads exactly what it reads without an archive
        for x, y in zip(plain.cache.read("a", li), arch.cache.read("a", li), strict=True):
            assert nan_equal(x, y)
        assert bool((arch.cache.states("a", li)[:, [0, 2]] == S_A).all())
        assert bool((plain.cache.states("a", li)[:, [0, 2]] == S_EVICT).all())
    page = arch.pool.page_bytes
    assert arch.pool.bytes_used() == plain.pool.bytes_used() + 2 * arch.L * arch.H * page
    rep = usage.report(arch.pool, arch.cache.states_all("a"), 16, None, 1, 0, {})
    ref = usage.report(plain.pool, plain.cache.states_all("a"), 16, None, 1, 0, {})
    assert rep["bytes_held"] == ref["bytes_held"]  # archived copies are not the request's
    assert rep["archived_bytes"] == 2 * arch.L * arch.H * page
    assert rep["units_per_state"]["archived"] == 2 * arch.L * arch.H


def test_the_next_turn_borrows_archived_windows_quantized():
    sim = Sim(policy=ARCHIVE)
    sim.start("t1", PROMPT)
    demote_all(sim, "t1", [1], dst=INT2)  # window 1 demoted, then evicted: its copy reused
    demote_all(sim, "t1", [0, 1], dst=EVICT)  # window 0 evicted from full: a copy is made
    turn1 = sim.tokens("t1")
    sim.finish("t1")
    sim.start("t2", turn1 + [50, 51, 52, 53])
    ref = Sim()  # what the windows' INT2 copies read: a plain pool's request demoting them
    ref.start("r", PROMPT)
    demote_all(ref, "r", [0, 1], dst=INT2)
    for li in range(sim.L):
        st = sim.cache.states("t2", li)
        assert bool((st[:, :2] == S_Q).all()) and bool((st[:, 2:4] == S_FULL).all())
        k, v, kept = sim.cache.read("t2", li)
        rk, rv, _ = ref.cache.read("r", li)
        W = sim.W
        assert bool(kept[:, : 4 * W].all())
        assert nan_equal(k[:, : 2 * W], rk[:, : 2 * W])
        assert nan_equal(v[:, : 2 * W], rv[:, : 2 * W])
    # t2 evicts window 0 in its own view: a borrower drops its reference, the tree keeps its copy
    demote_all(sim, "t2", [0], dst=EVICT)
    owner = sim.pool.owner_all[:, :, sim.cache.views["t2"].windows[0]]
    assert bool((owner == S_A).all())
    assert bool((sim.cache.states("t2", 0)[:, 0] == S_EVICT).all())
    sim.finish("t2")
    sim.cache.evict(EvictParams(num_tokens=10**6))
    assert sim.pool.bytes_used() == 0
    assert all(int(r.abs().sum()) == 0 for r in sim.pool.ref)


def test_routings_take_ledger_blocks_from_archived_copies_first():
    # 2 layers x 2 heads; 6 ledger blocks a layer: a cached prefix's 2 archived windows hold 4
    sim = Sim(policy=ARCHIVE, blocks=PoolBlocks(full=40, quant=6))
    sim.start("old", PROMPT)
    demote_all(sim, "old", [0, 1], dst=EVICT)
    sim.finish("old")  # cached, archived windows 0-1 (4 copies a layer), nobody running holds them
    assert sim.pool.blocks_free()[1] == sim.L * (6 - 4)
    sim.start("new", [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 80, 81])  # 3 windows, no prefix
    demote_all(sim, "new", [0, 1], dst=INT2)  # needs 4 copies a layer: 2 free, 2 reclaimed
    assert sim.pool.degraded == 0
    assert sim.pool.reclaimed["archived_copies_dropped"] >= 2 * sim.L
    for li in range(sim.L):
        assert bool((sim.cache.states("new", li)[:, :2] == S_Q).all())
    sim.finish("new")
    sim.cache.evict(EvictParams(num_tokens=10**6))
    assert sim.pool.bytes_used() == 0


def test_cached_rows_demote_into_ledger_blocks_archived_copies_held():
    """Rows short for a new prompt: the pool demotes a cached prefix's rows to the ledger (the
    prefix stays cached, quantized) and takes the ledger blocks from archived copies if it must,
    rather than evicting the prefix."""
    # 10 row blocks a layer: "arch"'s last window and "kept"'s 4, 2 heads each; 6 ledger blocks
    sim = Sim(policy=ARCHIVE, blocks=PoolBlocks(full=10, quant=6))
    sim.start("arch", PROMPT)
    demote_all(sim, "arch", [0, 1, 2], dst=EVICT)  # 6 archived copies a layer: the ledger, full
    sim.finish("arch")
    sim.start("kept", [60 + i for i in range(16)])
    sim.finish("kept")
    assert sim.pool.blocks_free() == (0, 0)
    sim.start("new", [90, 91, 92, 93])  # one window: its rows come from "kept"'s, demoted
    assert sim.pool.reclaimed["cached_windows_demoted"] > 0
    assert sim.pool.reclaimed["archived_copies_dropped"] > 0
    assert sim.pool.reclaimed["cached_tokens_evicted"] == 0


def test_through_the_backend_turn_two_attends_to_what_turn_one_evicted():
    """The attention backend's sessions: turn 1 routes at its first decode step (its engine
    decides the same tiers with or without the archive); turn 2 borrows turn 1's evicted
    windows quantized under the archive (evicted without), and its prompt attends to them."""
    from test_backend import Harness

    seeded, kept = {}, {}
    deferred = "schedule: after_prefill(defer=true)"  # turn 2's prompt is read before routing
    for name, policy in (("plain", POLICY), ("archive", ARCHIVE)):
        h = Harness(policy=policy.replace("schedule: after_prefill", deferred))
        r1 = h.start("t1", list(range(1, 33)))
        h.step([r1], [r1.origin_input_ids], extend=True)
        h.step([r1], [[60]], extend=False)  # the deferred routing after prefill runs here
        tiers1 = [h.backend.sessions["t1"].store.tiers(li).clone() for li in range(h.sim.L)]
        turn1 = list(r1.tokens)
        h.finish(r1)
        r2 = h.start("t2", turn1 + [70, 71, 72, 73, 74])
        h.step([r2], [r2.origin_input_ids[r2.prefix_len :]], extend=True)
        seeded[name] = tiers1
        kept[name] = [h.sim.cache.read("t2", li)[2] for li in range(h.sim.L)]
    p1, a1 = seeded["plain"], seeded["archive"]
    for li in range(2):
        assert torch.equal(p1[li], a1[li])  # turn 1 decided alike
        evicted = a1[li] == EVICT
        assert evicted.any()
        # turn 2 read them: the windows turn 1 evicted are attended under the archive only
        W = 4
        tok = evicted.repeat_interleave(W, dim=1)
        n = tok.shape[1]
        assert bool(kept["archive"][li][:, :n][tok].all())
        assert not bool(kept["plain"][li][:, :n][tok].any())
    assert h.backend.stats()["borrowed_quantized"] > 0
