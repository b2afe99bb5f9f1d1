"""``--tp 2`` through the backend on CPU: two ranks (gloo processes), each with a pool of one of
the model's two KV heads and half its query heads, serve the same batch (two requests, prefill
and decode steps that route) and decide, per head, exactly the tiers the single-rank backend over
both heads decides; their attention outputs are its outputs' halves. The policy spreads the budget
by how concentrated each head's attention is, so a rank that planned alone would decide otherwise
(checked too: the comparison can fail)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gloo_ranks import run_ranks
from sglang_sim import POLICY as SIM_POLICY
from sglang_sim import require

require("sglang.srt.mem_cache.radix_cache")

from test_backend import HQ, Harness  # noqa: E402

WORLD, KV_HEADS, STEPS = 2, 2, 6
# the Sim's policy with the budget spread by how concentrated each head's attention is (the
# sum of its squared window masses; every head's total mass is the same, each query's attention
# summing to 1): a rank alone would decide otherwise
POLICY = (
    SIM_POLICY.replace("policy: tiny-qevict", "policy: tp-qevict")
    .replace("scores:", "spread: proportional(cumulative(attn, decay=0.99) ^ 2)\nscores:")
    .replace("schedule: after_prefill", "schedule: after_prefill, every(2)")
)
PROMPTS = {"a": list(range(1, 39)), "b": list(range(40, 70))}


def serve(rank: int | None = None, tp_group=None) -> dict:
    """Prefill both requests in one batch, then ``STEPS`` decode steps; the tiers of every
    request and layer after each step, and the outputs. ``rank``: hold that rank's heads."""
    kv = slice(0, KV_HEADS) if rank is None else slice(rank, rank + 1)
    q = slice(kv.start * HQ // KV_HEADS, kv.stop * HQ // KV_HEADS)
    h = Harness(q_heads=q, tp_group=tp_group, policy=POLICY, heads=KV_HEADS, kv_heads=kv, pages=160)
    reqs = [h.start(rid, toks) for rid, toks in PROMPTS.items()]
    rec: dict = {"tiers": [], "out": []}
    new = [r.origin_input_ids for r in reqs]
    for step in range(STEPS + 1):
        rec["out"].append(h.step(reqs, new, extend=step == 0))
        rec["tiers"].append(
            {
                r.rid: [h.backend.sessions[r.rid].store.tiers(li).clone() for li in range(h.sim.L)]
                for r in reqs
            }
        )
        new = [[80 + step + i] for i in range(len(reqs))]
    stats = h.backend.stats()
    rec["demote"], rec["tp"] = stats["demote"], stats.get("tp")
    return rec


def _rank(rank: int) -> dict:
    return serve(rank, SimpleNamespace(world_size=WORLD, rank_in_group=rank, device_group=None))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank, WORLD, tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def whole() -> dict:
    return serve()


def same_decisions(part: dict, ref: dict, rank: int) -> bool:
    return all(
        torch.equal(mine, theirs[rank : rank + 1])
        for step, ref_step in zip(part["tiers"], ref["tiers"], strict=True)
        for rid in PROMPTS
        for mine, theirs in zip(step[rid], ref_step[rid], strict=True)
    )


def test_ranks_decide_and_attend_as_one_backend(ranks, whole):
    assert whole["demote"] > 0  # routing demoted windows: the decisions are not trivial
    heads_differ = any(not torch.equal(t[0], t[1]) for t in whole["tiers"][-1]["a"])
    assert heads_differ
    assert whole["tp"] is None
    tp = [part["tp"] for part in ranks]
    assert [t["heads"] for t in tp] == [[0, 1], [1, 2]] and tp[0]["routes"] > 0
    assert tp[0]["digest"] == tp[1]["digest"] and tp[0]["routes"] == tp[1]["routes"]
    d = HQ // KV_HEADS
    for rank, part in enumerate(ranks):
        assert same_decisions(part, whole, rank), f"rank {rank}'s tiers differ"
        for mine, theirs in zip(part["out"], whole["out"], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                b = b.reshape(b.shape[0], HQ, -1)[:, rank * d : (rank + 1) * d]
                torch.testing.assert_close(a, b.reshape(a.shape), rtol=1e-5, atol=1e-6)


# decode through the TriZone kernel (interpreted) under CUDA-graph replays: windows of 16
GRAPH_POLICY = (
    POLICY.replace("window(size=4)", "window(size=16)")
    .replace("group=4", "group=16")
    .replace("recent: 4", "recent: 16")
)
GRAPH_PROMPTS = {"a": list(range(1, 71)), "b": list(range(20, 56))}


def serve_graphs(rank: int | None = None, tp_group=None, graphs: bool = True) -> dict:
    """Prefill both requests, then decode steps as graph replays (``graphs``; else eagerly):
    each step's tiers after its routing, and the outputs."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # the kernel on CPU (set in the spawned rank too)
    kv = slice(0, KV_HEADS) if rank is None else slice(rank, rank + 1)
    q = slice(kv.start * HQ // KV_HEADS, kv.stop * HQ // KV_HEADS)
    h = Harness(q_heads=q, tp_group=tp_group, policy=GRAPH_POLICY, heads=KV_HEADS, kv_heads=kv,
                head_dim=64, pages=40)  # fmt: skip
    if graphs:
        h.backend.init_cuda_graph_state(2, 2)
        h.capture(2)
    reqs = [h.start(rid, toks) for rid, toks in GRAPH_PROMPTS.items()]
    rec: dict = {"tiers": [], "out": [h.step(reqs, [r.origin_input_ids for r in reqs], True)]}
    for step in range(STEPS):
        new = [[60 + step + i] for i in range(len(reqs))]
        if graphs:
            rec["out"].append(h.replay(reqs, new, 2))
            h.backend.flush()
        else:
            rec["out"].append(h.step(reqs, new, extend=False))
        rec["tiers"].append(
            {
                r.rid: [h.backend.sessions[r.rid].store.tiers(li).clone() for li in range(h.sim.L)]
                for r in reqs
            }
        )
    stats = h.backend.stats()
    rec["demote"], rec["tp"], rec["host"] = stats["demote"], stats.get("tp"), stats["host_s"]
    return rec


def _rank_graphs(rank: int) -> dict:
    return serve_graphs(rank, SimpleNamespace(world_size=WORLD, rank_in_group=rank,
                                              device_group=None))  # fmt: skip


def test_ranks_decide_alike_under_cuda_graph_replays(tmp_path):
    """Decode replays route at ``flush`` (its all-gather outside the graph): both ranks decide,
    per head, what one backend over both heads replaying graphs decides, and attend alike.
    (Against eager decode the kernel's splits differ, so its masses differ in the last bits:
    2e-7 relative here, enough to flip one window at this proportional spread's budget edge;
    test_backend.py compares graphs with eager decode.)"""
    pytest.importorskip("triton")
    ranks = run_ranks(_rank_graphs, WORLD, tmp_path)
    whole = serve_graphs(graphs=True)
    assert whole["demote"] > 0 and all(p["host"]["graph_steps"] == STEPS for p in ranks)
    tp = [part["tp"] for part in ranks]
    assert tp[0]["digest"] == tp[1]["digest"] and tp[0]["routes"] == tp[1]["routes"] > 1
    d = HQ // KV_HEADS
    for rank, part in enumerate(ranks):
        for step, ref_step in zip(part["tiers"], whole["tiers"], strict=True):
            for rid in GRAPH_PROMPTS:
                for mine, theirs in zip(step[rid], ref_step[rid], strict=True):
                    assert torch.equal(mine, theirs[rank : rank + 1]), (rank, rid)
        for mine, theirs in zip(part["out"], whole["out"], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                b = b.reshape(b.shape[0], HQ, -1)[:, rank * d : (rank + 1) * d]
                assert (a.float() - b.reshape(a.shape).float()).abs().max() < 2e-2


def test_a_rank_planning_alone_decides_otherwise(whole):
    """Without the shard, rank 1's engine spreads the whole budget over its one head."""
    alone = serve(rank=1)
    assert not same_decisions(alone, whole, 1)
