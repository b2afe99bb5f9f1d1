"""``allocate.by`` per tier: each kept tier fills from its own ranking (the language's
``by: {full: ..., int2: ...}``), in the allocator, the planner (one store, and stores stacked)
and the policy's explanation."""

from __future__ import annotations

import pytest
import torch

from tiered_radix.cli.explain import explain
from tiered_radix.engine import planner
from tiered_radix.engine.allocate_rank import rank_allocate
from tiered_radix.engine.attention import attend
from tiered_radix.engine.signals import PREFILL_SIGNALS, policy_reads
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.compiler import compile_text
from tiered_radix.policy.expr import to_text

L, H, HQ, D = 3, 2, 4, 32
QEVICT = """
policy: by-tier
budget: 30%
units: window(size=8)
protect: {sinks: 4, recent: 8}
scores:
  score: cumulative(attn, decay=0.99) + pool_max(obs_attn, size=7)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=8)
  evicted: evict
allocate:
  method: rank
  by: BY
  shares: {full: 50%, int2: 50%}
  hysteresis: 10%
schedule: after_prefill, every(2)
ledger: write_once
"""
ONE = QEVICT.replace("BY", "score")
SAME = QEVICT.replace("BY", "{full: score, int2: score}")
SPLIT = QEVICT.replace("BY", "{int2: mean_heads(mean_layers(score)), full: score}")


def _store(text: str, seed: int, prompt: int = 120, steps: int = 3) -> TierStore:
    g = torch.Generator().manual_seed(seed)
    policy = compile_text(text)
    need = frozenset(policy_reads(policy) & set(PREFILL_SIGNALS))
    store = TierStore(policy, n_layers=L, n_heads=H, head_dim=D)
    for t, n in enumerate([prompt] + [1] * steps):
        for li in range(L):
            k, v = (torch.randn(H, n, D, generator=g) for _ in range(2))
            store.append(li, k, v)
            kk, vv, kept = store.view(li)
            q = torch.randn(HQ, n, D, generator=g)
            store.observe(li, attend(q, kk, vv, kept, D**-0.5,
                                     need=need if t == 0 else frozenset())[1])  # fmt: skip
        store.route(f"step {t}")
    return store


def test_the_mapping_compiles_in_tier_order():
    one, split = compile_text(ONE).allocate, compile_text(SPLIT).allocate
    assert one.by_tier == () and one.rankings() == (one.by,)
    assert [to_text(e) for e in split.rankings()] == ["score", "mean_heads(mean_layers(score))"]
    assert split.by == split.by_tier[0]
    text = explain(compile_text(SPLIT))
    assert "full takes the highest `score`" in text
    assert "int2 takes the highest `mean_heads(mean_layers(score))`" in text


def test_the_allocator_fills_each_tier_from_its_column():
    """Two units fit each tier. Tier 0 takes column 0's best (units 3, 2), tier 1 the best of
    the rest by column 1 (units 0, 1), unit 4 is evicted; one ranking for both (column 0)
    would have put 0, 4 in tier 1 instead."""
    s0 = torch.tensor([0.5, 0.1, 0.8, 0.9, 0.4])
    s1 = torch.tensor([0.9, 0.8, 0.0, 0.0, 0.1])
    cost = torch.tensor([[2.0, 1.0, 0.0]] * 5)  # budget 8: tier 0 up to 4 bytes, tiers 0-1 to 6
    kw = dict(shares=[0.5, 0.25])
    per = rank_allocate(torch.stack([s0, s1], -1), cost, 8.0, **kw)
    assert per.tolist() == [1, 1, 0, 0, 2]
    assert rank_allocate(s0, cost, 8.0, **kw).tolist() == [1, 2, 0, 0, 1]
    # identical columns are the single ranking; -inf in a column: not placeable in that tier
    assert torch.equal(rank_allocate(torch.stack([s0, s0], -1), cost, 8.0, **kw),
                       rank_allocate(s0, cost, 8.0, **kw))  # fmt: skip
    s1[0] = -torch.inf
    assert rank_allocate(torch.stack([s0, s1], -1), cost, 8.0, **kw).tolist() == [2, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="a ranking per kept tier"):
        rank_allocate(torch.stack([s0, s1, s1], -1), cost, 8.0, **kw)


def test_one_ranking_named_per_tier_routes_as_the_single_ranking():
    a, b = _store(ONE, 0), _store(SAME, 0)
    for li in range(L):
        assert torch.equal(a.tiers(li), b.tiers(li))
    held = torch.cat([a.tiers(li).flatten() for li in range(L)])
    assert len(set(held.tolist())) == 3  # full, INT2 and evicted windows all present


def test_rankings_per_tier_change_what_the_lower_tier_keeps():
    """At the first routing (no history) the best tier ranks alike under both policies; the
    INT2 tier keeps other windows. (Later routings may differ in full too: a window one policy
    evicted cannot come back, the other's may be promoted.)"""
    a, b = _store(ONE, 1, steps=0), _store(SPLIT, 1, steps=0)
    full = a.tier_names.index("full")
    assert all(torch.equal(a.tiers(li) == full, b.tiers(li) == full) for li in range(L))
    assert any(not torch.equal(a.tiers(li), b.tiers(li)) for li in range(L))


def test_stacked_stores_plan_as_each_alone():
    stores = [_store(SPLIT, seed) for seed in range(3)]
    got = planner.plan_routes(stores)
    for s, p in zip(stores, got, strict=True):
        want = planner.plan_route(s)
        assert torch.equal(p.tiers, want.tiers) and torch.equal(p.over, want.over)
