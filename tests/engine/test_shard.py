"""Tensor parallelism: two ``TierStore`` ranks over halves of the KV heads (``HeadShard`` over a
gloo process group) make the decisions one engine over all heads makes, bit for bit.

Each rank is fed exactly the full model's K/V and signals of its heads (the full tensors are
drawn from seeded generators, then sliced), routes after prefill and at decode steps, and
records tiers (V units; K channels for RDKV), transitions, schedule decisions, step records and
the final dequantized rows. The reference is the unsharded engine on all 4 heads, run in this
process. A naive per-rank engine (no collectives) is shown to differ, so the comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

from tiered_radix import load_policy
from tiered_radix.engine.shard import HeadShard
from tiered_radix.engine.signals import Signals
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.compiler import compile_text
from tiered_radix.policy.expr import Call
from tiered_radix.policy.model import Budget

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (ROOT / "policies").glob("*.yaml"))
H, L, D, PROMPT, STEPS, WORLD = 4, 3, 32, 320, 34, 2
SCALE = torch.tensor([1.0, 8.0, 2.0, 5.0])  # per-head attention mass: heads differ, ranks too

# budget spread in proportion to each (layer, head)'s attention; routing under pressure
PROPORTIONAL = """
policy: tp_proportional
budget: 30%
units: window(size=16)
protect: {sinks: 4, recent: 16}
spread: proportional(cumulative(attn, decay=0.9))
scores:
  heat: cumulative(attn, decay=0.9)
tiers:
  full: keep(bf16)
  int4: quantize(bits=4, group=16)
  int2: quantize(bits=2, group=16)
  evicted: evict
rules:
  - when: heat < quantile(heat, 10%)
    then: evict
allocate: {method: rank, by: heat, hysteresis: 10%}
schedule: after_prefill, on_pressure(97%)
ledger: write_once
"""
# a fixed byte budget (the same for any number of heads) spread over a pyramid
PYRAMID = """
policy: tp_pyramid
budget: 40 KiB
units: token
protect: {recent: 8}
spread: pyramid(ratio=3)
scores:
  heat: cumulative(attn, decay=0.95)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=32)
  evicted: evict
allocate: {method: rank, by: heat}
schedule: after_prefill, every(5)
"""
# scores reduced over every KV head and every layer: ranks gather the heads they lack
HEADS = (
    PYRAMID.replace("tp_pyramid", "tp_heads")
    .replace(
        "cumulative(attn, decay=0.95)", "mean_heads(mean_layers(cumulative(attn, decay=0.95)))"
    )
    .replace("budget: 40 KiB", "budget: 30%")
    .replace("spread: pyramid(ratio=3)\n", "")
)
CUSTOM = {"tp_proportional": PROPORTIONAL, "tp_pyramid": PYRAMID, "tp_heads": HEADS}
# the shipped 10% protects up to 68 tokens of a 150-token prompt, over budget before any choice
# is made; a larger budget (and a `tokens` one) leaves the allocator room to choose per head
BUDGETS = {
    "h2o": Budget("fraction", 0.5),
    "qevict": Budget("fraction", 0.6),
    "rdkv": Budget("fraction", 0.3),
    "snapkv": Budget("fraction", 0.5),
    "streaming": Budget("tokens", 90),
}
CASES = [*SHIPPED, *CUSTOM]


def policy_of(name: str):
    return compile_text(CUSTOM[name], name) if name in CUSTOM else load_policy(name)


def _draw(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def _attn(seed: int, t: int, heads: slice, kept: torch.Tensor) -> torch.Tensor:
    """The full model's attention-like mass ``[H, t]``, sliced to ``heads``; zero where evicted."""
    a = _draw(seed, H, t) ** 3 * SCALE[:, None]
    return a[heads] * kept


def _kept(store: TierStore, li: int) -> torch.Tensor:
    """bool ``[H, T]``: tokens not evicted (what ``view(li)[2]`` says, without dequantizing)."""
    ev = store.tier_set.evict
    alive = store.tiers(li) != (-1 if ev is None else ev)
    return store.layout.token_mask(alive, store.n_tokens(li))


def drive(name: str, heads: slice, shard: HeadShard | None = None) -> dict:
    """Prefill, route, decode ``STEPS`` tokens routing when due; everything the engine decided,
    with head indices of the full model."""
    policy = policy_of(name)
    n = heads.stop - heads.start
    store = TierStore(
        policy, n_layers=L, n_heads=n, head_dim=D, budget_override=BUDGETS.get(name), shard=shard
    )
    g = torch.Generator().manual_seed(7)
    for li in range(L):
        k = torch.randn(H, PROMPT, D, generator=g)
        v = torch.randn(H, PROMPT, D, generator=g) * (1 + torch.arange(H))[:, None, None]
        store.append(li, k[heads], v[heads])
        ones = torch.ones(n, PROMPT)
        store.observe(
            li,
            Signals(
                attn=_attn(100 + li, PROMPT, heads, ones),
                colmass=(_draw(200 + li, H, PROMPT) * SCALE[:, None])[heads] + 0.01,
                obs_attn=_draw(300 + li, H, PROMPT)[heads] + 0.01,
                qnorm=_draw(400 + li, H, D)[heads] + 0.1,
            ),
        )
    rec: dict = {"tiers": [], "k": [], "moves": [], "due": []}

    def record(moves) -> None:
        rec["tiers"].append([store.tiers(li).clone() for li in range(L)])
        rec["k"].append([lay.k.tier.clone() for lay in store.layers if lay.k is not None])
        cols = (moves.layer, moves.head + heads.start, moves.unit, moves.src, moves.dst)
        cols = [c.tolist() for c in (*cols, moves.ledger_write)]
        rec["moves"].append(sorted(zip(*cols, strict=True)))

    if (moves := store.after_prefill()) is not None:
        record(moves)
    for s in range(STEPS):
        for li in range(L):
            k, v = torch.randn(2, H, 1, D, generator=g)
            store.append(li, k[heads], v[heads])
        t = store.n_tokens()
        kept = torch.stack([_kept(store, li) for li in range(L)]).float()
        store.observe_attn(
            torch.stack([_attn(1000 * s + li, t, heads, kept[li]) for li in range(L)])
        )
        rec["due"].append(store.schedule_due(s))
        if rec["due"][-1]:
            record(store.route(f"decode {s}"))
    rec["steps"] = [(e.step, e.bytes_used, e.budget, e.over_budget) for e in store.events.steps]
    rec["view"] = [store.view(li)[:2] for li in range(L)]
    return rec


def _rank(rank: int) -> dict:
    shard = HeadShard.of_group(H)
    return {n: drive(n, shard.heads, shard) for n in CASES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank, WORLD, tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def full() -> dict:
    return {n: drive(n, slice(0, H)) for n in CASES}


def assert_slice_of(part: dict, whole: dict, heads: slice) -> None:
    """``part`` (one rank) made exactly ``whole``'s decisions for ``heads``."""
    assert part["due"] == whole["due"]
    assert len(part["tiers"]) == len(whole["tiers"]) > 0
    for mine, ref in zip(part["tiers"], whole["tiers"], strict=True):
        for li in range(L):
            assert torch.equal(mine[li], ref[li][heads]), f"layer {li} tiers differ"
    for mine, ref in zip(part["k"], whole["k"], strict=True):
        for li, (a, b) in enumerate(zip(mine, ref, strict=True)):
            assert torch.equal(a, b[heads]), f"layer {li} K channel tiers differ"
    for mine, ref in zip(part["moves"], whole["moves"], strict=True):
        assert mine == [m for m in ref if heads.start <= m[1] < heads.stop]
    for (k, v), (rk, rv) in zip(part["view"], whole["view"], strict=True):
        torch.testing.assert_close(k, rk[heads], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v, rv[heads], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", CASES)
def test_ranks_decide_as_one_engine(name, ranks, full):
    ref = full[name]
    for r, res in enumerate(ranks):
        assert_slice_of(res[name], ref, HeadShard(r, WORLD, H).heads)
        # the step records (bytes of all heads, budget, over-budget flag) are the whole model's
        assert res[name]["steps"] == ref["steps"]


def test_cases_are_not_trivial(full):
    """The custom policies route on some decode steps and not on others; routing moves units
    (but under ``full``), heads get different tiers, and steps are within budget."""
    for name in CUSTOM:
        assert 0 < sum(full[name]["due"]) < STEPS, name
    for name in CASES:
        if name not in ("full", "kivi"):
            assert any(full[name]["moves"]), name
        heads_differ = any(not torch.equal(t[0], t[1]) for t in full[name]["tiers"][-1])
        alike = name in ("full", "kivi", "streaming") or _reduces_heads(name)  # by position/all
        assert heads_differ or alike, name
        assert not any(over for *_, over in full[name]["steps"]), name


def _reduces_heads(name: str) -> bool:
    """The policy's scores reduce over the KV heads, so every head decides alike."""
    p = policy_of(name)
    calls = (n for _, e in p.scores for n in e.walk() if isinstance(n, Call))
    return any(n.fn.endswith("_heads") for n in calls)


@pytest.mark.parametrize("name", ["tp_proportional", "tp_pyramid", "tp_heads"])
def test_naive_per_rank_engine_drifts(name, full):
    """Without the collectives, a rank's engine budgets and spreads over its own heads only
    (proportional: heads 2-3 get half the budget, not their attention's share; a byte budget:
    all of it instead of half; a mean over heads: over heads 2-3 alone), so its
    decisions differ from the full engine's; the comparison above would catch it."""
    naive = drive(name, slice(2, 4))
    with pytest.raises(AssertionError):
        assert_slice_of(naive, full[name], slice(2, 4))


def test_shard_validation():
    assert HeadShard.single(4).heads == slice(0, 4)
    assert HeadShard(1, 2, 8).heads == slice(4, 8)
    with pytest.raises(ValueError, match="split evenly"):
        HeadShard(0, 3, 4)
    with pytest.raises(ValueError, match="rank"):
        HeadShard(2, 2, 4)
    with pytest.raises(ValueError, match="n_heads=4"):
        TierStore(load_policy("h2o"), n_layers=1, n_heads=4, head_dim=D, shard=HeadShard(0, 2, 4))
    t = torch.arange(12.0).reshape(3, 4)
    one = HeadShard.single(4)
    assert one.gather_heads(t, 1) is t and one.local(t, 1) is t
    s = one.sum(t)
    assert torch.equal(s, t) and s.data_ptr() != t.data_ptr()
    assert torch.equal(HeadShard(1, 2, 4).local(t, 1), t[:, 2:])


def test_head_reductions_see_every_rank():
    """A ``*_heads`` score under TP reduces over all heads (gathered), not the rank's own: the
    heads policy's ranks agree with one engine (test_ranks_decide_as_one_engine), and every
    head of a layer holds the same tiers there, which per-rank reductions would not give."""
    policy = compile_text(HEADS, "tp_heads")
    assert "mean_heads" in str(policy.scores)
    rec = drive("tp_heads", slice(0, H))
    for tiers in rec["tiers"][1:]:
        for li in range(L):
            t = tiers[li][:, :-16]  # the recent (protected) tokens aside
            assert torch.equal(t, t[:1].expand_as(t)), "heads of a layer decided apart"


def _least(rank: int) -> list[int]:
    shard = HeadShard.of_group(H)
    return shard.least(torch.tensor([10 + rank, 7 - rank])).tolist()


def test_least_is_every_ranks_minimum(tmp_path):
    """A choice made from a per-rank reading (the decode graphs' capacity from free memory) is
    the same on every rank: the elementwise minimum over them."""
    assert run_ranks(_least, WORLD, tmp_path) == [[10, 7 - (WORLD - 1)]] * WORLD
    one = HeadShard.single(4)
    t = torch.tensor([3, 1])
    assert torch.equal(one.least(t), t) and one.least(t).data_ptr() != t.data_ptr()
