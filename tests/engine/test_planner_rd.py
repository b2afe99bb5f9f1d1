"""RDKV's plan in batched tensor ops (every layer and head in one allocator call for V, one
for K) decides what the allocator decides per layer and head."""

from __future__ import annotations

import pytest
import torch

from tiered_radix.engine import planner
from tiered_radix.engine.attention import attend
from tiered_radix.engine.signals import PREFILL_SIGNALS, policy_reads
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.compiler import compile_text
from tiered_radix.resources import policies_dir

L, H, HQ, D = 3, 2, 4, 32
TEXT = (policies_dir() / "rdkv.yaml").read_text()
PROTECT = "protect:\n  sinks: 4\n  recent: 64\n"  # the shipped rdkv's
assert PROTECT in TEXT
POLICIES = {
    "rdkv": TEXT,
    "unprotected": TEXT.replace(PROTECT, ""),
    "protected-20%": TEXT.replace("budget: 10%", "budget: 20%").replace(
        PROTECT, "protect: {sinks: 4, recent: 16}\n"
    ),
    "every-2-30%": TEXT.replace("budget: 10%", "budget: 30%").replace(
        "after_prefill(defer=true)", "after_prefill, every(2)"
    ),
}


def _store(text: str, seed: int, prompt: int, steps: int, route: bool = True) -> TierStore:
    """A prompt routed after prefill, then ``steps`` decode tokens (a second routing sees
    evicted units); ``route=False``: none of them routed (the next plan is the first)."""
    g = torch.Generator().manual_seed(seed)
    policy = compile_text(text)
    need = frozenset(policy_reads(policy) & set(PREFILL_SIGNALS))  # what an adapter computes
    store = TierStore(policy, n_layers=L, n_heads=H, head_dim=D)
    for t, n in enumerate([prompt] + [1] * steps):
        for li in range(L):
            k, v = (torch.randn(H, n, D, generator=g) for _ in range(2))
            store.append(li, k * (1 + torch.arange(D) / 8), v)
            kk, vv, kept = store.view(li)
            q = torch.randn(HQ, n, D, generator=g)
            store.observe(li, attend(q, kk, vv, kept, D**-0.5,
                                     need=need if t == 0 else frozenset())[1])  # fmt: skip
        if route:
            store.route(f"step {t}")
    return store


def _per_head(store) -> planner.Plan:
    """The per-layer-and-head path (``rd_allocate`` per head, budgets read to the host)."""
    groups, cons, head_budget, out = planner._budgets(store)
    hb = head_budget.tolist()
    v, k, ks = {}, {}, {}
    for g, c in zip(groups, cons, strict=True):
        cost = planner._costs(store, g)
        for i, li in enumerate(g.layers):
            v[li], k[li], ks[li] = planner._rd_decoupled(store, li, c[i], cost[i], hb[li])
    out.k, out.k_set = [k[li] for li in range(L)], [ks[li] for li in range(L)]
    return v, out


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_rdkv_plan_is_the_per_head_plan(name, seed):
    store = _store(POLICIES[name], seed, prompt=150, steps=3)
    got = store.plan()
    v, want = _per_head(store)
    for li in range(L):
        u = got.units[li]
        assert torch.equal(got.tiers[li, :, :u], v[li])
        assert torch.equal(got.k[li], want.k[li]) and torch.equal(got.k_set[li], want.k_set[li])
    ev = store.tier_set.evict
    assert any((x == ev).any() for x in v.values()) and any((x != ev).any() for x in v.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_rdkv_plan_reads_each_layer_once(seed):
    """The V and K weights and spreads of one plan share each layer's rows: one read a layer
    (a store with ``reader=``, as the SGLang pool's), and the plan the data store makes."""
    g = torch.Generator().manual_seed(seed)
    policy = compile_text(POLICIES["unprotected"])
    need = frozenset(policy_reads(policy) & set(PREFILL_SIGNALS))
    full = TierStore(policy, n_layers=L, n_heads=H, head_dim=D)
    reads = []
    bare = TierStore(policy, n_layers=L, n_heads=H, head_dim=D,
                     reader=lambda li: reads.append(li) or full.view(li))  # fmt: skip
    for li in range(L):
        full.append(li, *(torch.randn(H, 150, D, generator=g) for _ in range(2)))
        bare.append_tokens(li, 150)
        kk, vv, kept = full.view(li)
        q = torch.randn(HQ, 150, D, generator=g)
        sig = attend(q, kk, vv, kept, D**-0.5, need=need)[1]
        full.observe(li, sig)
        bare.observe(li, sig)
    reads.clear()
    got, want = bare.plan(), full.plan()
    assert sorted(reads) == list(range(L))
    assert torch.equal(got.tiers, want.tiers)
    for li in range(L):
        assert torch.equal(got.k[li], want.k[li]) and torch.equal(got.k_set[li], want.k_set[li])


@pytest.mark.parametrize("name", list(POLICIES))
def test_rdkv_bytes_over_stacked_layers_are_the_per_layer_sum(name):
    store = _store(POLICIES[name], 1, prompt=150, steps=3)
    want = store.stack.nbytes()
    for lay in store.layers:
        _, kept = lay.v.view()
        want = want + lay.k.nbytes_heads().sum() + lay.k.rows_bytes(kept).sum()
    got = store._bytes()
    assert got.dtype == torch.long and int(got) == int(want)
    store.append(0, *(torch.randn(H, 1, D) for _ in range(2)))  # layers of unequal lengths
    assert store.bytes_used() > int(got)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("steps", [[2, 2, 2], [2, 5]])
@pytest.mark.parametrize("route", [False, True])
def test_rdkv_plans_of_several_stores_are_each_stores_plan(name, steps, route, monkeypatch):
    """Stores of equal lengths planned in one pass (their rows stacked; in passes of two where
    the allocator's tables are limited), and stores of different lengths one by one: each plan
    is the one its store makes alone (at a first routing, and at a later one)."""
    stores = [_store(POLICIES[name], seed, 900, n, route) for seed, n in enumerate(steps)]
    got = planner.plan_routes(stores)
    per = L * H * stores[0].stack.n_units(0) * len(stores[0].tier_names) * 8
    monkeypatch.setattr(planner, "_RD_TABLE_BYTES", 2 * per)
    for a, b in zip(got, planner.plan_routes(stores), strict=True):
        assert torch.equal(a.tiers, b.tiers) and all(map(torch.equal, a.k, b.k))
    for s, p in zip(stores, got, strict=True):
        want = planner.plan_route(s)
        assert p.units == want.units and torch.equal(p.tiers, want.tiers)
        assert torch.equal(p.over, want.over)
        for li in range(L):
            assert torch.equal(p.k[li], want.k[li]) and torch.equal(p.k_set[li], want.k_set[li])
    same = [torch.equal(a.tiers, b.tiers) and all(map(torch.equal, a.k, b.k))
            for a, b in zip(got, got[1:], strict=False)]  # fmt: skip
    assert not all(same)  # the rows are the stores' own
