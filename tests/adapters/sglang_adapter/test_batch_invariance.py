"""Batch invariance on CPU: a request's outputs and tiers are the same served alone and inside a
batch, for every shipped policy, through ``TieredAttnBackend`` over the tiered pool and radix
cache (RDKV's requests repacked into Zone A pages at each routing).

SGLang's scheduler is played by :class:`Scheduler`: each round SGLang's own ``PrefillAdder``
with a fresh budget of ``--chunked-prefill-size`` tokens takes the chunked request first
(``add_chunked_req``), then the waiting requests (``add_one_req``) until one is not admitted,
through the plugin's admission hooks, as SGLang's ``get_new_batch_prefill`` does. A round without
a prefill runs one decode step of the running requests, so requests of different lengths decode
together.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang_sim import require

require("sglang.srt.managers.schedule_policy")

from sglang.srt.managers import schedule_policy  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from test_backend import Harness, Mode  # noqa: E402

from tiered_radix.adapters.sglang import plugin  # noqa: E402
from tiered_radix.adapters.sglang.options import DETERMINISTIC_SPLITS, KVOptions  # noqa: E402
from tiered_radix.adapters.sglang.reps import Layout  # noqa: E402
from tiered_radix.adapters.sglang.sizing import PoolBlocks  # noqa: E402
from tiered_radix.policy import compile_text  # noqa: E402

POLICIES = Path(__file__).parents[3] / "policies"
SHIPPED = sorted(p.stem for p in POLICIES.glob("*.yaml"))
STRIDE = 64  # --chunked-prefill-size
HEAD_DIM = 32
PROMPTS = {"a": 200, "b": 150, "c": 90}  # prompt lengths: chunks of a batch end mid-prompt
DECODES = {"a": 5, "b": 3, "c": 4}  # decode steps: the batch shrinks as requests finish


ARCHIVED = "qevict+archive"  # qevict archiving what it evicts (evict(archive=int2), S_A)


def policy_text(name: str) -> str:
    """The shipped policy; a 10% budget becomes 35%, so that prompts of a few hundred tokens
    leave the allocator choices beyond the protected tokens."""
    text = (POLICIES / f"{name.split('+')[0]}.yaml").read_text()
    if name == ARCHIVED:
        text = text.replace("evicted: evict", "evicted: evict(archive=int2)")
    return text.replace("budget: 10%", "budget: 35%")


def prefill_adder(rig, running: list):
    """SGLang's ``PrefillAdder`` for one round: the rig's allocator and cache, the running
    requests, a chunk budget of ``STRIDE`` tokens."""
    batch = SimpleNamespace(reqs=running, batch_size=lambda: len(running),
                            is_empty=lambda: not running)  # fmt: skip
    return PrefillAdder(rig.page, rig.cache, rig.alloc, batch, 0.5, 1 << 20, STRIDE)


class PoolRig:
    """``TieredAttnBackend`` over the pool and radix cache (:class:`test_backend.Harness`)."""

    def __init__(self, text: str, head_dim: int = HEAD_DIM, options: KVOptions | None = None,
                 late: bool = False):  # fmt: skip
        W = Layout.of(compile_text(text)).window
        pages = 2 * (-(-sum(PROMPTS.values()) // W) + len(PROMPTS) * (2 + max(DECODES.values())))
        blocks = 4 * pages  # row and ledger blocks for every window of every head: no cuts
        zone = 1 << 22  # a decoupled policy's Zone A bytes a layer: room for every request
        self.h = Harness(policy=text, head_dim=head_dim, pages=pages,
                         blocks=PoolBlocks(blocks, blocks, zone), options=options,
                         overlap_schedule=late)  # fmt: skip
        self.alloc, self.cache, self.page = self.h.sim.alloc, self.h.sim.cache, W

    def start(self, rid: str, prompt: list[int]):
        return self.h.start(rid, prompt)

    def forward(self, reqs, new: list[list[int]], extend: bool) -> list[list[torch.Tensor]]:
        """``Harness.step`` with every query a function of its own token and position (not of
        where its chunk starts); per request and layer its output ``[n, HQ, D]``."""
        h, sim = self.h, self.h.sim
        locs, pre = h._locs(reqs, new)
        fb = SimpleNamespace(
            forward_mode=Mode(extend), rids=[r.rid for r in reqs],
            seq_lens_cpu=torch.tensor([len(r.tokens) for r in reqs]),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs]),
            extend_prefix_lens_cpu=pre, extend_seq_lens_cpu=[len(t) for t in new],
            out_cache_loc=torch.cat(locs),
        )  # fmt: skip
        h.backend.init_forward_metadata(fb)
        per = [[] for _ in reqs]
        for li, layer in enumerate(h.layers):
            kv = [sim.kv(li, t, p) for t, p in zip(new, pre, strict=True)]
            qs = [
                h.wq[li, torch.tensor(t)] + 0.1 * torch.arange(p, p + len(t))[:, None, None]
                for t, p in zip(new, pre, strict=True)
            ]
            q = torch.cat(qs).reshape(-1, h.hq * sim.d).bfloat16().float()
            k, v = (torch.cat([x[i] for x in kv]) for i in (0, 1))
            o = h.backend.forward_extend(q, k, v, layer, fb).reshape(-1, h.hq, sim.d).float()
            start = 0
            for b, t in enumerate(new):
                per[b].append(o[start : start + len(t)])
                start += len(t)
        return per

    def replay(self, reqs, new: list[list[int]], bs: int) -> list[list[torch.Tensor]]:
        """One decode step as a replay of the graph captured at batch ``bs`` (the server's
        decode), the request ids handed over as the plugin's hook does; per request and layer
        its output ``[1, HQ, D]``."""
        outs = self.h.replay(reqs, new, bs, rids=True)
        HQ, D = self.h.hq, self.h.sim.d
        return [[o[b].reshape(1, HQ, D).float() for o in outs] for b in range(len(reqs))]

    def store(self, rid: str):
        return self.h.backend.sessions[rid].store


def rig(name: str, head_dim: int = HEAD_DIM, options: KVOptions | None = None,
        late: bool = False):  # fmt: skip
    """``late``: SGLang's overlap scheduler runs (the default launch), so a decode routing lands
    when the next decode step is processed (dropped if its request ends first)."""
    return PoolRig(policy_text(name), head_dim, options, late)


def prompt(rid: str) -> list[int]:
    g = torch.Generator().manual_seed(ord(rid))
    return torch.randint(1, 100, (PROMPTS[rid],), generator=g).tolist()


class Scheduler:
    """SGLang's loop over one rig: prefill rounds through the admission hooks, else a decode
    step of every running request. Records each request's chunks, its outputs per position
    (prompt rows, then one per decode step) and its tiers after prefill."""

    def __init__(self, r, rids: list[str], graph_bs: int | None = None) -> None:
        """``graph_bs``: decode steps replay the graph captured at that batch size, in the
        order of SGLang's overlap loop (a request runs one step past its last token, its token
        dropped, and its view's close, flushing, follows that step's launch)."""
        self.r, self.graph_bs = r, graph_bs
        self.past_end: list = []  # requests at their step past the end (overlap order)
        self.reqs = {}
        for rid in rids:
            req = r.start(rid, prompt(rid))  # what PrefillAdder reads of SGLang's Req:
            req.full_untruncated_fill_ids, req.output_ids = prompt(rid), []
            req.prefix_indices = torch.empty(0, dtype=torch.int64)
            req.last_node = getattr(req, "last_node", None)
            req.sampling_params = SimpleNamespace(max_new_tokens=DECODES[rid], ignore_eos=False)
            req.host_hit_length, req.retracted_stain, req.mamba_pool_idx = 0, False, None
            req.needs_host_load_back = lambda: False
            req.set_extend_range = lambda a, b, req=req: setattr(
                req, "extend_range", SimpleNamespace(start=a, end=b, length=b - a)
            )
            self.reqs[rid] = req
        self.waiting, self.chunked, self.running = list(self.reqs.values()), None, []
        self.chunks = {rid: [] for rid in rids}
        self.outs = {rid: [] for rid in rids}  # per forward: per layer [n, HQ, D]
        self.prefill_tiers: dict[str, list[torch.Tensor]] = {}
        self.left = {rid: DECODES[rid] for rid in rids}

    def run(self) -> Scheduler:
        while self.waiting or self.chunked is not None or self.running or self.past_end:
            batch = self._prefill_batch()
            if batch:
                self._extend(batch)
            else:
                self._decode()
        return self

    def _prefill_batch(self) -> list:
        adder = prefill_adder(self.r, self.running)
        if self.chunked is not None:
            plugin.add_chunked_req(PrefillAdder.add_chunked_req, adder, self.chunked)
        for req in list(self.waiting):
            res = plugin.add_one_req(PrefillAdder.add_one_req, adder, req, False, None)
            if adder.can_run_list and adder.can_run_list[-1] is req:
                self.waiting.remove(req)
            if res != AddReqResult.CONTINUE:
                break
        return adder.can_run_list

    def _extend(self, batch) -> None:
        spans = []
        for req in batch:
            s = len(req.prefix_indices)
            spans.append((s, s + req.extend_range.length))
        new = [req.full_untruncated_fill_ids[s:e] for req, (s, e) in zip(batch, spans, strict=True)]
        outs = self.r.forward(batch, new, extend=True)
        self.chunked = None
        for req, (s, e), out in zip(batch, spans, outs, strict=True):
            self.chunks[req.rid].append((s, e))
            self.outs[req.rid].append(out)
            req.prefix_indices = torch.arange(e)
            if e < len(req.full_untruncated_fill_ids):
                assert self.chunked is None, "SGLang keeps one chunked request per batch"
                self.chunked = req
            else:
                self.running.append(req)
                store = self.r.store(req.rid)
                self.prefill_tiers[req.rid] = [store.tiers(li).clone() for li in range(2)]

    def _decode(self) -> None:
        if self.graph_bs is not None:
            return self._replay()
        batch = self.running
        toks = [[50 + self.left[r.rid]] for r in batch]
        for req, out in zip(batch, self.r.forward(batch, toks, extend=False), strict=True):
            self.outs[req.rid].append(out)
            self.left[req.rid] -= 1
        self.running = [r for r in batch if self.left[r.rid] > 0]
        # SGLang closes the finished requests' views one by one, in the batch's order
        # (before_close -> flush): a routing of theirs still to land is dropped, alone as in a
        # batch (their stores stay to compare)
        for req in batch:
            if not self.left[req.rid]:
                self.r.h.backend.flush([req.rid])

    def _replay(self) -> None:
        """A decode step replayed, then the overlap loop's processing of the step before: the
        requests that ended there ran this step too (outputs dropped) and close now."""
        batch, ending = self.running + self.past_end, self.past_end
        toks = [[50 + max(self.left[r.rid], 0)] for r in batch]
        for req, out in zip(batch, self.r.replay(batch, toks, self.graph_bs), strict=True):
            if self.left[req.rid] > 0:
                self.outs[req.rid].append(out)
            self.left[req.rid] -= 1
        for req in ending:  # one by one, as SGLang's result processing closes them
            self.r.h.backend.flush([req.rid])
        self.past_end = [r for r in self.running if not self.left[r.rid]]
        self.running = [r for r in self.running if self.left[r.rid] > 0]

    def rows(self, rid: str) -> list[torch.Tensor]:
        """Per layer: the request's outputs at every position it computed, ``[n, HQ, D]``."""
        return [torch.cat([o[li] for o in self.outs[rid]]) for li in range(2)]


@pytest.fixture
def stride(monkeypatch):
    """The scheduler's ``--chunked-prefill-size`` as the plugin reads it, and no context
    parallelism (what ``PrefillAdder`` asks SGLang's runtime context, unpublished here)."""
    monkeypatch.setattr(plugin, "route_stride", lambda: STRIDE, raising=False)
    for name in ("is_dsa_prefill_cp_in_seq_split", "is_prefill_context_parallel_enabled"):
        monkeypatch.setattr(schedule_policy, name, lambda: False)
    return STRIDE


@pytest.mark.parametrize("late", [False, True], ids=["serial", "late-landing"])
@pytest.mark.parametrize("name", [*SHIPPED, ARCHIVED])
def test_a_request_reads_and_routes_alike_alone_and_in_a_batch(name, stride, late):
    """Three prompts of 200, 150 and 90 tokens at a 64-token chunk budget, each served alone
    and all three together (their chunks share the budget; their decode steps run together):
    every request's attention outputs at every position (bit for bit: on the CPU each
    request's attention runs alone), its tiers after prefill and at the end, and its bytes
    are the same both ways; in the serial order and with decode routings landing one step
    late, as under SGLang's overlap scheduler (the default launch). Decode through PyTorch
    (the TriZone kernel: next test)."""
    assert_alike(name, HEAD_DIM, late=late)


@pytest.mark.parametrize("splits", [None, "2"], ids=["splits-per-batch", "splits-fixed"])
def test_decode_through_the_trizone_kernel_is_alike_alone_and_in_a_batch(
    stride, monkeypatch, splits
):
    """The same for qevict with the TriZone kernel decoding (interpreted; head dim 64, which
    it reads): one launch over the batch's requests of different lengths. By default the
    kernel splits every list by the batch's longest one (here 2 ways in the batch, 1 for ``c``
    alone), which changes the float32 merge order but not these bf16 outputs;
    ``--kv-graph-splits`` fixes the splits of every step, whatever the batch."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    options = KVOptions(decode="kernel", graph_splits=None if splits is None else int(splits))
    monkeypatch.setitem(PROMPTS, "a", 300)  # the batch's longest list: 2 splits of 128 rows
    together = assert_alike("qevict", 64, options)
    assert together.r.h.backend.stats()["kernel_steps"] == max(DECODES.values())
    if splits is not None:
        assert together.r.h.backend.dbatch.plan.num_splits == int(splits)


def assert_alike(name: str, head_dim: int, options: KVOptions | None = None,
                 late: bool = False, graph_bs: int | None = None,
                 alone_bs: int | None = None) -> Scheduler:  # fmt: skip
    """The comparison of the tests; returns the batch's run. ``graph_bs``: decode replays the
    graph captured at that batch size (:class:`Scheduler`); ``alone_bs``: a lone request's
    replays that of another batch size (as the server's: the smallest that fits)."""

    def run(rids: list[str], bs: int | None) -> Scheduler:
        r = rig(name, head_dim, options, late)
        if bs is not None:
            r.h.backend.init_cuda_graph_state(bs, bs)
            r.h.capture(bs)
        return Scheduler(r, rids, bs).run()

    together = run(list(PROMPTS), graph_bs)
    for rid in PROMPTS:
        alone = run([rid], alone_bs or graph_bs)
        for li, (x, y) in enumerate(zip(alone.rows(rid), together.rows(rid), strict=True)):
            torch.testing.assert_close(y, x, rtol=0, atol=0, msg=f"{rid} layer {li}")
        for x, y in zip(alone.prefill_tiers[rid], together.prefill_tiers[rid], strict=True):
            assert torch.equal(x, y), rid
        a, t = alone.r.store(rid), together.r.store(rid)
        for li in range(2):
            assert torch.equal(a.tiers(li), t.tiers(li)), rid
        assert a.bytes_used() == t.bytes_used()
        assert together.chunks[rid] == alone.chunks[rid], rid  # what makes it so (docstring)
    return together


# shipped policies whose decode replays graphs, covering each kind of routing: windows (kivi,
# qevict), pages (rdkv) and token units routed every step (h2o, streaming; GPU run 34)
GRAPHED = ["h2o", "kivi", "qevict", "rdkv", "streaming"]


@pytest.mark.parametrize("ends", ["apart", "together"])
@pytest.mark.parametrize("name", GRAPHED)
def test_replayed_decode_in_the_overlap_order_is_alike_alone_and_in_a_batch(
    name, stride, monkeypatch, ends
):
    """The server's decode: graph replays (batch 4 captured, the TriZone kernel interpreted),
    SGLang's overlap loop (a routing lands a step late; a request runs one step past its last
    token and closes after the next step's launch), the shipped policy routing every 2 decode
    steps. Requests end at different steps, so in the batch one closes while the others'
    routings are due: each request's outputs at every position, its tiers and bytes are the
    same as alone. (Here the routings after the first move little, so a landing a step early
    would pass too: ``test_route_landing.py`` checks the landing steps themselves.)
    ``together``: ``a`` and ``b`` end at the same step, a routing due there (GPU run 34: the
    first one's close landed the other's routing planned after its last token, in the batch
    only)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shipped = policy_text

    def every_2(policy: str) -> str:
        text = shipped(policy)
        line = next(x for x in text.splitlines() if x.startswith("schedule:"))
        steps = re.sub(r"every\(\d+\)", "every(2)", line)
        return text.replace(line, steps if "every(" in line else line + ", every(2)")

    monkeypatch.setattr(sys.modules[__name__], "policy_text", every_2)
    if ends == "together":  # their last steps (index 5) route: every(2) falls after 1, 3, 5
        monkeypatch.setitem(DECODES, "a", 6)
        monkeypatch.setitem(DECODES, "b", 6)
    options = KVOptions(decode="kernel")
    together = assert_alike(name, 64, options, late=True, graph_bs=4)
    assert together.r.h.backend.stats()["kernel_steps"] >= max(DECODES.values())
    # the prefill routings, and decode routings (every 2 steps) beyond them
    assert together.r.h.backend.stats()["routes"] > 2 * len(PROMPTS)


@pytest.mark.parametrize("name", ["qevict", "rdkv"])
def test_replays_at_another_batch_size_are_alike_under_deterministic_inference(
    name, stride, monkeypatch
):
    """As the server replays: the batch through the graph of batch 4, a lone request through
    that of batch 1, whose split count by batch size differs (GPU run 29: a request's text
    changed with it). Under SGLang's ``--enable-deterministic-inference`` the options fix the
    decode splits (:meth:`KVOptions.batch_invariant`), so each request's outputs, tiers and
    bytes are the same both ways, bit for bit. (This rig's short context caps the splits by
    batch size alike at batch 1 and 4, so only the split count checks the fix here: the GPU
    test runs the server with the flag.)"""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    options = KVOptions(decode="kernel").batch_invariant()
    together = assert_alike(name, 64, options, late=True, graph_bs=4, alone_bs=1)
    backend = together.r.h.backend
    assert backend.stats()["kernel_steps"] >= max(DECODES.values())
    assert backend.graph.batches[4].plan.num_splits == DETERMINISTIC_SPLITS


def test_chunks_end_at_routing_points_whatever_the_budget_left(stride):
    """``aligned_chunk`` around a recording admission: the budget SGLang's cut sees, or the
    request waits. Routing points at multiples of 64 from the request's token 0."""
    seen = []

    def original(adder, req, *_args):
        seen.append(adder.rem_chunk_tokens)
        return AddReqResult.CONTINUE

    def admit(start: int, rest: int, limit: int, page: int = 1, admitted: int = 0):
        seen.clear()
        adder = SimpleNamespace(rem_chunk_tokens=limit, page_size=page,
                                can_run_list=[None] * admitted)  # fmt: skip
        req = SimpleNamespace(prefix_indices=[0] * start,
                              full_untruncated_fill_ids=[1] * (start + rest))  # fmt: skip
        res = plugin.aligned_chunk(original, adder, req, False, None)
        return res, (seen[0] if seen else None)

    assert admit(0, 150, 64) == (AddReqResult.CONTINUE, 64)  # cut at 64, as SGLang would
    assert admit(40, 110, 64) == (AddReqResult.CONTINUE, 24)  # a matched prefix: cut at 64
    assert admit(40, 20, 64) == (AddReqResult.CONTINUE, 64)  # ends at 60: whole
    assert admit(40, 30, 64) == (AddReqResult.CONTINUE, 24)  # would cross 64: cut there
    assert admit(0, 150, 30, admitted=1) == (AddReqResult.OTHER, None)  # waits for a batch
    assert admit(0, 20, 30, admitted=1) == (AddReqResult.CONTINUE, 30)  # its whole prompt fits
    assert admit(0, 150, 30) == (AddReqResult.CONTINUE, 30)  # first of its batch: SGLang's cut
    # pages of 32: SGLang takes a rest whole only if its pages fit the budget
    assert admit(64, 8, 20, page=32, admitted=1) == (AddReqResult.OTHER, None)
    assert admit(64, 8, 32, page=32, admitted=1) == (AddReqResult.CONTINUE, 32)


def test_the_stride_is_the_schedulers_chunked_prefill_size(monkeypatch):
    from sglang.srt import runtime_context

    assert plugin.route_stride() is None  # no scheduler here: nothing published
    for size, want in ((8192, 8192), (-1, None), (None, None)):
        bag = SimpleNamespace(chunked_prefill_size=size)
        monkeypatch.setattr(runtime_context, "get_schedule", lambda bag=bag: bag)
        assert plugin.route_stride() == want
