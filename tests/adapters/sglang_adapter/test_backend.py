"""TieredAttnBackend on CPU: the outputs and tier decisions of a request served through the pool
equal those of the tier engine holding the rows itself (TierStore + the same attention), through
prefill, decode steps with routing, a second turn that reuses the first from the radix tree, and
request ends that give every block back."""

from __future__ import annotations

import gzip
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from sglang_sim import POLICY, Sim, require

require("sglang.srt.mem_cache.radix_cache")

from tiered_radix.adapters.sglang import backend as backend_module  # noqa: E402
from tiered_radix.adapters.sglang import plugin, trizone  # noqa: E402
from tiered_radix.adapters.sglang.backend import TieredAttnBackend, window_starts  # noqa: E402
from tiered_radix.adapters.sglang.options import KVOptions, OptionsError  # noqa: E402
from tiered_radix.adapters.sglang.profile import StepProfiler  # noqa: E402
from tiered_radix.adapters.sglang.reps import PoolConfigError  # noqa: E402
from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402
from tiered_radix.adapters.sglang.stats import log  # noqa: E402
from tiered_radix.engine.attention import attend  # noqa: E402
from tiered_radix.engine.store import TierStore  # noqa: E402

HQ = 4  # query heads: GQA group 2 over the Sim's 2 KV heads


class Mode:
    def __init__(self, extend: bool) -> None:
        self.extend = extend

    def is_idle(self):
        return False

    def is_extend(self):
        return self.extend

    def is_decode(self):
        return not self.extend

    def is_target_verify(self):
        return False


class Harness:
    """A scheduler stand-in: allocates slots, builds forward batches, runs every layer."""

    def __init__(
        self, q_heads: slice = slice(0, HQ), tp_group=None, options: KVOptions | None = None,
        overlap_schedule: bool = False, **sim,
    ) -> None:  # fmt: skip
        """``q_heads`` of the model's ``HQ`` query heads (a tensor-parallel rank's slice, with
        ``kv_heads=`` for the Sim and SGLang's ``tp_group`` stand-in); ``options`` the launch's
        ``--kv-*`` flags, for the pool and the backend; ``overlap_schedule``: SGLang's overlap
        scheduler runs (its server args say so; the harness steps in either order)."""
        self.sim = Sim(**({"pages": 60} | sim), options=options)
        context = SimpleNamespace(context_len=self.sim.r2t.req_to_token.shape[1])
        runner = SimpleNamespace(
            token_to_kv_pool=self.sim.pool, tp_group=tp_group, model_config=context,
            server_args=SimpleNamespace(disable_overlap_schedule=not overlap_schedule),
        )  # fmt: skip
        kv = sim.get("kv")  # a launch's policy set: the backend computes what any reads
        self.backend = TieredAttnBackend(runner, options, kv.served().policies if kv else None)
        g = torch.Generator().manual_seed(11)
        self.wq = torch.randn(self.sim.L, 100, HQ, self.sim.d, generator=g)[:, :, q_heads]
        self.hq = self.wq.shape[2]
        self.layers = [
            SimpleNamespace(layer_id=li, tp_q_head_num=self.hq, qk_head_dim=self.sim.d,
                            v_head_dim=self.sim.d, scaling=self.sim.d**-0.5, logit_cap=0,
                            sliding_window_size=-1)
            for li in range(self.sim.L)
        ]  # fmt: skip

    def step(self, reqs: list[SimpleNamespace], new: list[list[int]], extend: bool,
             graph_copy: bool = False):  # fmt: skip
        """One forward of ``new[i]`` tokens for each request; returns per-layer outputs.
        ``graph_copy``: the layers get what SGLang's prefill graph replay hands them, a batch of
        its own (no request ids) whose slots are a copy of the metadata's."""
        sim = self.sim
        locs, pre = self._locs(reqs, new)
        fb = SimpleNamespace(
            forward_mode=Mode(extend),
            seq_lens_cpu=torch.tensor([len(r.tokens) for r in reqs]),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs]),
            extend_prefix_lens_cpu=pre,
            extend_seq_lens_cpu=[len(t) for t in new],
            rids=[r.rid for r in reqs],
            out_cache_loc=torch.cat(locs),
        )
        # SGLang's ForwardBatch.init_new, through the plugin's hook: the slots as host ints
        runner = SimpleNamespace(attn_backend=self.backend)
        plugin.forward_batch_made(fb, None, SimpleNamespace(reqs=reqs), runner)
        self.backend.init_forward_metadata(fb)
        if graph_copy:
            fb = SimpleNamespace(forward_mode=fb.forward_mode, rids=None,
                                 out_cache_loc=fb.out_cache_loc.clone())  # fmt: skip
        outs = []
        for li, layer in enumerate(self.layers):
            ks, vs, qs = [], [], []
            for toks, p in zip(new, pre, strict=True):
                k, v = sim.kv(li, toks, p)
                ks.append(k)
                vs.append(v)
                qs.append(self.wq[li, torch.tensor(toks)] + 0.1 * p)  # noqa: B023
            q = torch.cat(qs).reshape(-1, self.hq * sim.d).bfloat16().float()  # as a bf16 model's
            outs.append(self.backend.forward_extend(q, torch.cat(ks), torch.cat(vs), layer, fb))
        return outs

    def _locs(self, reqs, new) -> tuple[list[torch.Tensor], list[int]]:
        """Slots for ``new[i]`` more tokens of each request (allocating windows as needed)."""
        sim, W = self.sim, self.sim.W
        locs, pre = [], []
        for req, toks in zip(reqs, new, strict=True):
            start = len(req.tokens)
            row = sim.r2t.req_to_token[req.req_pool_idx]
            have = -(-start // W) * W
            end = start + len(toks)
            if end > have:
                got = sim.alloc.alloc(-(-(end - have) // W) * W)
                row[have : have + got.numel()] = got.int()
            locs.append(row[start:end].long())
            pre.append(start)
            req.tokens = req.tokens + toks
        return locs, pre

    def capture(self, bs: int) -> None:
        """What SGLang's graph runner does for batch size ``bs``: metadata with every request
        padding, then the forward it records."""
        fb = SimpleNamespace(
            batch_size=bs, forward_mode=Mode(False), num_padding=bs,
            req_pool_indices=torch.zeros(bs, dtype=torch.long),
            seq_lens_cpu=torch.ones(bs, dtype=torch.long),
            out_cache_loc=torch.zeros(bs, dtype=torch.long),
        )  # fmt: skip
        self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        self._layers(fb, *self._dummy(bs))

    def _dummy(self, bs: int):
        g = torch.Generator().manual_seed(bs)
        shape = (self.sim.L, bs, self.sim.H, self.sim.d)
        return (
            torch.randn(shape, generator=g),
            torch.randn(shape, generator=g),
            torch.randn(self.sim.L, bs, self.hq * self.sim.d, generator=g),
        )

    def replay(self, reqs, new: list[list[int]], bs: int, rids: bool = False):
        """One decode step as a replay of the graph of batch size ``bs``: the metadata sees
        SGLang's replay view (padded indices and lengths, no rids; with ``rids`` the batch's
        request ids arrive as the plugin's ``graph_execute`` hands them over), the layers get
        padded q/k/v; returns the real rows of every layer's output."""
        locs, pre = self._locs(reqs, new)
        raw, sim = len(reqs), self.sim
        pad = bs - raw
        fb = SimpleNamespace(
            batch_size=bs, forward_mode=Mode(False), num_padding=pad,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs] + [0] * pad),
            seq_lens_cpu=torch.tensor([len(r.tokens) for r in reqs] + [1] * pad),
            out_cache_loc=torch.cat(locs),
        )  # fmt: skip
        if rids:
            self.backend.note_replay([r.rid for r in reqs])
        self.backend.init_forward_metadata_out_graph(fb)
        ks, vs, qs = self._dummy(bs)
        for li in range(sim.L):
            for i, (toks, p) in enumerate(zip(new, pre, strict=True)):
                k, v = sim.kv(li, toks, p)
                ks[li, i], vs[li, i] = k[0], v[0]
                q = self.wq[li, torch.tensor(toks)] + 0.1 * p
                qs[li, i] = q.reshape(-1).bfloat16().float()
        return [o[:raw] for o in self._layers(fb, ks, vs, qs)]

    def _layers(self, fb, ks, vs, qs):
        return [
            self.backend.forward_decode(qs[li], ks[li], vs[li], layer, fb)
            for li, layer in enumerate(self.layers)
        ]

    def start(self, rid: str, tokens: list[int], custom_params: dict | None = None,
              max_prefix: int | None = None):  # fmt: skip
        """Match the prefix (``custom_params``: the request's ``kv_budget`` / ``kv_policy``;
        ``max_prefix``: :meth:`Sim.match`'s); the backend opens the view at the request's
        first extend."""
        req = self.sim.match(rid, tokens, custom_params, max_prefix)
        req.tokens = list(tokens[: req.prefix_len])
        return req

    def finish(self, req) -> None:
        req.output_ids = req.tokens[len(req.origin_input_ids) :]
        self.sim.cache.cache_finished_req(req, kv_len_to_handle=len(req.tokens))
        self.sim.r2t.free_slots.append(req.req_pool_idx)


def reference(h: Harness, tokens: list[int], prompt: int, steps_out: list[list[torch.Tensor]]):
    """The engine with its own rows, fed the same K/V and queries, routing on the same schedule;
    its outputs must equal the backend's."""
    sim = h.sim
    store = TierStore(sim.policy, n_layers=sim.L, n_heads=sim.H, head_dim=sim.d,
                      dtype=torch.bfloat16)  # fmt: skip
    spans = [(0, prompt)] + [(t, t + 1) for t in range(prompt, len(tokens))]
    for step, (a, b) in enumerate(spans):
        for li in range(sim.L):
            k, v = sim.kv(li, tokens[a:b], a)
            store.append(li, k.transpose(0, 1), v.transpose(0, 1))
            kk, vv, kept = store.view(li)
            q = (h.wq[li, torch.tensor(tokens[a:b])] + 0.1 * a).bfloat16().float().transpose(0, 1)
            need = h.backend.prefill_needs if step == 0 else frozenset()
            o, sig = attend(q, kk, vv, kept, sim.d**-0.5, need=need)
            got = steps_out[step][li].reshape(b - a, h.hq, sim.d).transpose(0, 1).float()
            assert torch.allclose(got, o, atol=2e-2, rtol=2e-2), (step, li)
            store.observe(li, sig)
        if step == 0:
            store.after_prefill()
        elif store.schedule_due(step - 1):
            store.route(f"decode {step - 1}")
    return store


def test_one_request_matches_the_engine_and_frees_everything():
    h = Harness()
    sim = h.sim
    free0 = ([len(f) for f in sim.pool.free_rows], [len(f) for f in sim.pool.free_q])
    avail0 = sim.alloc.available_size()
    req = h.start("a", list(range(1, 39)))  # 38 tokens: 9 windows and a partial one
    outs = [h.step([req], [req.origin_input_ids], extend=True)]
    for t in range(6):
        outs.append(h.step([req], [[50 + t]], extend=False))
    store = reference(h, req.tokens, 38, outs)
    sess = h.backend.sessions["a"]
    for li in range(sim.L):
        assert torch.equal(sess.store.tiers(li), store.tiers(li))
    states = torch.cat([sim.cache.states("a", li).flatten() for li in range(sim.L)])
    assert {0, 1, 3} <= set(states.tolist())  # full, quantized and evicted windows in use
    assert h.backend.stats()["demote"] > 0
    h.finish(req)
    sim.cache.evict(
        __import__("sglang.srt.mem_cache.base_prefix_cache", fromlist=["EvictParams"]).EvictParams(
            num_tokens=10_000
        )
    )
    assert sim.alloc.available_size() == avail0
    assert ([len(f) for f in sim.pool.free_rows], [len(f) for f in sim.pool.free_q]) == free0


def test_second_turn_reuses_the_first_from_the_tree_without_prefill():
    h = Harness()
    sim = h.sim
    r1 = h.start("t1", list(range(1, 33)))
    h.step([r1], [r1.origin_input_ids], extend=True)
    for t in range(4):
        h.step([r1], [[60 + t]], extend=False)
    turn1 = list(r1.tokens)
    h.finish(r1)
    r2 = h.start("t2", turn1 + [70, 71, 72, 73, 74])
    assert r2.prefix_len == 36  # all 9 complete windows of turn 1 matched
    rows = [len(f) for f in sim.pool.free_rows]
    h.step([r2], [r2.origin_input_ids[36:]], extend=True)
    sess = h.backend.sessions["t2"]
    borrowed = sim.cache.views["t2"].borrowed
    assert bool(borrowed[:9].all()) and not bool(borrowed[9:].any())
    # only the 5 new tokens were written: 2 new windows per head (routing may restore more)
    assert all(r - len(f) >= 2 * sim.H for r, f in zip(rows, sim.pool.free_rows, strict=True))
    assert sess.store.n_tokens(0) == 41
    assert sess.prefills == 1


KERNEL_POLICY = """
policy: kernel-qevict
budget: 40%
units: window(size=16)
protect: {sinks: 0, recent: 16}
scores:
  score: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=16)
  evicted: evict
allocate: {method: rank, by: score, shares: {full: 50%, int2: 50%}}
schedule: after_prefill, every(3)
ledger: write_once
"""


# the same shape, ranked by position: the policy reads no decode attention, so the kernel runs
# without its side output (one launch fewer per layer) and nothing is observed
POSITION_POLICY = KERNEL_POLICY.replace("cumulative(attn, decay=0.99)", "position")


# KIVI's shape: no evict tier, every window but the recent one at 2 bits, sinks included (the
# shipped kivi fails the GPU test's needle through SGLang, not through the transformers adapter:
# bench/results/needle-transformers-cpu/)
KIVI_POLICY = """
policy: kernel-kivi
budget: 100%
units: window(size=16)
protect: {recent: 16}
tiers:
  int2: quantize(bits=2, group=16, axis=kivi)
allocate: {method: rank, by: position}
schedule: after_prefill, every(3)
ledger: write_once
"""


def test_a_deferred_policy_routes_at_the_first_decode_step_not_after_each_chunk():
    """``after_prefill(defer=true)``: a prompt prefilled in two chunks is routed once, at its
    first decode step (with the prompt's end read), and nothing moves before."""
    policy = KERNEL_POLICY.replace("after_prefill, every(3)", "after_prefill(defer=true), every(3)")
    h = Harness(policy=policy, head_dim=64, pages=30, blocks=PoolBlocks(64, 64))
    req = h.start("a", list(range(1, 71)))
    h.step([req], [req.origin_input_ids[:32]], extend=True)
    h.step([req], [req.origin_input_ids[32:]], extend=True)
    store = h.backend.sessions["a"].store
    assert not store.events.steps and store.deferred
    assert h.backend.stats()["demote"] + h.backend.stats()["evict"] == 0
    h.step([req], [[80]], extend=False)
    assert [s.reason for s in store.events.steps] == ["decode step 0"] and not store.deferred
    assert h.backend.stats()["demote"] + h.backend.stats()["evict"] > 0


@pytest.mark.parametrize("clock", ["request", "server"])
def test_every_n_counts_each_requests_decode_steps_or_the_servers(clock):
    """``every(3)`` with ``--kv-route-clock request``: each request routes after its own decode
    steps 2, 5, ...; with ``server``: every running request routes after the server's decode
    forwards 2, 5, ..., whatever step each request is at (one routing where there were two)."""
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                options=KVOptions(route_clock=clock))  # fmt: skip
    a = h.start("a", list(range(1, 41)))
    h.step([a], [a.origin_input_ids], extend=True)
    h.step([a], [[50]], extend=False)  # a's decode step 0, the server's decode forward 0
    b = h.start("b", list(range(41, 81)))
    h.step([b], [b.origin_input_ids], extend=True)  # an extend: not a decode forward
    routings = lambda: {rid: s.store.step for rid, s in h.backend.sessions.items()}  # noqa: E731
    routed, reasons = [], []
    for t in range(1, 7):  # the server's decode forwards 1-6: a's steps 1-6, b's 0-5
        before = routings()
        h.step([a, b], [[80 + t], [90 + t]], extend=False)
        routed.append({rid for rid, n in routings().items() if n > before[rid]})
        if "b" in routed[-1]:
            reasons.append(h.backend.sessions["b"].store.events.steps[-1].reason)
    if clock == "request":
        assert routed == [set(), {"a"}, {"b"}, set(), {"a"}, {"b"}]
    else:
        assert routed == [set(), {"a", "b"}, set(), set(), {"a", "b"}, set()]
    assert reasons == (["decode step 2", "decode step 5"] if clock == "request"
                       else ["decode step 1", "decode step 4"])  # fmt: skip
    # a server's store keeps its last routing step's transitions only (the stats count moves)
    for s in h.backend.sessions.values():
        assert all(len(e.transitions) == 0 for e in s.store.events.steps[:-1])


def test_flush_cache_gives_the_trees_windows_back_before_their_pages_are_reused():
    """SGLang's ``flush_cache`` resets the tree and clears the allocator, which frees no page:
    the tree's windows must leave the pool then, or a later prompt given the same pages finds
    them owned (routed: "a write into a routed window"; unrouted: their rows never return).
    The H200 prefill bench flushed between prompts under a policy routing after prefill."""
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64))
    sim = h.sim
    free0 = ([len(f) for f in sim.pool.free_rows], [len(f) for f in sim.pool.free_q])
    for rid in "ab":
        req = h.start(rid, [ord(rid) % 90 + i % 7 for i in range(70)])
        h.step([req], [req.origin_input_ids], extend=True)  # routed: windows demoted
        h.finish(req)  # the tree keeps its windows
        assert h.backend.stats()["demote"] + h.backend.stats()["evict"] > 0
        sim.cache.reset()  # SGLang's flush_cache, in its order
        sim.r2t.clear()
        sim.alloc.clear()  # "b" is given "a"'s pages again
    assert ([len(f) for f in sim.pool.free_rows], [len(f) for f in sim.pool.free_q]) == free0
    assert bool((sim.pool.owner_all < 0).all()) and not bool(sim.pool.ref_all.any())


def test_a_kivi_shaped_policy_matches_the_engine():
    """Everything but the newest window quantized, no evict tier: the backend's outputs and
    tiers equal the engine's own (gather path, float32 extend)."""
    h = Harness(policy=KIVI_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64))
    req = h.start("a", list(range(1, 71)))
    outs = [h.step([req], [req.origin_input_ids], extend=True)]
    for t in range(6):
        outs.append(h.step([req], [[80 + t]], extend=False))
    store = reference(h, req.tokens, 70, outs)
    for li in range(h.sim.L):
        assert torch.equal(h.backend.sessions["a"].store.tiers(li), store.tiers(li))
    assert h.backend.stats()["units"]["quantized"] > h.backend.stats()["units"]["full"] > 0


@pytest.mark.parametrize(
    "policy", [KERNEL_POLICY, POSITION_POLICY, KIVI_POLICY], ids=["attn", "position", "kivi"]
)
def test_decode_kernel_matches_the_gather_path(monkeypatch, policy):
    """The TriZone kernel (interpreted on CPU) reads the pool's pages and rows in place: decode
    outputs and the routing it drives equal the PyTorch gather path's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = {}
    for path in ("gather", "kernel"):
        h = Harness(policy=policy, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                    options=KVOptions(decode=path))  # fmt: skip
        assert h.backend.kernel == (path == "kernel")
        a, b = h.start("a", list(range(1, 71))), h.start("b", list(range(20, 56)))
        h.step([a, b], [a.origin_input_ids, b.origin_input_ids], extend=True)
        outs, pages = [], 0
        for t in range(7):
            outs.append(h.step([a, b], [[80 + t], [90 + t]], extend=False))
            db = h.backend.dbatch
            pages = max(pages, 0 if db is None else sum(x.page_ids.numel() for x in db.layouts))
            if db is not None:  # the side output is on exactly when the policy reads attn
                assert (db.mass is not None) == db.plan.side_output == (policy == KERNEL_POLICY)
        tiers = [h.backend.sessions[r].store.tiers(li) for r in "ab" for li in range(h.sim.L)]
        runs[path] = outs, tiers, h.backend.stats(), pages
    (go, gt, gs, _), (ko, kt, ks, pages) = runs["gather"], runs["kernel"]
    for a, b in zip(go, ko, strict=True):
        for x, y in zip(a, b, strict=True):  # bf16 outputs: at most about one ulp apart
            torch.testing.assert_close(y.float(), x.float(), rtol=2**-7, atol=1e-2)
    assert all(torch.equal(x, y) for x, y in zip(gt, kt, strict=True))
    assert gs["routes"] == ks["routes"] and ks["demote"] > 0 and ks["routes"] >= 2
    assert pages > 0  # the kernel read quantized pages (and rows: outputs match)
    assert (ks["decode"], ks["kernel_steps"], gs["kernel_steps"]) == ("kernel", 7, 0)


# window scores from the prefill signals (colmass, obs_attn), which the extend kernel's second
# pass computes
SIGNALS_POLICY = KERNEL_POLICY.replace(
    "cumulative(attn, decay=0.99)", "cumulative(colmass, decay=1) + pool_max(obs_attn, size=3)"
)
# qevict's reads (attn, obs_attn, no colmass): the attention launch sums them itself (in_run)
OBS_POLICY = KERNEL_POLICY.replace(
    "cumulative(attn, decay=0.99)", "cumulative(attn, decay=0.99) + pool_max(obs_attn, size=3)"
)


@pytest.mark.parametrize(
    "policy",
    [KERNEL_POLICY, POSITION_POLICY, SIGNALS_POLICY, OBS_POLICY, KIVI_POLICY],
    ids=["attn", "position", "signals", "attn+obs", "kivi"],
)
def test_extend_kernel_matches_the_gather_path(monkeypatch, policy):
    """The extend kernel (interpreted on CPU) over a varlen batch of chunks whose prefixes hold
    rows, INT2 pages and evicted windows (routed after the first chunk): outputs, the signals
    it feeds the engines, and so every later tier decision equal the float32 gather path's
    (``attn`` and ``obs_attn`` from the attention launch itself, ``colmass`` from the second
    pass)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = {}
    for kernel in (False, True):
        options = KVOptions(extend="kernel" if kernel else "exact", decode="gather")
        h = Harness(policy=policy, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                    options=options)  # fmt: skip
        assert h.backend.extend_kernel == kernel
        a, b = h.start("a", list(range(1, 91))), h.start("b", list(range(20, 56)))
        outs = [h.step([a, b], [a.origin_input_ids[:64], b.origin_input_ids], extend=True)]
        outs.append(h.step([a, b], [a.origin_input_ids[64:], [60 + i for i in range(21)]], True))
        eb = h.backend.ebatch
        for t in range(3):
            outs.append(h.step([a, b], [[80 + t], [90 + t]], extend=False))
        tiers = [h.backend.sessions[r].store.tiers(li) for r in "ab" for li in range(h.sim.L)]
        runs[kernel] = outs, tiers, eb, h.backend.stats()
    (go, gt, geb, gs), (ko, kt, keb, ks) = runs[False], runs[True]
    for x, y in zip(go, ko, strict=True):
        for u, v in zip(x, y, strict=True):
            torch.testing.assert_close(v.float(), u.float(), rtol=2**-7, atol=1e-2)
    assert all(torch.equal(x, y) for x, y in zip(gt, kt, strict=True))
    assert geb is None and keb is not None and ks["extend"] == "kernel" and gs["extend"] == "gather"
    assert keb.runs == [range(h.sim.L)]  # a small batch: every layer's lists in one run
    kinds = keb.held.pages.sum(), keb.held.rows.sum()
    assert kinds[0] > 0 and kinds[1] > 0  # the second chunks read pages and rows
    assert h.backend.extend_kernel_batches == 2 and gs["routes"] == ks["routes"] >= 2
    reads = set(keb.sig)
    assert keb.in_run is (bool(reads) and "colmass" not in reads)


@pytest.mark.parametrize(("policy", "signals_launches"), [(OBS_POLICY, 0), (SIGNALS_POLICY, 1)],
                         ids=["attn+obs", "colmass"])  # fmt: skip
def test_an_extend_layer_is_one_launch_unless_the_policy_reads_colmass(
    monkeypatch, policy, signals_launches
):
    """A layer of an extend batch launches the attention kernel once; the signals pass only
    for ``colmass`` (each launch costs the host what the device-side work of a short prompt
    does: GPU run 21's ``extend_attend``, ~13 ms a batch of 24 layers at every prompt size)."""
    pytest.importorskip("triton")
    from tiered_radix.kernels import extend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = {"attn": 0, "signals": 0}

    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launches[self.name] += 1
            return self.kernel[grid]

    monkeypatch.setattr(extend, "_extend_attn_kernel", Counted(extend._extend_attn_kernel, "attn"))
    monkeypatch.setattr(extend, "_extend_signals_kernel",
                        Counted(extend._extend_signals_kernel, "signals"))  # fmt: skip
    h = Harness(policy=policy, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                options=KVOptions(extend="kernel", decode="gather"))  # fmt: skip
    a, b = h.start("a", list(range(1, 91))), h.start("b", list(range(20, 56)))
    h.step([a, b], [a.origin_input_ids, b.origin_input_ids], extend=True)
    L = h.sim.L
    assert launches == {"attn": L, "signals": signals_launches * L}


def test_extend_signals_split_over_query_rows_route_as_one_program_a_key_tile(monkeypatch):
    """A batch whose colmass pass splits each key tile's query rows over several programs
    (forced here: a run of one block of rows) feeds the engines what one program a key tile
    does (the partial sums added once per batch, up to float order): the same outputs and
    tiers."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tiered_radix.kernels import extend

    runs = {}
    for min_blocks in (10**6, 1):
        monkeypatch.setattr(extend, "SPLIT_MIN_BLOCKS", min_blocks)
        h = Harness(policy=SIGNALS_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                    options=KVOptions(extend="kernel", decode="gather"))  # fmt: skip
        a = h.start("a", [i % 97 + 1 for i in range(150)])
        b = h.start("b", list(range(20, 56)))
        outs = [h.step([a, b], [a.origin_input_ids, b.origin_input_ids], extend=True)]
        splits = h.backend.ebatch.splits
        for t in range(3):
            outs.append(h.step([a, b], [[80 + t], [90 + t]], extend=False))
        tiers = [h.backend.sessions[r].store.tiers(li) for r in "ab" for li in range(h.sim.L)]
        runs[min_blocks] = outs, tiers, splits, h.backend.extend_kernel_batches
    (o1, t1, s1, k1), (o2, t2, s2, k2) = runs[10**6], runs[1]
    assert s1.n == (1, 1) and s2.n == (3, 1) and k1 == k2 == 1  # a: 150 queries, 3 blocks
    for x, y in zip(o1, o2, strict=True):
        for u, v in zip(x, y, strict=True):
            torch.testing.assert_close(v.float(), u.float(), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(x, y) for x, y in zip(t1, t2, strict=True))


def test_a_failing_extend_kernel_falls_back_to_the_gather_path(monkeypatch):
    """A kernel that cannot run here (e.g. a Triton compile error) at the first extend: the
    backend serves through the gather path and says why in its stats."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tiered_radix.adapters.sglang import trizone

    def fails(*_a, **_k):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(trizone, "extend_layer", fails)
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
                options=KVOptions(extend="kernel"))  # fmt: skip
    a = h.start("a", list(range(1, 40)))
    outs = h.step([a], [a.origin_input_ids], extend=True)
    st = h.backend.stats()
    assert st["extend"] == "gather" and "no kernel here" in st["kernel_error"]
    assert all(not o.isnan().any() for o in outs) and h.backend.extend_kernel_batches == 0


def test_window_starts_are_the_new_tokens_that_begin_a_window():
    # a prompt from 0, a chunk from mid-window (its window opened earlier), a decode token
    # at a window's first position (SGLang's mixed chunks), a prefix hit (page aligned)
    assert window_starts([0, 30, 32, 64], [70, 5, 1, 40], 32) == [0, 32, 64, 72, 75, 76, 108]
    assert window_starts([33], [31], 32) == [] and window_starts([], [], 32) == []


def test_stats_file_waits_for_a_deferred_routing_and_flush_cache_rewrites_it(tmp_path):
    """A prefill routing deferred to the first decode step (after_prefill(defer=true)) moves
    nothing: the stats file is not rewritten (its snapshot would wait for the forward), the
    first decode step's routing rewrites it, and so does the tree's reset (flush_cache)."""
    path = tmp_path / "stats.json"
    policy = POLICY.replace("schedule: after_prefill", "schedule: after_prefill(defer=true)")
    h = Harness(policy=policy, options=KVOptions(stats=str(path)))
    req = h.start("a", list(range(1, 39)))
    h.step([req], [req.origin_input_ids], extend=True)
    assert not path.exists() and h.backend.sessions["a"].store.deferred
    h.step([req], [[50]], extend=False)  # the deferred routing
    got = json.loads(path.read_text())
    assert got["routes"] == 2 and got["demote"] + got["evict"] > 0
    # of the two, the prefill's was put off; one request ran one decode step
    assert got["deferred_routings"] == 1 and got["request_decode_steps"] == 1
    assert got["dropped_routings"] == 0  # routings land at once without the overlap scheduler
    h.finish(req)
    path.unlink()
    h.sim.cache.reset()
    flushed = json.loads(path.read_text())
    assert flushed["host_s"]["extend_batches"] == 1 and flushed["host_s"]["decode_steps"] == 1


def test_stats_file_is_rewritten_after_each_routing(tmp_path):
    path = tmp_path / "stats.json"
    h = Harness(options=KVOptions(stats=str(path)))
    req = h.start("a", list(range(1, 39)))
    h.step([req], [req.origin_input_ids], extend=True)  # after_prefill: one routing
    got = json.loads(path.read_text())
    assert got["routes"] == 1 and got["demote"] + got["evict"] > 0
    # tokens the allocator holds, in whole windows: 38 tokens -> 10 windows of 4
    assert got["peak_tokens"] == 40 and got["peak_bytes"] >= got["pool_bytes_used"] > 0
    assert got["device_memory"] is None  # a CPU pool: no CUDA allocator to read
    h.step([req], [[50]], extend=False)  # the tiny policy routes only after prefill
    assert json.loads(path.read_text()) == got  # not rewritten without a routing
    host = h.backend.stats()["host_s"]  # host time per phase, and the steps it divides by
    assert (host["extend_batches"], host["decode_steps"]) == (1, 1)
    phases = {"metadata_extend", "write_extend", "extend_attend", "route_extend", "metadata",
              "write", "decode_gather", "route"}  # fmt: skip
    assert phases <= host.keys() and all(host[p] > 0 for p in phases)


def test_a_window_of_decode_steps_is_profiled(tmp_path):
    """``--kv-profile DIR:1:2``: decode steps 1-3 under the profiler, the backend's phases among
    the ops; outputs unchanged."""
    h = Harness(options=KVOptions(profile=f"{tmp_path}:1:2"))
    req = h.start("a", list(range(1, 39)))
    h.step([req], [req.origin_input_ids], extend=True)
    for t in range(3):  # decode steps 0, 1 and 2
        h.step([req], [[50 + t]], extend=False)
    assert not list(tmp_path.iterdir())  # the window is still open
    h.step([req], [[53]], extend=False)  # step 3 begins: the window closes
    text = (tmp_path / "profile-1-3.txt").read_text()
    assert text.startswith("decode steps 1-3:") and "tr:metadata" in text and "tr:route" in text
    by_line = text.split("by the line that issued them")[1].splitlines()[2:]
    assert any(r.startswith("tr:") and "/adapters/sglang/" in r for r in by_line), by_line[:5]
    trace = json.loads(gzip.decompress((tmp_path / "trace-1-3.json.gz").read_bytes()))
    assert any(e.get("name") == "tr:metadata" for e in trace["traceEvents"])
    with pytest.raises(ValueError, match="DIR:START:STEPS"):
        StepProfiler("no-numbers")


def test_a_window_of_extend_batches_is_profiled(tmp_path):
    """``--kv-profile DIR:1:1:extend``: extend batch 1 (a prompt's second chunk) under the
    profiler, decode steps in between not counted."""
    h = Harness(options=KVOptions(profile=f"{tmp_path}:1:1:extend"))
    req = h.start("a", list(range(1, 39)))
    h.step([req], [req.origin_input_ids[:20]], extend=True)  # extend batch 0
    h.step([req], [req.origin_input_ids[20:]], extend=True)  # 1: the window opens
    h.step([req], [[50]], extend=False)  # a decode step: counts nothing, closes nothing
    assert not list(tmp_path.iterdir())
    other = h.start("b", list(range(40, 60)))
    h.step([other], [other.origin_input_ids], extend=True)  # 2 begins: the window closes
    text = (tmp_path / "profile-1-2-extend.txt").read_text()
    assert text.startswith("extend steps 1-2:") and "tr:metadata_extend" in text
    assert (tmp_path / "trace-1-2-extend.json.gz").exists()


def two_turns(**options: str):
    """A prompt, four decode steps, then a second turn that extends over the first (evicted and
    quantized windows in its prefix), under the ``--kv-*`` ``options``: every output, the second
    turn's tiers and kept masks, and the extend function's name."""
    h = Harness(options=KVOptions(**options))
    r1 = h.start("t1", list(range(1, 33)))
    outs = [h.step([r1], [r1.origin_input_ids], extend=True)]
    for t in range(4):
        outs.append(h.step([r1], [[60 + t]], extend=False))
    turn1 = list(r1.tokens)
    h.finish(r1)
    r2 = h.start("t2", turn1 + [70, 71, 72, 73, 74, 75])
    outs.append(h.step([r2], [r2.origin_input_ids[r2.prefix_len :]], extend=True))
    tiers = [h.backend.sessions["t2"].store.tiers(li) for li in range(h.sim.L)]
    kept = [h.backend._read("t2", li)[2] for li in range(h.sim.L)]
    return outs, tiers, kept, h.backend.extend_attend.__name__


def assert_same_turns(want, got) -> None:
    """Two :func:`two_turns` runs: outputs equal up to rounding, tiers identical."""
    for a, b in zip(want[0], got[0], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
    for x, y in zip(want[1], got[1], strict=True):
        assert torch.equal(x, y)


def test_extend_through_sdpa_matches_the_float32_path():
    """``--kv-extend sdpa`` (the CUDA default): a second turn extends over a prefix with evicted
    and quantized windows; its outputs equal the float32 path's up to rounding, and so do the
    tiers every step decides."""
    exact, sdpa = two_turns(extend="exact"), two_turns(extend="sdpa")
    assert (exact[3], sdpa[3]) == ("attend", "attend_sdpa")
    assert any(not bool(k.all()) for k in sdpa[2])  # the second turn read past evicted windows
    assert_same_turns(exact, sdpa)
    with pytest.raises(OptionsError, match="'sdpa' or 'exact'"):
        KVOptions(extend="flash")


@pytest.mark.parametrize("extend", ["exact", "sdpa"])
def test_gathers_of_every_window_match_gathers_of_live_ones(extend):
    """``--kv-gather all`` (the CUDA default: no host sync per read) reads every window of the
    prefix, evicted ones masked; ``live`` (the CPU default) only those some head reads. Outputs
    agree to rounding and every tier decided is the same."""
    live = two_turns(extend=extend, gather="live")
    every = two_turns(extend=extend, gather="all")
    assert any(not bool(k.all()) for k in live[2])  # the second turn's prefix has evicted windows
    assert_same_turns(live, every)
    with pytest.raises(OptionsError, match="'live' or 'all'"):
        KVOptions(gather="some")


@pytest.mark.parametrize("reclaim", ["demote", "evict", "off"])
def test_cached_windows_yield_their_rows_to_a_new_prompt(monkeypatch, reclaim):
    """Row blocks short for a new prompt. With ledger room the pool demotes the rows that only
    the tree reads (a's finished prompt, routed at 50%) to ledger copies: a's prefix stays
    cached, whole, and a later turn of a still hits it, reading quantized windows where it read
    rows. Without ledger room it evicts cached windows that no running request holds. Without
    either, PoolFullError. Afterwards every block and slot comes back."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from tiered_radix.adapters.sglang.pool import PoolFullError
    from tiered_radix.adapters.sglang.reps import S_FULL, S_Q

    # 10 windows x 2 heads fit once, not twice; 20 ledger pages hold a's copies, 2 do not
    h = Harness(blocks=PoolBlocks(24, 2 if reclaim == "evict" else 20))
    sim = h.sim
    if reclaim == "off":
        monkeypatch.setattr(sim.pool, "_reclaim_rows", lambda need, layers: None)
    free0, avail0 = [len(f) for f in sim.pool.free_rows], sim.alloc.available_size()
    a = h.start("a", list(range(1, 41)))
    h.step([a], [a.origin_input_ids], extend=True)
    a_windows = sim.r2t.req_to_token[a.req_pool_idx, :40:4].long() // 4
    h.finish(a)  # cached in the tree at the states routing left
    before = sim.pool.owner_all[:, :, a_windows].clone()
    held = free0[0] - len(sim.pool.free_rows[0])
    assert 0 < held and len(sim.pool.free_rows[0]) < 20 and sim.cache.evictable_size() == 40
    b = h.start("b", list(range(50, 90)))  # nothing shared with a: 20 new row blocks a layer
    if reclaim == "off":
        with pytest.raises(PoolFullError, match="row blocks needed"):
            h.step([b], [b.origin_input_ids], extend=True)
        return
    h.step([b], [b.origin_input_ids], extend=True)
    took = sim.pool.reclaimed
    if reclaim == "evict":
        assert sim.cache.evictable_size() < 40  # some of a's cached windows made room
        assert took["cached_tokens_evicted"] > 0 and took["cached_windows_demoted"] == 0
    else:
        assert sim.cache.evictable_size() == 40  # a's prefix is all still cached
        assert took["cached_windows_demoted"] > 0 and took["cached_tokens_evicted"] == 0
        after = sim.pool.owner_all[:, :, a_windows]
        assert (before == S_FULL).any() and not (after == S_FULL).any()
        assert torch.equal(after[before != S_FULL], before[before != S_FULL])
        assert (after[before == S_FULL] == S_Q).all()
        h.finish(b)
        a2 = h.start("a2", list(range(1, 41)) + [95, 96, 97, 98])  # a's next turn
        assert a2.prefix_len == 40
        h.step([a2], [a2.origin_input_ids[40:]], extend=True)
        out = torch.stack(h.step([a2], [[99]], extend=False))
        assert out.isfinite().all()
        h.finish(a2)
        b = None
    if b is not None:
        h.finish(b)
    sim.cache.evict(EvictParams(num_tokens=10_000))
    assert sim.alloc.available_size() == avail0
    assert [len(f) for f in sim.pool.free_rows] == free0


def _addresses(db) -> list[int]:
    """Where every tensor a captured decode step reads lives."""
    out = [db.plan.part_acc.data_ptr(), db.plan.score.data_ptr()]
    out += [] if db.mass is None else [db.mass.data_ptr()]
    for lay in db.layouts:
        out += [getattr(lay, f).data_ptr() for f in lay.__dataclass_fields__
                if isinstance(getattr(lay, f), torch.Tensor)]  # fmt: skip
    return out


@pytest.mark.parametrize("observe", ["fold", "step"])
@pytest.mark.parametrize("policy", [KERNEL_POLICY, POSITION_POLICY], ids=["attn", "position"])
def test_decode_under_cuda_graphs_matches_eager_decode(monkeypatch, policy, observe):
    """Decode as SGLang's graph runner drives it (capture with all-padding batches, then replays
    whose metadata has no rids and whose batches are padded): every real row equals eager
    decode's, the tiers routing decides (one step late, at flush) are the same, the kernels read
    the buffers they were captured with, and every block comes back at the end. Between
    routings and new windows, replays append each step's rows to the lists in place
    (``GraphDecode.advance``) instead of rebuilding them, and (``observe=fold``) sum their
    attention on the device, folded into the engines before routing."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kw = dict(policy=policy, head_dim=64, pages=30, blocks=PoolBlocks(64, 64),
              options=KVOptions(observe=observe))  # fmt: skip
    eager, graphed = Harness(**kw), Harness(**kw)
    sim = graphed.sim
    free0, avail0 = [len(f) for f in sim.pool.free_rows], sim.alloc.available_size()
    graphed.backend.init_cuda_graph_state(4, 4)
    for bs in (4, 2):  # larger first, as SGLang captures
        graphed.capture(bs)
    where = {bs: _addresses(graphed.backend.graph.batches[bs]) for bs in (4, 2)}
    reqs = {}
    for name, h in (("eager", eager), ("graphed", graphed)):
        a, b = h.start("a", list(range(1, 71))), h.start("b", list(range(20, 56)))
        h.step([a, b], [a.origin_input_ids, b.origin_input_ids], extend=True)
        reqs[name] = a, b
    for t in range(14):
        bs = 4 if 4 <= t < 9 else 2  # both captured sizes; at 4, two padded requests
        new = [[60 + t], [80 + t]]
        want = eager.step(list(reqs["eager"]), new, extend=False)
        got = graphed.replay(list(reqs["graphed"]), new, bs)
        for x, y in zip(want, got, strict=True):
            err = (x.float() - y.float()).abs()
            assert err.max() < 2e-2, (t, err.max())
        g, H = graphed.backend.graph, sim.H  # the padded requests list nothing
        for ptr, lists in ((g.full_ptr, 2 * H), (g.page_ptr, 2 * H * 4)):
            pad = ptr[:, lists : lists * bs // 2 + 1]
            assert bool((pad == pad[:, :1]).all()), t
    graphed.backend.flush()
    folds = graphed.backend.graph.decay is not None
    assert folds == (observe == "fold" and policy == KERNEL_POLICY)
    assert graphed.backend.graph.steps > 0 or not folds  # steps since the last routing wait
    graphed.backend.fold_pending()
    assert graphed.backend.graph.steps == 0 or not folds
    for r in "ab":
        for li in range(sim.L):
            x = eager.backend.sessions[r].store.tiers(li)
            assert torch.equal(x, graphed.backend.sessions[r].store.tiers(li))
        # the side output reached the same units: the engines hold the same scores
        want, got = (h.backend.sessions[r].store.scores._state for h in (eager, graphed))
        assert want.keys() == got.keys() and (len(want) > 0) == (policy == KERNEL_POLICY)
        for key, x in want.items():
            torch.testing.assert_close(got[key], x, atol=1e-3, rtol=1e-3)
    es, gs = eager.backend.stats(), graphed.backend.stats()
    assert gs["routes"] == es["routes"] > 2 and gs["demote"] == es["demote"] > 0
    assert gs["kernel_steps"] == 14 and gs["host_s"]["graph_steps"] == 14
    # steps with the same batch, no routing since and no new window appended rows in place
    assert 2 <= gs["host_s"]["steady_steps"] < 14
    assert {bs: _addresses(graphed.backend.graph.batches[bs]) for bs in (4, 2)} == where
    for req in reqs["graphed"]:
        graphed.finish(req)
    sim.cache.evict(EvictParams(num_tokens=10_000))
    assert sim.alloc.available_size() == avail0
    assert [len(f) for f in sim.pool.free_rows] == free0


# h2o's shape at this size: token units, no quantized tier, routing every decode step on the
# attention the kernel's side output gives (each token its own unit)
TOKEN_POLICY = """
policy: kernel-h2o
budget: 30%
units: token
protect: {sinks: 4, recent: 8}
scores:
  heavy: cumulative(attn, decay=1)
tiers: {full: keep(bf16), evicted: evict}
allocate: {method: rank, by: heavy}
schedule: after_prefill, every(1)
"""
# snapkv's shape: one routing at prefill's end, by the observation window's votes
SNAP_POLICY = """
policy: kernel-snapkv
budget: 30%
units: token
protect: {recent: 8}
scores:
  vote: pool_max(obs_attn, size=7)
tiers: {full: keep(bf16), evicted: evict}
allocate: {method: rank, by: vote}
schedule: after_prefill
"""


@pytest.mark.parametrize("policy", [TOKEN_POLICY, SNAP_POLICY], ids=["h2o", "snapkv"])
def test_token_units_run_the_kernels_eagerly_and_under_graphs(monkeypatch, policy):
    """Token units that hold rows only (h2o, snapkv, streaming) run the TriZone kernels: the
    extend kernel over key tiles of 64 one-row windows (a chunked prompt whose second chunk
    reads what the first chunk's routing kept), decode with every kept token a zone B row
    listed by its slot, eagerly and as graph replays (batch 4 captured, padded). Outputs equal
    the float32 gather path's, and so do every tier decision and the routings the kernels'
    signals drive (``attn`` each decode step for h2o; ``obs_attn`` at prefill for snapkv).
    (Before, token units ran only the PyTorch paths, without graphs: GPU run 29's h2o soak
    spent ~0.57 s a decode step of 32 requests there.)"""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs, whole = {}, trizone.CHUNK_ENTRIES
    for name, kernel, graphs in (("gather", False, False), ("kernel", True, False),
                                 ("graphed", True, True), ("by layer", True, True)):  # fmt: skip
        # "by layer": every step's lists (decode and extend) built a layer at a time (a batch
        # too large for one)
        monkeypatch.setattr(trizone, "CHUNK_ENTRIES", 1 if name == "by layer" else whole)
        options = KVOptions(decode="kernel" if kernel else "gather",
                            extend="kernel" if kernel else "exact")  # fmt: skip
        h = Harness(policy=policy, head_dim=64, pages=400, blocks=PoolBlocks(1024, 8),
                    options=options)  # fmt: skip
        assert h.backend.kernel == h.backend.extend_kernel == kernel
        if graphs:
            h.backend.init_cuda_graph_state(4, 4)
            h.capture(4)
        a, b = h.start("a", list(range(1, 91))), h.start("b", list(range(20, 56)))
        outs = [h.step([a, b], [a.origin_input_ids[:48], b.origin_input_ids], extend=True)]
        outs.append(h.step([a], [a.origin_input_ids[48:]], extend=True))
        for t in range(5):
            new = [[80 + t], [90 + t]]
            outs.append(h.replay([a, b], new, 4) if graphs else h.step([a, b], new, False))
        h.backend.flush()
        tiers = [h.backend.sessions[r].store.tiers(li) for r in "ab" for li in range(h.sim.L)]
        runs[name] = outs, tiers, h.backend.stats()
    go, gt, gs = runs["gather"]
    for name in ("kernel", "graphed", "by layer"):
        ko, kt, ks = runs[name]
        for x, y in zip(go, ko, strict=True):
            for u, v in zip(x, y, strict=True):  # bf16 outputs: at most about one ulp apart
                torch.testing.assert_close(v.float(), u.float(), rtol=2**-7, atol=2e-2)
        assert all(torch.equal(x, y) for x, y in zip(gt, kt, strict=True)), name
        assert ks["routes"] == gs["routes"] >= 3 and ks["evict"] == gs["evict"] > 0
        assert (ks["decode"], ks["extend"], ks["kernel_steps"]) == ("kernel", "kernel", 5), name
        assert (gs["decode"], gs["extend"]) == ("gather", "gather")
    assert runs["graphed"][2]["host_s"]["graph_steps"] == 5
    assert runs["by layer"][2]["host_s"]["graph_steps"] == 5


def _eager_and_graphed(monkeypatch, policy: str):
    """Two harnesses of ``policy`` (eager decode, and decode graphs captured at batch 2, the
    kernels under the Triton interpreter), each with requests a (70 tokens) and b (36)
    prefilled: the harnesses and ``{"eager": (a, b), "graphed": (a, b)}``."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kw = dict(policy=policy, head_dim=64, pages=30, blocks=PoolBlocks(64, 64))
    eager, graphed = Harness(**kw), Harness(**kw)
    graphed.backend.init_cuda_graph_state(2, 2)
    graphed.capture(2)
    reqs = {}
    for name, h in (("eager", eager), ("graphed", graphed)):
        a, b = h.start("a", list(range(1, 71))), h.start("b", list(range(20, 56)))
        h.step([a, b], [a.origin_input_ids, b.origin_input_ids], extend=True)
        reqs[name] = a, b
    return eager, graphed, reqs


def test_a_new_window_in_the_same_batch_carries_the_side_output_on_without_a_fold(monkeypatch):
    """Lists are rebuilt when a request opens a window, but while the batch stays the same each
    (request, head, window) keeps its place in the side output: the replays sum on and fold
    once, at the end, and the engines hold the scores eager decode (one observation a step)
    reaches. Before, every new window folded (2 here)."""
    policy = KERNEL_POLICY.replace("every(3)", "every(100)")  # no decode routing in the run
    eager, graphed, reqs = _eager_and_graphed(monkeypatch, policy)
    for t in range(14):  # a opens its window at token 81, b at 49
        new = [[60 + t], [80 + t]]
        eager.step(list(reqs["eager"]), new, extend=False)
        graphed.replay(list(reqs["graphed"]), new, 2)
    stats = graphed.backend.stats()["host_s"]
    assert stats["steady_steps"] <= 14 - 3  # the first step, and each new window, rebuilt
    assert stats.get("folds", 0) == 0
    graphed.backend.fold_pending()
    assert graphed.backend.stats()["host_s"]["folds"] == 1
    for r in "ab":
        want, got = (h.backend.sessions[r].store.scores._state for h in (eager, graphed))
        assert want.keys() == got.keys() and len(want) > 0
        for key, x in want.items():
            torch.testing.assert_close(got[key], x, atol=1e-3, rtol=1e-3)


def test_a_routing_folds_the_routed_requests_side_output_only(monkeypatch):
    """Requests a step apart fall due for routing at different steps (the request clock): each
    routing folds the summed side output of the requests it routes, while the others' rows keep
    summing, and the engines end with the tiers and scores of eager decode."""
    eager, graphed, reqs = _eager_and_graphed(monkeypatch, KERNEL_POLICY)
    folded, due_sizes = [], []
    fold, due = TierStore.fold_attn, backend_module.due_routings

    def count_fold(store, acc, steps, unit=1):
        folded.append(store)
        return fold(store, acc, steps, unit)

    def count_due(*args, **kw):
        out = due(*args, **kw)
        due_sizes.append(len(out))
        return out

    monkeypatch.setattr(TierStore, "fold_attn", count_fold)
    monkeypatch.setattr(backend_module, "due_routings", count_due)
    for name, h in (("eager", eager), ("graphed", graphed)):
        folded.clear()
        due_sizes.clear()
        a, b = reqs[name]
        for t in range(13):  # a decodes one step alone first: a and b route at other steps
            batch = [a] if t == 0 else [a, b]
            new = [[60 + t], [80 + t]][: len(batch)]
            if name == "eager":
                h.step(batch, new, extend=False)
            else:
                h.replay(batch, new, 2)
    graphed.backend.flush()
    graphed.backend.fold_pending()
    graph_folds = len(folded)
    routing_steps = sum(1 for n in due_sizes if n)
    assert routing_steps >= 6 and max(due_sizes) == 1  # a and b never due together
    # one fold a routed request, plus the batch change (a's row) and the last fold (two rows)
    assert graph_folds <= routing_steps + 3 < 2 * routing_steps  # before: both rows each time
    for r in "ab":
        for li in range(graphed.sim.L):
            x = eager.backend.sessions[r].store.tiers(li)
            assert torch.equal(x, graphed.backend.sessions[r].store.tiers(li)), (r, li)
        want, got = (h.backend.sessions[r].store.scores._state for h in (eager, graphed))
        for key, x in want.items():
            torch.testing.assert_close(got[key], x, atol=1e-3, rtol=1e-3)


def test_overlapped_decode_leaves_the_other_requests_as_serial_decode_does(monkeypatch):
    """The overlap scheduler's order (decode after decode): step t+1 is prepared and launched
    before step t's tokens are processed, so request c, whose last token came at step 5, runs
    step 6 too (its token dropped) and its view closes only after step 6 was launched (flushing
    that step's routing first). a and b see the same outputs at every step and end with the
    same tiers and scores as in the serial order, every block comes back, and the metadata
    reads the request ids the plugin hands over instead of the padded pool indices."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kw = dict(policy=KERNEL_POLICY, head_dim=64, pages=40, blocks=PoolBlocks(96, 96))
    serial, overlap = Harness(**kw), Harness(**kw)
    sim = overlap.sim
    free0, avail0 = [len(f) for f in sim.pool.free_rows], sim.alloc.available_size()
    for h in (serial, overlap):
        h.backend.init_cuda_graph_state(4, 4)
        h.capture(4)
    reqs = {}
    for name, h in (("serial", serial), ("overlap", overlap)):
        a, b = h.start("a", list(range(1, 71))), h.start("b", list(range(20, 56)))
        c = h.start("c", list(range(5, 40)))
        h.step([a, b, c], [a.origin_input_ids, b.origin_input_ids, c.origin_input_ids], True)
        reqs[name] = a, b, c
    last_c = 5
    for t in range(12):
        new = {"a": [60 + t], "b": [80 + t], "c": [30 + t]}
        a, b, c = reqs["serial"]
        batch = [a, b, c] if t <= last_c else [a, b]
        want = serial.replay(batch, [new[r.rid] for r in batch], 4)
        if t == last_c:
            serial.finish(c)  # serial: step t's tokens are processed before step t+1
        a, b, c = reqs["overlap"]
        batch = [a, b, c] if t <= last_c + 1 else [a, b]
        got = overlap.replay(batch, [new[r.rid] for r in batch], 4, rids=True)
        if t == last_c + 1:
            overlap.finish(c)  # overlap: after step t+1 was launched
        for x, y in zip(want, got, strict=True):
            err = (x[:2].float() - y[:2].float()).abs()  # a's and b's rows
            assert err.max() < 2e-2, (t, err.max())
    for h in (serial, overlap):
        h.backend.flush()
        h.backend.fold_pending()
    for r in "ab":
        s, o = (h.backend.sessions[r].store for h in (serial, overlap))
        for li in range(sim.L):
            assert torch.equal(s.tiers(li), o.tiers(li)), (r, li)
        for key, x in s.scores._state.items():
            torch.testing.assert_close(o.scores._state[key], x, atol=1e-3, rtol=1e-3)
    assert "c" not in overlap.backend.sessions and "c" not in overlap.backend.pool_of
    assert overlap.backend.stats()["routes"] > 4
    for h in (serial, overlap):
        for req in reqs["serial" if h is serial else "overlap"][:2]:
            h.finish(req)
        h.sim.cache.evict(EvictParams(num_tokens=10_000))
    assert sim.alloc.available_size() == avail0
    assert [len(f) for f in sim.pool.free_rows] == free0
    assert set(sim.pool.blocks_in_use().values()) == {0}


@pytest.mark.parametrize("decoupled", [False, True], ids=["coupled", "rdkv"])
def test_replays_after_an_insert_frees_duplicates_read_the_trees_windows(monkeypatch, decoupled):
    """GPU run 31's soak: two requests prefill the same prompt; the first's goes into the tree,
    then SGLang's insert after the second's prefill (which, under the overlap scheduler, runs
    after its first decode step's metadata) frees the second's duplicates, NaN-poisoning their
    rows, and points it at the tree's windows. Replays whose lists were built before that
    used to stay steady and read the freed rows (NaN). The insert's remap rebuilds the lists:
    every step is finite and equals a server where the second request prefilled alone. rdkv as
    shipped (first routing at the first decode step, landing a step late under the overlap
    scheduler) reads rows until then, as the soak's second turns did."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from test_rdkv import DEFERRED, RDKV_TEXT

    policy = RDKV_TEXT.replace("budget: 10%", "budget: 40%") if decoupled else KERNEL_POLICY
    assert DEFERRED in policy or not decoupled

    def serve(twin: bool) -> tuple[Harness, list]:
        h = Harness(policy=policy, head_dim=64, pages=40, context=512,
                    options=KVOptions(decode="kernel"), overlap_schedule=decoupled)  # fmt: skip
        h.backend.init_cuda_graph_state(1, 1)
        h.capture(1)
        prompt = [(5 * j) % 97 + 1 for j in range(3 * h.sim.W)]
        c = h.start("c", prompt + [7, 8, 9])
        if twin:  # the same prompt in the same batch, into the tree first
            a = h.start("a", prompt)
            h.step([a, c], [prompt, c.origin_input_ids], extend=True)
            a.get_fill_ids = lambda: list(a.tokens)
            h.sim.cache.cache_unfinished_req(a)
        else:
            h.step([c], [c.origin_input_ids], extend=True)
        c.get_fill_ids = lambda: list(c.tokens)
        outs = [h.replay([c], [[40]], 1)]
        h.sim.cache.cache_unfinished_req(c)  # twin: c's 3 windows are duplicates of a's
        outs += [h.replay([c], [[41 + t]], 1) for t in range(3)]
        return h, outs

    h, got = serve(True)
    view = h.sim.cache.views["c"]
    assert view.remaps == 1 and bool(view.borrowed[:3].all())
    _, want = serve(False)
    for step_got, step_want in zip(got, want, strict=True):
        for g, w in zip(step_got, step_want, strict=True):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_batch_over_the_graph_capacity_runs_eagerly(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=30, blocks=PoolBlocks(64, 64), context=64,
                options=KVOptions(graph_tokens=100))  # fmt: skip
    h.backend.init_cuda_graph_state(4, 4)
    assert h.backend.graph.tokens == 100
    # each request lists its tokens and its last window's W - 1 future rows (W = 16 here)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert h.backend.graph_fits([34, 34]) and not h.backend.graph_fits([35, 34])
        assert not h.backend.graph_fits([40, 40])
        assert not h.backend.graph_fits([1] * 5)  # more requests than captured: SGLang's own
    assert h.backend.stats()["host_s"]["graph_too_long"] == 2
    told = [r.getMessage() for r in caplog.records if "runs without CUDA graphs" in r.getMessage()]
    assert told == [
        "tiered-radix: a decode batch of 2 requests, 69 tokens, runs without CUDA graphs: the "
        "graphs' buffers hold 100 tokens (--kv-graph-tokens 101 or more would fit it)"
    ]  # once


def test_graphs_need_the_decode_kernel():
    h = Harness(options=KVOptions(decode="gather"))
    with pytest.raises(PoolConfigError, match="--disable-cuda-graph"):
        h.backend.init_cuda_graph_state(4, 4)


def test_rows_for_windows_evicts_cached_windows_before_saying_no():
    """The decode-memory check's question (SGLang retracts on no): cached windows that no
    running request holds give their rows first, demoted to the ledger while it has room (the
    prefix stays cached), then evicted; more windows than the pool has rows for: no."""
    h = Harness(blocks=PoolBlocks(24, 64))  # 12 windows of 2 heads a layer
    sim = h.sim
    a = h.start("a", list(range(1, 41)))
    h.step([a], [a.origin_input_ids], extend=True)
    h.finish(a)
    cached, free = sim.cache.evictable_size(), min(len(f) for f in sim.pool.free_rows)
    want = free // sim.H + 1  # one window more than the free rows hold
    assert sim.pool.rows_for_windows(want) and sim.cache.evictable_size() == cached
    assert not sim.pool.rows_for_windows(13) and sim.cache.evictable_size() == 0


# ops that read only the elements they are given (views, indexing): free over a whole table
# unless they allocate a table's worth (an index that selects every window)
_INDEXING = {
    "aten::select", "aten::as_strided", "aten::view", "aten::permute", "aten::transpose",
    "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_copy_",
    "aten::index_select", "aten::slice", "aten::unbind", "aten::reshape", "aten::_reshape_alias",
    "aten::expand", "aten::unsqueeze", "aten::alias", "aten::narrow",
}  # fmt: skip


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats-file"])
def test_replayed_steps_and_their_routing_never_pass_over_a_whole_pool_table(
    monkeypatch, tmp_path, stats
):
    """The pool's tables are sized by the allocator's slots (at 10x slots, GBs on the GPU), so a
    pass over one costs ~0.1-0.7 ms of device time (GPU run 12 found routings with ~6 ms of
    them). Through replayed steps, routings and list rebuilds, no op other than indexing takes a
    tensor of a table's size, except the stats snapshot's one histogram of the owner table
    (with ``--kv-stats``, once per routing)."""
    from torch.profiler import ProfilerActivity, profile

    from tiered_radix.adapters.sglang import backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend.decode, "run", lambda q, layout, plan, **kw: torch.zeros_like(q))
    pages = 20_000  # windows: far more than the request holds (~30), as on a server
    path = str(tmp_path / "stats.json") if stats else None
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=pages, blocks=PoolBlocks(256, 256),
                context=200, options=KVOptions(stats=path))  # fmt: skip
    h.backend.init_cuda_graph_state(1, 1)
    h.capture(1)
    req = h.start("a", [(7 * j) % 97 + 1 for j in range(156)])  # token 160 opens a window
    h.step([req], [req.origin_input_ids], extend=True)
    big: list[str] = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as p:
        for t in range(7):  # KERNEL_POLICY routes every 3 steps
            h.replay([req], [[60 + t]], 1)
            h.backend.flush()
    for e in p.events():
        sizes = [torch.Size(s).numel() for s in e.input_shapes or [] if isinstance(s, list) and s
                 and all(isinstance(x, int) for x in s)]  # fmt: skip
        reads = max(sizes, default=0) >= pages and e.name not in _INDEXING
        if reads or e.cpu_memory_usage >= pages:  # >= one byte per window: a table's copy
            big.append(e.name)
    assert h.backend.stats()["routes"] >= 3  # the prefill's and two decode routings
    want = ["aten::flatten", "aten::bincount", "aten::min", "aten::max"] * 2 if stats else []
    assert sorted(big) == sorted(want)
