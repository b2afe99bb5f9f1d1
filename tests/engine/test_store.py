"""TierStore invariants (the issue's acceptance criteria), as hypothesis property tests over the
shipped policies with random budgets, random K/V and random signals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_shard import CUSTOM

from tiered_radix import load_policy
from tiered_radix.engine.routing import full_token_bytes
from tiered_radix.engine.signals import Signals
from tiered_radix.engine.store import TierStore
from tiered_radix.formats import codecs
from tiered_radix.policy.compiler import compile_text
from tiered_radix.policy.model import Budget, Evict, Quantize

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (ROOT / "policies").glob("*.yaml"))
FILES = [ROOT / "policies" / f"{n}.yaml" for n in SHIPPED]
if (ROOT / "examples" / "custom_policy.yaml").exists():
    FILES.append(ROOT / "examples" / "custom_policy.yaml")


def signals(g: torch.Generator, kept: torch.Tensor, d: int, prefill: bool) -> Signals:
    h, t = kept.shape
    a = (torch.rand(h, t, generator=g) + 1e-3) * kept
    s = Signals(attn=a / a.sum(1, keepdim=True))
    if prefill:
        s = Signals(
            attn=s.attn,
            colmass=torch.rand(h, t, generator=g) * 4 + 0.01,
            obs_attn=torch.rand(h, t, generator=g) + 0.01,
            qnorm=torch.rand(h, d, generator=g) + 0.1,
        )
    return s


def run(
    policy, *, layers, heads, d, prompt, steps, seed, budget=None, dtype=torch.bfloat16, check=None
):
    """Prefill, route, then decode ``steps`` tokens routing when due; ``check(store)`` after
    every routing step."""
    g = torch.Generator().manual_seed(seed)
    store = TierStore(
        policy, n_layers=layers, n_heads=heads, head_dim=d, dtype=dtype, budget_override=budget
    )
    for li in range(layers):
        store.append(
            li,
            torch.randn(heads, prompt, d, generator=g),
            torch.randn(heads, prompt, d, generator=g) * 2 + 0.5,
        )
        store.observe(li, signals(g, torch.ones(heads, prompt, dtype=torch.bool), d, True))
    moves = store.after_prefill()
    if store.deferred and steps == 0:  # deferred to the first decode step: with none, here
        moves = store.route("after prefill")
    if moves is not None and not store.deferred and check:
        check(store)
    for s in range(steps):
        for li in range(layers):
            store.append(
                li, torch.randn(heads, 1, d, generator=g), torch.randn(heads, 1, d, generator=g)
            )
            store.observe(li, signals(g, store.view(li)[2], d, False))
        if store.schedule_due(s):
            store.route(f"decode {s}")
            if check:
                check(store)
    return store


def forced_bytes(store) -> int:
    """Independent count: protected/partial units at full precision, K and V, all layers."""
    p, total = store.policy.protect, 0
    for li in range(store.n_layers):
        t = store.n_tokens(li)
        w = 1 if store.policy.v.kind == "token" else store.policy.v.size
        units = [(u * w, min(u * w + w, t)) for u in range(math.ceil(t / w))]
        for a, b in units:
            if a < p.sinks or b > t - p.recent or b - a < w:
                total += (b - a) * 4 * store.head_dim * store.n_heads
    return total


def check_invariants(store) -> None:
    ev = store.events.steps[-1]
    used, budget = store.bytes_used(), store.budget_bytes()
    assert ev.bytes_used == used and ev.budget == budget
    has_evict = isinstance(store.policy.tiers[-1].action, Evict)
    if used > budget:
        assert ev.over_budget, "over budget without saying so"
    if ev.over_budget and has_evict:
        assert forced_bytes(store) > budget
    names = store.tier_names
    for li in range(store.n_layers):
        tiers = store.tiers(li)
        t = store.n_tokens(li)
        w = store.policy.v.size if store.policy.v.kind == "window" else 1
        assert tiers.shape == (store.n_heads, math.ceil(t / w))
        assert bool(((tiers >= 0) & (tiers < len(names))).all())
        counts = torch.stack([(tiers == j).sum(1) for j in range(len(names))], 1)
        assert counts.sum(1).tolist() == [tiers.shape[1]] * store.n_heads
        if ev.over_budget and has_evict and store.coupled:
            prot = store.layout.protected(t, store.policy.protect)
            assert bool((tiers[:, ~prot] == len(names) - 1).all())
        k, v, kept = store.view(li)
        assert bool(k[kept].isfinite().all()) and bool(v[kept].isfinite().all())
        assert bool(k[~kept].isnan().all()) and bool(v[~kept].isnan().all())
        q = torch.randn(store.n_heads, store.head_dim)  # attention over the view, masked
        logits = torch.einsum("hd,htd->ht", q, torch.where(kept[..., None], k, 0.0))
        p = torch.softmax(logits.masked_fill(~kept, -torch.inf), -1)
        out = torch.einsum("ht,htd->hd", p, torch.where(kept[..., None], v, 0.0))
        assert bool(out[kept.any(1)].isfinite().all())
        for s in store.layers[li].v.stores.values():
            if store.policy.ledger.write_once and s.write_count.numel():
                assert int(s.write_count.max()) <= 1


policies = st.sampled_from(SHIPPED)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=policies,
    frac=st.floats(0.02, 1.0),
    layers=st.integers(1, 2),
    heads=st.integers(1, 2),
    d=st.sampled_from([16, 32]),
    prompt=st.integers(8, 150),
    steps=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_budget_and_invariants_after_every_route(name, frac, layers, heads, d, prompt, steps, seed):
    run(
        load_policy(name),
        layers=layers,
        heads=heads,
        d=d,
        prompt=prompt,
        steps=steps,
        seed=seed,
        budget=Budget("fraction", frac),
        check=check_invariants,
    )


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=policies,
    frac=st.floats(0.05, 1.0),
    prompt=st.integers(40, 160),
    seed=st.integers(0, 2**16),
)
def test_exact_bytes_no_ledger(name, frac, prompt, seed):
    """bytes_used equals an independent count from the tier maps and the codec's sizes."""
    pol = load_policy(name)
    store = run(
        pol,
        layers=1,
        heads=2,
        d=16,
        prompt=prompt,
        steps=0,
        seed=seed,
        budget=Budget("fraction", frac),
    )
    if pol.ledger.write_once or not store.coupled:
        return  # kept copies (write-once) and K channels are covered by the other tests
    tiers, t, d = store.tiers(0), store.n_tokens(0), store.head_dim
    w = pol.v.size if pol.v.kind == "window" else 1
    want = 0
    for h in range(store.n_heads):
        for u in range(tiers.shape[1]):
            a = store.tier_set.tiers[int(tiers[h, u])].action
            n = min(t, (u + 1) * w) - u * w
            if isinstance(a, Quantize):
                gk = min(a.group, w) if w > 1 else min(a.group, d)
                want += codecs.quantized_nbytes(n * d, a.bits, gk)
                want += codecs.quantized_nbytes(n * d, a.bits, min(a.group, d))
            elif not isinstance(a, Evict):
                want += 4 * n * d
    assert store.bytes_used() == want


def test_promote_after_demote_restores_the_ledger_copy_exactly():
    pol = load_policy("qevict")
    g = torch.Generator().manual_seed(0)
    h, d, t = 2, 32, 512
    store = TierStore(
        pol,
        n_layers=1,
        n_heads=h,
        head_dim=d,
        dtype=torch.float32,
        budget_override=Budget("fraction", 0.5),
    )
    store.append(0, torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g))
    attn = torch.rand(h, t, generator=g)
    store.observe(0, Signals(attn=attn, obs_attn=torch.zeros(h, t)))  # qevict reads obs_attn
    store.route("prefill")
    tiers = store.tiers(0)
    q = store.tier_names.index("int2")
    head, unit = (tiers == q).nonzero()[0].tolist()
    rows = slice(unit * 32, unit * 32 + 32)
    k_q, v_q, _ = store.view(0)
    k_q, v_q = k_q[head, rows].clone(), v_q[head, rows].clone()
    copy = store.layers[0].v.stores[q].read(tiers.shape[1])
    assert torch.equal(copy["k"][head, unit], k_q) and torch.equal(copy["v"][head, unit], v_q)
    boost = torch.zeros(h, t)
    boost[head, rows] = 1e6  # the unit's cumulative score jumps to the top
    store.observe(0, Signals(attn=boost))
    moves = store.route("boost")
    assert any(m.kind == "promote" and (m.head, m.unit) == (head, unit) for m in moves)
    assert int(store.tiers(0)[head, unit]) == 0
    lay = store.layers[0].v
    assert torch.equal(lay.full["k"][head, rows], k_q) and torch.equal(
        lay.full["v"][head, rows], v_q
    )
    assert int(lay.stores[q].write_count[head, unit]) == 1  # the copy is kept, not rewritten
    store.observe(0, Signals(attn=-boost * 1e3))  # and falls again: reuses the same copy
    store.route("drop")
    assert int(store.tiers(0)[head, unit]) != 0
    assert int(lay.stores[q].write_count.max()) == 1
    if int(store.tiers(0)[head, unit]) == q:
        k2, v2, _ = store.view(0)
        assert torch.equal(k2[head, rows], k_q) and torch.equal(v2[head, rows], v_q)


def test_demoted_full_rows_are_poisoned():
    store = run(
        load_policy("qevict"),
        layers=1,
        heads=2,
        d=16,
        prompt=300,
        steps=0,
        seed=1,
        budget=Budget("fraction", 0.4),
    )
    lay, tiers = store.layers[0].v, store.tiers(0)
    rows = lay.layout.token_mask(tiers != 0, store.n_tokens(0))
    assert bool(rows.any())
    assert bool(lay.full["k"][:, : store.n_tokens(0)][rows].isnan().all())


def test_rdkv_evicted_v_token_is_evicted_for_k():
    store = run(
        load_policy("rdkv"),
        layers=1,
        heads=2,
        d=32,
        prompt=200,
        steps=3,
        seed=2,
        budget=Budget("fraction", 0.1),
        check=check_invariants,
    )
    k, v, kept = store.view(0)
    assert bool((~kept).any()) and bool(kept.any())
    assert bool(k[~kept].isnan().all()) and bool(k[kept].isfinite().all())


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_policy_file_runs(path):
    store = run(
        load_policy(str(path)),
        layers=2,
        heads=2,
        d=32,
        prompt=96,
        steps=6,
        seed=5,
        check=check_invariants,
    )
    assert store.events.steps, "the policy never routed"
    assert sum(store.occupancy().values()) == sum(store.tiers(li).numel() for li in range(2))


@pytest.mark.parametrize("name", ["qevict", "kivi", "h2o", "rdkv"])
def test_layers_routed_with_different_token_counts(name):
    """Layers mid-step hold different token counts: they are planned in separate groups and
    every layer's tiers still obey the invariants and cover exactly its own units."""
    pol = load_policy(name)
    g = torch.Generator().manual_seed(3)
    h, d, prompts = 2, 32, [100, 164, 100]
    store = TierStore(
        pol, n_layers=3, n_heads=h, head_dim=d, budget_override=Budget("fraction", 0.3)
    )
    for li, t in enumerate(prompts):
        store.append(li, torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g))
        store.observe(li, signals(g, torch.ones(h, t, dtype=torch.bool), d, True))
    store.route("uneven")
    check_invariants(store)
    for li, t in enumerate(prompts):
        w = pol.v.size if pol.v.kind == "window" else 1
        assert store.tiers(li).shape == (h, math.ceil(t / w))
    assert store.bytes_used() <= store.budget_bytes() or store.events.steps[-1].over_budget


RULES = {  # rules that decide: the first windows kept, a band capped at INT2
    "rules": CUSTOM["tp_proportional"].replace(
        "  - when: heat < quantile(heat, 10%)\n    then: evict",
        "  - when: position < 48\n    then: keep\n  - when: position > 200\n    then: demote",
    ),
    **CUSTOM,
}
TOGETHER = [*(str(p) for p in FILES), *RULES]  # + rules, proportional and pyramid spreads


def prefilled_stores(pol, prompts, seed: int, h: int = 2, d: int = 32):
    """Stores of two layers at 30% of the bytes, one per prompt length, each given its prompt
    and prefill signals from one seeded generator; the stores and that generator."""
    g = torch.Generator().manual_seed(seed)
    stores = []
    for t in prompts:
        s = TierStore(
            pol, n_layers=2, n_heads=h, head_dim=d, budget_override=Budget("fraction", 0.3)
        )
        for li in range(2):
            s.append(li, torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g))
            s.observe(li, signals(g, torch.ones(h, t, dtype=torch.bool), d, True))
        stores.append(s)
    return stores, g


@pytest.mark.parametrize("prompts", [[100, 164, 37], [64, 64]], ids=["uneven", "even"])
@pytest.mark.parametrize("name", TOGETHER, ids=[Path(n).name for n in TOGETHER])
def test_stores_routed_together_decide_as_each_alone(name, prompts):
    """route_many over requests (rank policies: stacked layers, padded units, one allocator
    call) gives each store the tiers and transitions of its own route()."""
    pol = compile_text(RULES[name]) if name in RULES else load_policy(name)
    h, d = 2, 32
    twins = [prefilled_stores(pol, prompts, seed=8, h=h, d=d) for _ in range(2)]
    for step in range(4):
        reasons = [f"step {step}"] * len(prompts)
        together = TierStore.route_many(twins[0][0], reasons)
        alone = [s.route(why) for s, why in zip(twins[1][0], reasons, strict=True)]
        for a, b in zip(together, alone, strict=True):
            assert list(a) == list(b)
        for a, b in zip(*(stores for stores, _ in twins), strict=True):
            for li in range(2):
                assert torch.equal(a.tiers(li), b.tiers(li))
            if not pol.rules:  # a keep rule may hold more than the budget (check_invariants)
                check_invariants(a)
        for stores, g in twins:  # the same new tokens and attention for both
            for s in stores:
                for li in range(2):
                    s.append(
                        li, torch.randn(h, 9, d, generator=g), torch.randn(h, 9, d, generator=g)
                    )
                    s.observe(li, signals(g, s.view(li)[2], d, False))


def test_a_dropped_store_keeps_its_tiers_and_the_others_land_as_routed_alone():
    """PendingRoutes.drop (a server request that ended between plan and land): that store's
    tiers and step count stay as before the plan, it gives no transitions, and the other
    stores land what their own route() gives."""
    pol = load_policy("qevict")
    (kept, _), (alone, _) = (prefilled_stores(pol, (320, 256, 288), seed=5) for _ in range(2))
    before = [kept[1].tiers(li).clone() for li in range(2)]
    pending = TierStore.begin_routes(kept, ["a", "b", "c"])
    pending.drop(1)
    landed = pending.land()
    want = [alone[0].route("a"), alone[2].route("c")]
    assert len(landed) == 2 and all(list(x) == list(y) for x, y in zip(landed, want, strict=True))
    assert all(torch.equal(kept[1].tiers(li), before[li]) for li in range(2))
    assert kept[1].step == 0 and kept[0].step == kept[2].step == 1
    for a, b in ((kept[0], alone[0]), (kept[2], alone[2])):
        assert all(torch.equal(a.tiers(li), b.tiers(li)) for li in range(2))
    assert len(want[0]) > 0 and len(want[1]) > 0  # the routings move units


@pytest.mark.parametrize("name", TOGETHER, ids=[Path(n).name for n in TOGETHER])
def test_observe_layers_equals_observe_per_layer(name):
    """Two prefill chunks' signals stacked over layers (observe_layers: one op a cumulative
    score) leave the scores, and so the routing's tiers, exactly where per-layer observe does;
    so do signals that cover fewer tokens than the layers hold (the per-layer fallback)."""
    pol = compile_text(RULES[name]) if name in RULES else load_policy(name)
    L, h, d = 3, 2, 32
    g = torch.Generator().manual_seed(5)
    twins = [TierStore(pol, n_layers=L, n_heads=h, head_dim=d,
                       budget_override=Budget("fraction", 0.3)) for _ in range(2)]  # fmt: skip
    for t, short in ((70, 0), (50, 0), (1, 3)):  # two chunks, then a step covering T - 3
        k, v = torch.randn(L, h, t, d, generator=g), torch.randn(L, h, t, d, generator=g)
        sig = [signals(g, torch.ones(h, twins[0].n_tokens(0) + t - short, dtype=torch.bool), d,
                       True) for _ in range(L)]  # fmt: skip
        for s in twins:
            for li in range(L):
                s.append(li, k[li], v[li])
        for li in range(L):
            twins[0].observe(li, sig[li])
        names = ("attn", "colmass", "obs_attn", "qnorm")
        twins[1].observe_layers(
            Signals(**{n: torch.stack([getattr(x, n) for x in sig]) for n in names})
        )
        assert twins[0].scores._state.keys() == twins[1].scores._state.keys()
        for node, x in twins[0].scores._state.items():
            assert torch.equal(x, twins[1].scores._state[node]), node
    a, b = (s.route("after prefill") for s in twins)
    assert list(a) == list(b)
    for li in range(L):
        assert torch.equal(twins[0].tiers(li), twins[1].tiers(li))


def test_transitions_are_exactly_the_tier_changes_and_count_ledger_writes():
    """The step's transitions equal the element-wise difference of the tier maps before and
    after route(), and ``ledger_write`` marks exactly the new ledger entries."""
    pol = load_policy("qevict")
    g = torch.Generator().manual_seed(4)
    h, d, t, layers = 2, 32, 640, 3
    store = TierStore(
        pol, n_layers=layers, n_heads=h, head_dim=d, budget_override=Budget("fraction", 0.3)
    )
    for li in range(layers):
        store.append(li, torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g))
    for step in range(4):
        for li in range(layers):
            obs = torch.zeros(h, t)  # qevict reads obs_attn (0: the ranking is attn's)
            store.observe(li, Signals(attn=torch.rand(h, t, generator=g) ** 6, obs_attn=obs))
        before = [store.tiers(li).clone() for li in range(layers)]
        q = store.tier_names.index("int2")
        writes = [lay.v.stores[q].write_count.clone() for lay in store.layers]
        moves = store.route(f"step {step}")
        on = moves.on("cpu", "layer", "head", "unit", "src", "dst", "ledger_write")  # before a read
        want = set()
        for li in range(layers):
            after = store.tiers(li)
            for hh, u in (after != before[li]).nonzero().tolist():
                want.add((li, hh, u, int(before[li][hh, u]), int(after[hh, u])))
        got = {
            (m.layer, m.head, m.unit, *(store.tier_names.index(x) for x in (m.src, m.dst)))
            for m in moves
        }
        assert got == want and len(moves) == len(want)
        for name, col in zip(moves._COLS, on, strict=True):  # unravelled where they lie
            assert torch.equal(col, getattr(moves, name))
        new = {
            (li, hh, u)
            for li, lay in enumerate(store.layers)
            for hh, u in (lay.v.stores[q].write_count[:, : writes[li].shape[1]] > writes[li])
            .nonzero()
            .tolist()
        }
        assert {(m.layer, m.head, m.unit) for m in moves if m.ledger_write} == new
        assert all(m.dst == "int2" for m in moves if m.ledger_write)
    assert store.events.counters["ledger_write"] == sum(
        int(lay.v.stores[q].write_count.sum()) for lay in store.layers
    )


@pytest.mark.parametrize("prompts", [(320,), (320, 384)], ids=["alone", "stacked"])
def test_a_routing_that_lands_a_step_later_meets_the_budget_it_was_planned_for(prompts):
    """Under SGLang's overlap order a decode routing lands after one more token was decoded:
    that token is at full precision until the next routing, as every token between routings
    is. The landing's check (and its record) is the budget the plan had, plus that token's full
    bytes, not the budget of the longer sequence (GPU run 22's serving counted 3 routings of
    1,432 over budget by a few hundred bytes: the late token's bytes less its budget share)."""
    pol = load_policy("qevict")
    stores, g = prefilled_stores(pol, prompts, seed=3)
    planned = [s.budget_bytes() for s in stores]
    pending = TierStore.begin_routes(stores, ["decode step 15"] * len(stores))
    for s in stores:  # the next step's token, written before the routing lands
        for li in range(2):
            s.append(li, torch.randn(2, 1, 32, generator=g), torch.randn(2, 1, 32, generator=g))
    pending.land()
    late = 2 * full_token_bytes(2, 32)  # one token in each of 2 layers
    for s, budget in zip(stores, planned, strict=True):
        e = s.events.steps[-1]
        assert e.budget == budget + late == s.landing_budget([t - 1 for t in s.stack.n_tokens])
        assert e.bytes_used <= e.budget and not e.over_budget
        assert s.budget_bytes() < e.budget  # the longer sequence's own budget is less
