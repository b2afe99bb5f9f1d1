"""``after_prefill(defer=true)``: the routing due after a prefill chunk waits for the next decode
step (``TierStore.defer``), so it runs once after the whole prompt, its question read."""

from __future__ import annotations

import torch

from tiered_radix.engine.signals import Signals
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.compiler import compile_text

POLICY = """
budget: 10%
units: window(size=8)
protect: {{sinks: 4, recent: 8}}
scores:
  score: cumulative(attn, decay=0.99) + obs_attn
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=8)
  evicted: evict
allocate: {{method: rank, by: score, shares: {{full: 50%, int2: 50%}}}}
schedule: {schedule}
ledger: write_once
"""
L, H, D = 2, 2, 16


def _chunk(store: TierStore, g: torch.Generator, n: int, hot: slice | None = None) -> None:
    """Append ``n`` prompt tokens to every layer and observe a prefill chunk's signals; with
    ``hot``, the observation window attends to those tokens (a question naming a fact)."""
    for li in range(L):
        store.append(li, torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g))
        t = store.n_tokens(li)
        attn = torch.rand(H, t, generator=g) * store.view(li)[2]
        obs = torch.rand(H, t, generator=g) * 0.01
        if hot is not None:
            obs[:, hot] = 10.0
        store.observe(li, Signals(attn=attn / attn.sum(1, keepdim=True), obs_attn=obs))


def _decode(store: TierStore, g: torch.Generator) -> None:
    for li in range(L):
        store.append(li, torch.randn(H, 1, D, generator=g), torch.randn(H, 1, D, generator=g))
        attn = torch.rand(H, store.n_tokens(li), generator=g) * store.view(li)[2]
        store.observe(li, Signals(attn=attn / attn.sum(1, keepdim=True)))


def _store(schedule: str) -> TierStore:
    policy = compile_text(POLICY.format(schedule=schedule))
    return TierStore(policy, n_layers=L, n_heads=H, head_dim=D, dtype=torch.float32)


def _kept(store: TierStore, tokens: slice) -> bool:
    return all(bool(store.view(li)[2][:, tokens].all()) for li in range(L))


def test_a_fact_evicted_mid_prompt_survives_until_the_question_under_deferral():
    """Chunks 1-3 are prose that attention ignores, the fact sits in chunk 1; chunk 4's
    question attends to it. Routing after every chunk evicts it before the question comes;
    deferred, it stays at full precision until the question, then the first decode step's
    routing keeps it at full precision."""
    fact = slice(40, 48)
    results = {}
    for schedule in ("after_prefill, every(16)", "after_prefill(defer=true), every(16)"):
        g = torch.Generator().manual_seed(0)
        store = _store(schedule)
        for _ in range(3):
            _chunk(store, g, 128)
            store.after_prefill("chunk")
        evicted_mid_prompt = not _kept(store, fact)
        _chunk(store, g, 32, hot=fact)
        store.after_prefill("last chunk")
        _decode(store, g)
        if store.schedule_due(0):
            store.route("decode 0")
        over = [s.over_budget for s in store.events.steps]
        full = all(bool((store.stack.tier[li, :, 5] == 0).all()) for li in range(L))  # 40-47
        results[schedule] = (evicted_mid_prompt, _kept(store, fact) and full, over, store)
    # routing after every chunk: the fact is gone before the question is seen
    evicted, kept, over, store = results["after_prefill, every(16)"]
    assert evicted and not kept
    assert store.deferred is False
    # deferred: nothing moves during the prompt; one routing, at the first decode step, which
    # keeps the fact at full precision and meets the budget
    evicted, kept, over, store = results["after_prefill(defer=true), every(16)"]
    assert not evicted and kept
    assert over == [False] and [s.reason for s in store.events.steps] == ["decode 0"]
    assert store.bytes_used() <= store.budget_bytes()
    assert store.occupancy()["evicted"] > 0 and store.deferred is False


def test_deferral_asks_for_a_routing_at_the_next_decode_step_only():
    g = torch.Generator().manual_seed(1)
    store = _store("after_prefill(defer=true), every(16)")
    _chunk(store, g, 96)
    assert not store.schedule_due(0)
    moves = store.after_prefill()
    assert moves is not None and len(moves) == 0 and not store.events.steps
    assert store.deferred and store.schedule_due(0) and store.occupancy()["evicted"] == 0
    _decode(store, g)
    store.route("decode 0")
    assert not store.schedule_due(1) and store.schedule_due(15)


def test_route_many_defers_only_after_prefill():
    g = torch.Generator().manual_seed(2)
    stores = [_store("after_prefill(defer=true), every(16)") for _ in range(2)]
    for s in stores:
        _chunk(s, g, 96)
    moves = TierStore.route_many(stores, ["a", "b"], prefill=True)
    assert [len(m) for m in moves] == [0, 0]
    untouched = {"full": L * H * 12, "int2": 0, "evicted": 0}
    assert all(s.deferred and s.occupancy() == untouched for s in stores)
    for s in stores:
        _decode(s, g)
    TierStore.route_many(stores, ["a", "b"])
    assert all(not s.deferred and s.occupancy()["evicted"] > 0 for s in stores)
