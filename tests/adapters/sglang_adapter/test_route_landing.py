"""Under SGLang's overlap scheduler (``--kv-overlap``, the default) a decode step's routing is
planned at once and lands (units and blocks move) at the next step's metadata, so the host never
waits for the device when it routes: the step after it still reads the old tiers, and once it lands
the tiers, owner states and bytes are those of the serial order's routing."""

from __future__ import annotations

import pytest
import torch
from sglang_sim import require

require("sglang.srt.mem_cache.radix_cache")

from test_backend import KERNEL_POLICY, Harness  # noqa: E402

from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402

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
    serial, late = Harness(policy=POLICY), Harness(policy=POLICY, overlap_schedule=True)
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


# test_backend's kernel shape (windows of 16, head dim 64), routing every 2 decode steps only
GRAPH_POLICY = KERNEL_POLICY.replace("after_prefill, every(3)", "every(2)")


def _graph_harness(overlap: bool) -> Harness:
    h = Harness(policy=GRAPH_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                overlap_schedule=overlap)  # fmt: skip
    h.backend.init_cuda_graph_state(2, 2)
    h.capture(2)
    return h


@pytest.mark.parametrize("end", ["finish", "retract"])
def test_a_routing_landing_after_its_request_ended_drops_that_part(monkeypatch, end):
    """GPU run 16's crash (``KeyError`` in ``route_many``): a replayed step's routing is planned
    at the flush a request's close runs (``before_close``), so under ``--kv-overlap`` it was
    still pending when the view closed, and landed at the next step over a view that was gone.
    A close only drops (GPU run 34: run at one close, the step's work landed the routings of
    requests closing after it); the step's work waits for the next forward, where the closed
    request's part is not planned (GPU run 18: it held up the request's last token) and the
    other's is, landing when the next step is processed, with the serial order's tiers
    and owner states (not at the close: that made its landing depend on the batch); a part whose
    view closes while it is pending is dropped (its windows stay at the states its close
    left). Every slot, row and block comes back (finish: inserted in the tree, then evicted;
    retract: SGLang's ``cache_finished_req(is_insert=False)``)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    serial, late = _graph_harness(False), _graph_harness(True)
    sim = late.sim
    free0, avail0 = [len(f) for f in sim.pool.free_rows], sim.alloc.available_size()
    reqs = {}
    for h in (serial, late):
        a, c = h.start("a", list(range(1, 71))), h.start("c", list(range(5, 60)))
        h.step([a, c], [a.origin_input_ids, c.origin_input_ids], extend=True)
        for t in range(2):  # decode step 1: a's and c's routing is due
            h.replay([a, c], [[60 + t], [30 + t]], 2, rids=True)
        if end == "finish":
            h.finish(c)  # its close flushes the step: the routing is planned now
        else:
            c.output_ids = c.tokens[len(c.origin_input_ids) :]
            h.sim.cache.cache_finished_req(c, is_insert=False, kv_len_to_handle=len(c.tokens))
            h.sim.r2t.free_slots.append(c.req_pool_idx)
        reqs[h] = a
    assert late.backend.landing is None and late.backend.pending  # c's close only dropped
    before = tiers(late, "a")
    for h, a in reqs.items():
        h.replay([a], [[70]], 2, rids=True)  # step 2 still reads the old tiers: one step late
    assert [r.rid for r, _ in late.backend.landing[0]] == ["a"]  # planned a's only
    assert all(torch.equal(x, y) for x, y in zip(before, tiers(late, "a"), strict=True))
    for h, a in reqs.items():
        h.replay([a], [[71]], 2, rids=True)  # step 2 processed first: a's part lands
    assert late.backend.landing is None
    assert any(not torch.equal(x, y) for x, y in zip(before, tiers(late, "a"), strict=True))
    for li in range(sim.L):
        want, got = (h.backend.sessions["a"].store.tiers(li) for h in (serial, late))
        assert torch.equal(want, got), li
    wa = late.sim.cache.views["a"].windows  # the same slots in both (same allocations)
    assert torch.equal(serial.sim.cache.views["a"].windows, wa)
    want, got = (h.sim.pool.owner_all[:, :, wa] for h in (serial, late))
    assert torch.equal(want, got)  # (c's windows stay as its close left them: not routed)
    # that replay was decode step 3: a's routing is due at the next flush
    stores = {h: h.backend.sessions["a"].store for h in reqs}
    steps = {h: st.step for h, st in stores.items()}
    for h, a in reqs.items():
        h.finish(a)  # its close's flush: routed in the serial order, not planned late
    assert late.backend.landing is None
    assert stores[serial].step == steps[serial] + 1 and stores[late].step == steps[late]
    for h in reqs:
        h.sim.cache.evict(EvictParams(num_tokens=10_000))
        h.sim.cache.reset()  # flush_cache: lands what is pending (nothing: a ended)
    assert late.backend.landing is None
    assert sim.alloc.available_size() == avail0
    assert [len(f) for f in sim.pool.free_rows] == free0
    assert set(sim.pool.blocks_in_use().values()) == {0}
    assert bool((sim.pool.owner_all < 0).all()) and not bool(sim.pool.ref_all.any())


def _rdkv_every_2() -> str:
    from test_rdkv import DEFERRED, RDKV_TEXT

    text = RDKV_TEXT.replace(DEFERRED, "schedule: after_prefill, every(2)")
    return text.replace("budget: 10%", "budget: 40%")


def _replayed(policy: str, overlap: bool, pages: int, blocks) -> Harness:
    from tiered_radix.adapters.sglang.options import KVOptions

    h = Harness(policy=policy, head_dim=64, pages=pages, blocks=blocks, overlap_schedule=overlap,
                options=KVOptions(decode="kernel"))  # fmt: skip
    h.backend.init_cuda_graph_state(2, 2)
    h.capture(2)
    return h


@pytest.mark.parametrize("policy", ["windows", "rdkv"])
def test_a_replayed_routing_lands_after_the_next_token_as_the_serial_one(monkeypatch, policy):
    """GPU run 18's crashes: a replayed step's routing is planned at the next step's metadata
    and, under ``--kv-overlap``, lands at the one after, so that step's token is appended in
    between: qevict's stack grew for it (a 30K prompt's 938 windows -> 1,876: the masks no
    longer matched) and rdkv's K set was planned over one token fewer than the store held.
    Here request ``a``'s 62-token prompt fills its 4 windows of 16 with the second decode token;
    decode step 1's routing is planned at the third step's metadata, whose token starts a fifth
    window, and lands at the fourth's: the tiers and bytes are the serial order's. The steps
    after read what each order left (late: old tiers one step longer), so later routings may
    differ; they land too."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if policy == "windows":
        text, pages, blocks = GRAPH_POLICY, 30, PoolBlocks(64, 64)
    else:
        text, pages, blocks = _rdkv_every_2(), 12, PoolBlocks(24, 0, 1 << 20)
    serial, late = (_replayed(text, overlap, pages, blocks) for overlap in (False, True))
    reqs = {}
    for h in (serial, late):
        a, c = h.start("a", list(range(1, 63))), h.start("c", list(range(5, 45)))
        h.step([a, c], [a.origin_input_ids, c.origin_input_ids], extend=True)
        reqs[h] = a, c
    stores = {r: [h.backend.sessions[r].store for h in (serial, late)] for r in "ac"}
    cap = stores["a"][1].stack.capacity

    def replay(t: int) -> None:
        for h, (a, c) in reqs.items():
            h.replay([a, c], [[60 + t], [30 + t]], 2, rids=True)

    for t in range(3):
        replay(t)
    assert late.backend.landing is not None and stores["a"][1].stack.capacity > cap
    replay(3)  # the late routing lands first
    assert late.backend.landing is None
    assert late.backend.stats()["routes"] == serial.backend.stats()["routes"]
    for s, g in stores.values():
        assert s.step == g.step > 0
        for li in range(serial.sim.L):
            assert torch.equal(s.tiers(li), g.tiers(li)), li
        assert s.bytes_used() == g.bytes_used()
    for t in range(4, 9):
        replay(t)
    late.backend.flush()
    late.backend._land()
    assert late.backend.stats()["routes"] == serial.backend.stats()["routes"] > 3


GRAPHED = ["kivi", "qevict", "rdkv"]  # the shipped policies whose decode replays graphs


@pytest.mark.parametrize("name", GRAPHED)
def test_a_shipped_policy_decodes_under_graphs_in_the_overlap_order(monkeypatch, name):
    """The schedule GPU run 18 served and the eager CPU tests missed: graph replays under the
    overlap default (a step's routing planned at the next step's metadata, landed at the one
    after, tokens appended between), a request finishing mid-run (its close's flush), stacks
    growing past their first capacity; the shipped policy at 35% (as the batch-invariance
    tests run it). Every routing lands, and every slot, row, block and Zone A page comes back."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from test_batch_invariance import policy_text

    from tiered_radix.adapters.sglang.options import KVOptions

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    h = Harness(policy=policy_text(name), head_dim=64, pages=24,
                blocks=PoolBlocks(96, 96, 1 << 20), overlap_schedule=True,
                options=KVOptions(decode="kernel"))  # fmt: skip
    h.backend.init_cuda_graph_state(2, 2)
    h.capture(2)
    sim = h.sim
    free0, avail0 = [len(f) for f in sim.pool.free_rows], sim.alloc.available_size()
    # a: 48 tokens in 2 windows of 32; qevict's routing of decode step 15 is planned at step
    # 16's metadata, whose token (the 65th) makes a's stack grow before it lands
    a, c = h.start("a", list(range(1, 49))), h.start("c", list(range(5, 69)))
    h.step([a, c], [a.origin_input_ids, c.origin_input_ids], extend=True)
    cap = h.backend.sessions["a"].store.stack.capacity
    pending = 0
    for t in range(34):
        live = [a, c] if t < 20 else [a]
        h.replay(live, [[60 + t % 30], [30 + t % 30]][: len(live)], 2, rids=True)
        pending += h.backend.landing is not None
        if t == 19:
            h.finish(c)  # closes after step 20 was planned, as SGLang's overlap loop does
    assert h.backend.sessions["a"].store.stack.capacity > cap
    assert pending > 0 and h.backend.stats()["routes"] >= 2
    h.finish(a)
    assert h.backend.landing is None
    sim.cache.evict(EvictParams(num_tokens=10_000))
    sim.cache.reset()
    assert sim.alloc.available_size() == avail0
    assert [len(f) for f in sim.pool.free_rows] == free0
    assert set(sim.pool.blocks_in_use().values()) <= {0}
    if sim.pool.zones is not None:
        assert not sim.pool.zones.holds("a") and not sim.pool.zones.holds("c")


def _tiers_and_outputs(h: Harness, reqs, steps: int, ends: int | None, eager_at=()):
    """Decode ``steps`` steps of ``reqs`` (a, c) under the overlap order: replays of the batch-2
    graph, or eager steps at the steps in ``eager_at``; c's last token comes at step ``ends``
    (it runs one more step, then its view closes) or never. Returns, for every step, the tiers
    a's first layer read (taken as the step's layer 0 runs) and a's output rows."""
    a, c = reqs
    read = []

    def reading(forward):
        def at_layer(q, k, v, layer, fb, *args, **kw):
            if layer.layer_id == 0:
                read.append(tiers(h, "a"))
            return forward(q, k, v, layer, fb, *args, **kw)

        return at_layer

    b = h.backend  # the harness's eager step calls forward_extend for decode too
    b.forward_decode, b.forward_extend = reading(b.forward_decode), reading(b.forward_extend)
    outs = []
    for t in range(steps):
        live = [a, c] if ends is None or t <= ends + 1 else [a]
        new = [[60 + t], [30 + t]][: len(live)]
        if t in eager_at:
            out = h.step(live, new, extend=False)
        else:
            out = h.replay(live, new, 2, rids=True)
        if ends is not None and t == ends + 1:
            h.finish(c)  # after step t+1 was launched, as SGLang's overlap loop closes it
        outs.append([o[0].clone() for o in out])
    return list(zip(read, outs, strict=True))


def _overlapped(monkeypatch, n: int) -> list[tuple[Harness, tuple]]:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = []
    for _ in range(n):
        h = _graph_harness(True)
        a, c = h.start("a", list(range(1, 71))), h.start("c", list(range(5, 60)))
        h.step([a, c], [a.origin_input_ids, c.origin_input_ids], extend=True)
        runs.append((h, (a, c)))
    return runs


def _same_steps(got, want, outputs: bool = True) -> None:
    """The tiers read at every step equal, and with ``outputs`` the output rows too."""
    for t, ((tg, og), (tw, ow)) in enumerate(zip(got, want, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(tg, tw, strict=True)), f"tiers, step {t}"
        if outputs:
            assert all(torch.equal(x, y) for x, y in zip(og, ow, strict=True)), f"output, step {t}"


@pytest.mark.parametrize("ends", [0, 1, 2])
def test_a_routing_lands_at_the_same_step_whether_or_not_another_request_ends(monkeypatch, ends):
    """GPU run 27's batch invariance: the flush a closing request runs processes the step just
    replayed for the whole batch; it used to land the routing still pending from the step
    before too, so the routing it then planned for the other requests landed at the next
    step's metadata, a step earlier than when nobody closes. Request a's routings (every 2
    steps) must land at the same steps, and a read the same tiers and get the same outputs at
    every step, whether c ends at step ``ends`` or runs on (the batch is padded to the same
    graph either way)."""
    (h_end, r_end), (h_on, r_on) = _overlapped(monkeypatch, 2)
    got = _tiers_and_outputs(h_end, r_end, 8, ends)
    want = _tiers_and_outputs(h_on, r_on, 8, None)
    assert h_on.backend.stats()["routes"] >= 3
    _same_steps(got, want)


def test_a_routing_lands_at_the_same_step_after_an_eager_step_as_after_a_replay(monkeypatch):
    """A batch too large for the graph buffers decodes eagerly, which SGLang decides per step
    from the batch: an eager step's routing (planned at its last layer) used to land at the
    next step's metadata, a replay's (planned at the next step's metadata) one step later. Both
    land when the next step is processed, so a's tiers and outputs are those of all-replay
    decode at every step."""
    (h_mix, r_mix), (h_graph, r_graph) = _overlapped(monkeypatch, 2)
    got = _tiers_and_outputs(h_mix, r_mix, 8, None, eager_at={1, 3, 4})
    want = _tiers_and_outputs(h_graph, r_graph, 8, None)
    _same_steps(got, want, outputs=False)  # eager decode reads through another path
