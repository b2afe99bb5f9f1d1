"""TieredRadixCache: per-request views over refcounted windows (docs/sglang.md, 'Semantics')."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_sim import POLICY, POOL_KERNELS, Sim, require

require("sglang.srt.mem_cache.radix_cache")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from tiered_radix.adapters.sglang.reps import S_EVICT, S_FULL, S_Q, STATES  # noqa: E402
from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402
from tiered_radix.engine.events import Transitions  # noqa: E402
from tiered_radix.engine.signals import Signals  # noqa: E402
from tiered_radix.engine.store import TierStore  # noqa: E402

PROMPT = list(range(1, 17))  # 16 tokens: 4 windows of the tiny policy


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=7e7), torch.nan_to_num(b, nan=7e7))


def route_with_engine(sim: Sim, rid: str, seed: int) -> TierStore:
    """Run the real tier engine on the request's K/V and apply its transitions to the cache."""
    toks = sim.tokens(rid)
    store = TierStore(sim.policy, n_layers=sim.L, n_heads=sim.H, head_dim=sim.d)
    g = torch.Generator().manual_seed(seed)
    for li in range(sim.L):
        k, v = sim.kv(li, toks)
        store.append(li, k.transpose(0, 1), v.transpose(0, 1))
        store.observe(li, Signals(attn=torch.rand(sim.H, len(toks), generator=g)))
    sim.cache.route(rid, store.after_prefill())
    return store


def test_reads_match_the_tier_engine_after_routing():
    sim = Sim()
    sim.start("a", PROMPT + [30, 31, 32])  # 19 tokens: 4 windows and a partial one
    store = route_with_engine(sim, "a", 0)
    seen = set()
    for li in range(sim.L):
        k, v, kept = sim.cache.read("a", li)
        ek, ev, ekept = store.view(li)
        n = ek.shape[1]
        assert nan_equal(k[:, :n], ek) and nan_equal(v[:, :n], ev)
        assert torch.equal(kept[:, :n], ekept)
        seen |= set(sim.cache.states("a", li).flatten().tolist())
    assert {S_FULL, S_Q, S_EVICT} <= seen  # the engine used all three tiers


def test_multi_turn_reuses_quantized_windows_without_prefill():
    sim = Sim()
    sim.start("t1", PROMPT)
    sim.extend("t1", [40, 41, 42, 43])  # decode: 20 tokens, 5 windows
    route_with_engine(sim, "t1", 1)
    before = [sim.cache.read("t1", li) for li in range(sim.L)]
    states = [sim.cache.states("t1", li).clone() for li in range(sim.L)]
    turn1 = sim.tokens("t1")
    sim.finish("t1")
    rows = [len(f) for f in sim.pool.free_rows]
    req = sim.start("t2", turn1 + [50, 51, 52])
    assert req.prefix_len == 20  # every window of turn 1 came from the tree
    assert [len(f) for f in sim.pool.free_rows] == [r - sim.H for r in rows]  # one new window
    for li in range(sim.L):
        k, v, kept = sim.cache.read("t2", li)
        assert torch.equal(sim.cache.states("t2", li)[:, :5], states[li])
        assert nan_equal(k[:, :20], before[li][0][:, :20])
        assert nan_equal(v[:, :20], before[li][1][:, :20])
        assert torch.equal(kept[:, :20], before[li][2][:, :20])
    assert any(bool((s == S_Q).any()) for s in states)  # quantized windows were reused


def demote_all(sim: Sim, rid: str, units: list[int], dst: int) -> None:
    n = len(units) * sim.H * sim.L
    grid = [(li, h, u) for li in range(sim.L) for h in range(sim.H) for u in units]
    cols = [torch.tensor(c) for c in zip(*grid, strict=True)]
    t = Transitions(
        sim.pool.layout.engine_tiers,
        sim.pool.layout.evict_index,
        *cols,
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), dst),
        torch.zeros(n, dtype=torch.bool),
    )
    sim.cache.route(rid, t)


def test_shared_system_prompt_is_stored_once_and_demotions_stay_private():
    sim = Sim()
    sim.start("sys", PROMPT)
    sim.finish("sys")  # the system prompt is in the tree, at full precision
    used = sim.pool.bytes_used()
    sim.start("b", PROMPT + [60, 61, 62, 63])
    sim.start("c", PROMPT + [70, 71, 72, 73])
    vb, vc = sim.cache.views["b"], sim.cache.views["c"]
    assert torch.equal(vb.windows[:4], vc.windows[:4])  # same slots
    row = 2 * sim.W * sim.d * 2
    assert sim.pool.bytes_used() == used + 2 * sim.L * sim.H * row  # only the two suffixes
    c_before = [sim.cache.read("c", li) for li in range(sim.L)]
    demote_all(sim, "b", [0, 1], dst=1)  # b quantizes the shared windows 0, 1
    demote_all(sim, "b", [2], dst=2)  # and evicts window 2
    for li in range(sim.L):
        kc, vc_, keptc = sim.cache.read("c", li)
        assert torch.equal(kc, c_before[li][0]) and torch.equal(vc_, c_before[li][1])
        assert bool(keptc.all())
        kb, _, keptb = sim.cache.read("b", li)
        W = sim.W
        assert not torch.equal(kb[:, : 2 * W], kc[:, : 2 * W])  # b reads its 2-bit copies
        assert not bool(keptb[:, 2 * W : 3 * W].any())
    # the full rows stay (the tree and c hold them) and b's copies are extra
    assert sim.pool.bytes_used() > used + 2 * sim.L * sim.H * row
    sim.finish("b")
    sim.finish("c")
    sim.cache.evict(EvictParams(num_tokens=10**6))
    assert sim.pool.bytes_used() == 0


def random_moves(sim: Sim, rid: str, seed: int) -> Transitions:
    """Half of the request's complete (layer, head, window) units to random engine tiers."""
    g = torch.Generator().manual_seed(seed)
    units = len(sim.tokens(rid)) // sim.W
    m = sim.L * sim.H * units
    pick = torch.randperm(m, generator=g)[: max(1, m // 2)]
    li, rest = pick // (sim.H * units), pick % (sim.H * units)
    dst = torch.randint(0, 3, (pick.numel(),), generator=g)
    z = torch.zeros_like(pick)
    tiers = sim.pool.layout.engine_tiers
    return Transitions(tiers, 2, li, rest // units, rest % units, z, dst, z.bool())


def test_routing_requests_together_equals_one_after_the_other():
    """route_many moves a shared prefix's windows once per holder, in request order: the same
    reads, states, references and bytes as routing each request alone."""
    sims = [Sim(), Sim()]
    for sim in sims:
        sim.start("sys", PROMPT)
        sim.finish("sys")  # windows 0-3 in the tree: b and c borrow them, d owns its own
        sim.start("b", PROMPT + [60, 61, 62, 63])
        sim.start("c", PROMPT + [70, 71, 72, 73])
        sim.start("d", [80 + i for i in range(12)])
    for rnd in range(3):  # later rounds move windows earlier rounds quantized or evicted
        moves = [(rid, random_moves(sims[0], rid, 10 * rnd + i)) for i, rid in enumerate("bcd")]
        sims[0].cache.route_many(moves)
        for rid, t in moves:
            sims[1].cache.route(rid, t)
    together, alone = sims
    assert together.pool.bytes_used() == alone.pool.bytes_used()
    assert torch.equal(together.pool.owner_all, alone.pool.owner_all)
    for li in range(together.L):
        assert torch.equal(together.pool.ref[li], alone.pool.ref[li])
        assert torch.equal(together.pool.ref[li], expected_refs(together)[li])
        for rid in "bcd":
            assert torch.equal(together.cache.states(rid, li), alone.cache.states(rid, li))
            for a, b in zip(together.cache.read(rid, li), alone.cache.read(rid, li), strict=True):
                assert nan_equal(a, b)
    shared = [together.cache.states(rid, 0)[:, :4] for rid in "bc"]
    assert not torch.equal(*shared)  # b and c took different tiers on the windows they share


def expected_refs(sim: Sim) -> list[torch.Tensor]:
    """Reference counts recomputed from the holders (owners and open views)."""
    out = []
    for li in range(sim.L):
        ref = torch.zeros_like(sim.pool.ref[li])
        h = torch.arange(sim.H)[:, None].expand(sim.H, sim.pool.n_windows)
        w = torch.arange(sim.pool.n_windows)[None].expand_as(h)
        holders = [(sim.pool.owner[li], h, w)]
        for view in sim.cache.views.values():
            b = view.borrowed
            hh, ww = torch.arange(sim.H)[:, None].expand(-1, int(b.sum())), view.windows[b]
            holders.append((view.state[li][:, b], hh, ww[None].expand_as(hh)))
        for state, hh, ww in holders:
            for s in STATES:
                m = state == s
                for kind in sim.pool.layout.reps(s):
                    ref[kind].index_put_(
                        (hh[m], ww[m]), torch.ones(int(m.sum()), dtype=ref.dtype), accumulate=True
                    )
        out.append(ref)
    return out


OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "decode", "route", "finish", "abort", "evict"]),
        st.integers(0, 3),
        st.integers(0, 10**6),
    ),
    min_size=4,
    max_size=18,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.booleans(), st.sampled_from(POOL_KERNELS))
def test_accounting_returns_to_the_start(ops, archive, kernels):
    """(``archive``: the policy archives what it evicts, ``S_A``; small ledger, so routings
    reclaim archived copies too. ``kernels``: the pool keeps its tables with the move kernels,
    run by Triton's interpreter here.)"""
    policy = POLICY.replace("evicted: evict", "evicted: evict(archive=int2)") if archive else POLICY
    quant = 3 if archive else 240
    sim = Sim(pages=30, blocks=PoolBlocks(full=240, quant=quant), policy=policy, kernels=kernels)
    start_pages, start_rows = sim.alloc.available_size(), [len(f) for f in sim.pool.free_rows]
    prompts = [PROMPT, PROMPT + [20, 21, 22], PROMPT[:8] + [25, 26], [30, 31, 32, 33, 34]]
    live: list[str] = []
    for n, (op, a, seed) in enumerate(ops):
        if op == "start" and len(live) < 3:
            try:
                sim.start(f"r{n}", prompts[a])
                live.append(f"r{n}")
            except MemoryError:
                sim.cache.evict(EvictParams(num_tokens=10**6))
        elif op == "decode" and live:
            try:
                sim.extend(live[a % len(live)], [40 + a, 41 + a])
            except MemoryError:
                pass
        elif op == "route" and live:
            rid = live[a % len(live)]
            if len(sim.tokens(rid)) >= sim.W:  # complete windows only
                sim.cache.route(rid, random_moves(sim, rid, seed))
        elif op in ("finish", "abort") and live:
            sim.finish(live.pop(a % len(live)), insert=op == "finish")
        elif op == "evict":
            sim.cache.evict(EvictParams(num_tokens=4 * (a + 1)))
        for li, ref in enumerate(expected_refs(sim)):
            assert torch.equal(sim.pool.ref[li], ref)
            assert torch.equal(sim.pool.block[li] > 0, ref > 0)
    for rid in live:
        sim.finish(rid)
    sim.cache.evict(EvictParams(num_tokens=10**6))
    assert sim.alloc.available_size() == start_pages
    assert [len(f) for f in sim.pool.free_rows] == start_rows
    assert sim.pool.bytes_used() == 0
    assert all(int(r.abs().sum()) == 0 for r in sim.pool.ref)
