"""Stores without rows routed together (:class:`~tiered_radix.engine.stacked.StackedMoves`: one
set of ops for all) decide and record exactly what each decides routed alone: tiers, ledger
copies, transitions, bytes and over-budget flags, over mixed lengths, budgets and policies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_store import FILES, RULES, signals

from tiered_radix import load_policy
from tiered_radix.engine import pending as pending_mod
from tiered_radix.engine import planner
from tiered_radix.engine.pending import PendingRoutes
from tiered_radix.engine.stacked import StackedMoves
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.compiler import compile_text
from tiered_radix.policy.model import Budget

L, H, D = 2, 2, 32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _policy(name: str):
    return compile_text(RULES[name]) if name in RULES else load_policy(name)


COUPLED = [n for n in (*(str(p) for p in FILES), *RULES) if _policy(n).coupled]


def _rows(seed: int, t: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, t, D, generator=g), torch.randn(L, H, t, D, generator=g)


class Request:
    """One sequence: a store without rows (as the SGLang pool's) over fixed random K/V."""

    def __init__(self, policy, budget: float, t_max: int, seed: int, device: str = "cpu"):
        self.k, self.v = (x.to(device) for x in _rows(seed, t_max))
        self.device = device
        self.store = TierStore(
            policy, n_layers=L, n_heads=H, head_dim=D, dtype=torch.float32, device=device,
            budget_override=Budget("fraction", budget), reader=self.read,
        )  # fmt: skip

    def read(self, li: int):
        t = self.store.n_tokens(li)
        kept = torch.ones(H, t, dtype=torch.bool, device=self.device)
        return self.k[li, :, :t], self.v[li, :, :t], kept

    def feed(self, n: int, g: torch.Generator, prefill: bool) -> None:
        self.store.append_tokens(None, n)
        for li in range(L):
            t = self.store.n_tokens(li)
            sig = signals(g, torch.ones(H, t, dtype=torch.bool), D, prefill)
            moved = {f.name: getattr(sig, f.name) for f in dataclasses.fields(sig)}
            moved = {n: x.to(self.device) for n, x in moved.items() if x is not None}
            self.store.observe(li, dataclasses.replace(sig, **moved))


def _requests(specs, seed: int, device: str = "cpu") -> list[Request]:
    """``specs``: (policy name, budget fraction, prompt tokens) per request."""
    pols = {n: _policy(n) for n, _, _ in specs}  # one policy object per name, as a server's
    return [Request(pols[n], b, t + 64, seed + i, device) for i, (n, b, t) in enumerate(specs)]


def _state(s: TierStore) -> list[torch.Tensor]:
    st = s.stack
    copies = [x for c in st.stores.values() for x in (c.present, c.write_count)]
    return [st.tier, *copies]


def _drive(specs, steps: int = 40, every: int = 8, device: str = "cpu"):
    """The same requests twice: one set routed together, one each alone; compared after each
    routing."""
    together, alone = _requests(specs, 11, device), _requests(specs, 11, device)
    gs = [torch.Generator().manual_seed(5) for _ in range(2)]
    stacked = 0
    for step in range(-1, steps):
        for reqs, g in zip((together, alone), gs, strict=True):
            for r, (_, _, t) in zip(reqs, specs, strict=True):
                r.feed(t if step < 0 else 1, g, step < 0)
        if step >= 0 and (step + 1) % every:
            continue
        why = "after_prefill" if step < 0 else f"step {step}"
        pending = TierStore.begin_routes([r.store for r in together], [why] * len(specs))
        stacked += sum(len(idx) for idx, m in pending.movers if isinstance(m, StackedMoves))
        got = pending.land()
        want = [r.store.route(why) for r in alone]
        for a, b, ra, rb in zip(got, want, together, alone, strict=True):
            assert list(a) == list(b)
            assert (a.promoted, a.written) == (b.promoted, b.written)
            ea, eb = ra.store.events.steps[-1], rb.store.events.steps[-1]
            assert (ea.bytes_used, ea.over_budget) == (eb.bytes_used, eb.over_budget)
            assert ra.store.bytes_used() == rb.store.bytes_used()
            for x, y in zip(_state(ra.store), _state(rb.store), strict=True):
                assert torch.equal(x, y)
    return together, stacked


@pytest.mark.parametrize("name", COUPLED, ids=[Path(n).stem for n in COUPLED])
def test_stores_moved_together_equal_each_alone(name):
    """Requests of one policy at different lengths and budgets move in one StackedMoves and
    end where each ends routed alone."""
    specs = [(name, 0.3, 100), (name, 0.5, 164), (name, 0.2, 37), (name, 0.3, 300)]
    reqs, stacked = _drive(specs)
    assert stacked > 0
    if len(reqs[0].store.tier_names) > 1:  # something moved
        assert any(len(ev.transitions) for r in reqs for ev in r.store.events.steps)


@pytest.mark.parametrize("name", ["h2o", "qevict"])
def test_stores_planned_in_bounded_passes_equal_each_alone(name, monkeypatch):
    """Many long requests routed at one step are planned in passes of like lengths, each
    pass's allocator tables within ``planner._RANK_TABLE_BYTES`` (GPU run 33: one pass over a
    server's token-unit requests ran it out of memory); every request still ends where it
    ends routed alone, and every pass stays within the bound."""
    lengths = [300, 40, 410, 96, 64, 350, 128, 200]
    specs = [(name, 0.3, t) for t in lengths]
    reqs = _requests(specs, 5)
    for r, t in zip(reqs, lengths, strict=True):
        r.feed(t, torch.Generator().manual_seed(1), True)
    stores = [r.store for r in reqs]
    s0 = stores[0]
    per_unit = s0.n_layers * s0.n_heads * len(s0.tier_set.names) * 8
    longest = max(s.stack.n_units(0) for s in stores)
    monkeypatch.setattr(planner, "_RANK_TABLE_BYTES", 3 * per_unit * longest)
    passes = planner._rank_passes(stores)
    assert sorted(i for part in passes for i in part) == list(range(len(stores)))
    assert 1 < len(passes) < len(stores)
    for part in passes:
        units = [stores[i].stack.n_units(0) for i in part]
        assert units == sorted(units)  # like lengths together, the last the longest
        assert len(part) == 1 or len(part) * per_unit * units[-1] <= planner._RANK_TABLE_BYTES
    _drive(specs)


def test_large_groups_move_in_bounded_parts_equal_each_alone(monkeypatch):
    """A group of stores moving together moves in parts of at most ``pending._MOVE_SLOTS``
    unit slots, in order (its masks cover every slot at once: 32 long token-unit requests in
    one part peaked at ~1.8 GiB of one routing's moves); every request still ends where it ends
    routed alone."""
    lengths = [300, 40, 410, 96, 64, 350, 128, 200]
    specs = [("h2o", 0.3, t) for t in lengths]
    reqs = _requests(specs, 5)
    for r, t in zip(reqs, lengths, strict=True):
        r.feed(t, torch.Generator().manual_seed(1), True)
    stacks = [r.store.stack for r in reqs]
    s0 = stacks[0]
    bound = 3 * s0.n_layers * s0.n_heads * max(s.capacity for s in stacks)
    monkeypatch.setattr(pending_mod, "_MOVE_SLOTS", bound)
    parts = pending_mod.move_parts(stacks)
    assert [i for part in parts for i in part] == list(range(len(stacks)))
    assert 1 < len(parts) < len(stacks)
    for part in parts:
        slots = sum(s0.n_layers * s0.n_heads * stacks[i].capacity for i in part)
        assert len(part) == 1 or slots <= bound
    _, stacked = _drive(specs)
    assert stacked > 0


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_policies_group_by_tier_set(device):
    """Per-request policies loaded together (as ``kv_policy`` gives them): each tier set moves
    in its own group (here qevict's and kivi's requests stacked, h2o's one request alone), and
    every request ends where it ends alone."""
    specs = [
        ("qevict", 0.6, 200), ("kivi", 0.4, 150), ("qevict", 0.3, 90), ("h2o", 0.5, 120),
        ("kivi", 0.3, 260), ("qevict", 0.6, 410),
    ]  # fmt: skip
    reqs = _requests(specs, 3, device)
    for r, (_, _, t) in zip(reqs, specs, strict=True):
        r.feed(t, torch.Generator().manual_seed(1), True)
    pending = TierStore.begin_routes([r.store for r in reqs], ["x"] * len(specs))
    groups = sorted((idx, type(m).__name__) for idx, m in pending.movers)
    assert groups == [([0, 2, 5], "StackedMoves"), ([1, 4], "StackedMoves"), ([3], "PendingMove")]
    pending.land()
    _drive(specs, device=device)


def test_a_dropped_store_in_a_stacked_move_keeps_its_state():
    """PendingRoutes.drop of a store moving with others: its tiers, copies and step count stay;
    the others land as routed alone."""
    specs = [("qevict", 0.6, 320), ("qevict", 0.6, 256), ("qevict", 0.6, 288)]
    kept, alone = _requests(specs, 2), _requests(specs, 2)
    for reqs in (kept, alone):
        g = torch.Generator().manual_seed(4)
        for r, (_, _, t) in zip(reqs, specs, strict=True):
            r.feed(t, g, True)
    before = [x.clone() for x in _state(kept[1].store)]
    pending = PendingRoutes.begin(
        [r.store for r in kept],
        dict(enumerate(TierStore.plan(r.store) for r in kept)),
        ["a", "b", "c"],
        {},
    )
    assert isinstance(pending.movers[0][1], StackedMoves)
    pending.drop(1)
    landed = pending.land()
    want = [alone[0].store.route("a"), alone[2].store.route("c")]
    assert len(landed) == 2 and all(list(x) == list(y) for x, y in zip(landed, want, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(_state(kept[1].store), before, strict=True))
    assert kept[1].store.step == 0 and kept[0].store.step == kept[2].store.step == 1
    assert len(want[0]) > 0 and len(want[1]) > 0  # the routings move units


@pytest.mark.parametrize("device", DEVICES)
def test_settle_many_equals_each_store_settled(device):
    """Units a rows' holder left elsewhere than planned, settled for several stores at once
    (one pass), end as each store's own settle() leaves them: tiers, copies, over flags."""
    specs = [("qevict", 0.5, 400), ("qevict", 0.6, 300), ("qevict", 0.5, 530)]
    many, each = _requests(specs, 6, device), _requests(specs, 6, device)
    for reqs in (many, each):
        g = torch.Generator().manual_seed(2)
        for r, (_, _, t) in zip(reqs, specs, strict=True):
            r.feed(t, g, True)
        TierStore.route_many([r.store for r in reqs], ["x"] * len(specs))
    assert not any(r.store.events.steps[-1].over_budget for r in many)  # before settling
    g = torch.Generator().manual_seed(9)
    units = []
    for r in many:
        u = torch.randperm(r.store.stack.n_units(0) - 1, generator=g)[:40]  # distinct units
        n = u.numel()
        ly, h = torch.randint(L, (n,), generator=g), torch.randint(H, (n,), generator=g)
        tier = torch.randint(len(r.store.tier_names), (n,), generator=g)
        copy, where = torch.rand(n, generator=g) < 0.5, torch.rand(n, generator=g) < 0.7
        units.append(tuple(x.to(device) for x in (ly, h, u, tier, copy, where)))
    TierStore.settle_many([r.store for r in many], units)
    for r, u in zip(each, units, strict=True):
        r.store.settle(*u)
    for a, b in zip(many, each, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(_state(a.store), _state(b.store), strict=True))
        ea, eb = a.store.events.steps[-1], b.store.events.steps[-1]
        assert ea.over_budget == eb.over_budget and a.store.bytes_used() == b.store.bytes_used()
    assert any(r.store.events.steps[-1].over_budget for r in many)  # some unit stayed above


def _k_state(s: TierStore) -> list[torch.Tensor]:
    """A decoupled store's K per layer: its set, channel tiers and set counts."""
    return [x for lay in s.layers if lay.k is not None
            for x in (lay.k.in_set, lay.k.tier, lay.k.n_set)]  # fmt: skip


@pytest.mark.parametrize("appended", [1, 40])
def test_a_routing_landing_after_new_tokens_equals_it_landed_before_them(appended):
    """Under SGLang's overlap scheduler a decode step's routing lands at the next step, after
    that step's token was appended. GPU run 18 crashed there where the stack grew in between
    (qevict at 30K: 938 -> 1,876 units) and where rdkv's K set was planned one token short
    (4,097 of 4,098). Landed late, every store ends as if it landed first and the tokens came
    after: transitions, tiers, copies, K sets, bytes (stacked stores, one alone, rdkv)."""
    specs = [("qevict", 0.3, 352), ("qevict", 0.3, 416), ("qevict", 0.4, 299), ("h2o", 0.3, 256),
             ("rdkv", 0.5, 128)]  # fmt: skip
    late, serial = _requests(specs, 7), _requests(specs, 7)
    for reqs in (late, serial):
        g = torch.Generator().manual_seed(3)
        for r, (_, _, t) in zip(reqs, specs, strict=True):
            r.feed(t, g, True)
    caps = [r.store.stack.capacity for r in late]
    pending = TierStore.begin_routes([r.store for r in late], ["x"] * len(specs))
    assert any(isinstance(m, StackedMoves) for _, m in pending.movers)
    for r in late:
        r.store.append_tokens(None, appended)
    got = pending.land()
    want = [r.store.route("x") for r in serial]
    for r in serial:
        r.store.append_tokens(None, appended)
    grown = [r.store.stack.capacity > c for r, c in zip(late, caps, strict=True)]
    assert grown[0] and grown[1] and grown[-1]  # windows of 32 full, rdkv's tokens
    for a, b, ra, rb in zip(got, want, late, serial, strict=True):
        assert list(a) == list(b)
        assert (a.promoted, a.written) == (b.promoted, b.written)
        assert ra.store.bytes_used() == rb.store.bytes_used()
        for x, y in zip(_state(ra.store) + _k_state(ra.store),
                        _state(rb.store) + _k_state(rb.store), strict=True):  # fmt: skip
            assert torch.equal(x, y)
    assert _k_state(late[-1].store)  # rdkv's K was compared
    assert [len(b) > 0 for b in want] == [True] * len(specs), [len(b) for b in want]
