"""A TierStore without its own rows (``reader=``, as the SGLang pool uses it) decides exactly
what a store holding the rows decides, for every shipped policy (RDKV's too: its channel set
and K tiers without codes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_store import FILES, signals

from tiered_radix import load_policy
from tiered_radix.engine.signals import Signals
from tiered_radix.engine.store import TierStore

COUPLED = [p for p in FILES if load_policy(str(p)).coupled]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_reader_store_routes_like_the_data_store(path):
    policy = load_policy(str(path))
    L, H, d, T, steps = 2, 2, 16, 150, 40
    g = torch.Generator().manual_seed(3)
    k = torch.randn(L, H, T + steps, d, generator=g)
    v = torch.randn(L, H, T + steps, d, generator=g)
    full = TierStore(policy, n_layers=L, n_heads=H, head_dim=d, dtype=torch.float32)
    bare = TierStore(
        policy, n_layers=L, n_heads=H, head_dim=d, dtype=torch.float32, reader=full.view
    )
    assert bare.stack.full == {} and all(not s.data for s in bare.stack.stores.values())
    assert all(lay.k is None or lay.k.k_full.numel() == 0 for lay in bare.layers)
    # counts every layer's new tokens in one call (the SGLang backend's way)
    every = TierStore(
        policy, n_layers=L, n_heads=H, head_dim=d, dtype=torch.float32, reader=full.view
    )

    def feed(t0: int, t1: int, prefill: bool) -> None:
        every.append_tokens(None, t1 - t0)
        for li in range(L):
            full.append(li, k[li, :, t0:t1], v[li, :, t0:t1])
            bare.append_tokens(li, t1 - t0)
            _, _, kept = full.view(li)
            sig = signals(torch.Generator().manual_seed(t1 * 7 + li), kept, d, prefill)
            full.observe(li, sig)
            bare.observe(li, sig)
            every.observe(li, sig)

    # the stores without rows plan first: they read the rows as they are before this routing
    # (a decoupled plan reads them: K norms, spreads), as the pool holds them
    feed(0, T, True)
    every.after_prefill()
    b = bare.after_prefill()
    pairs = [(full.after_prefill(), b)]
    for step in range(steps):
        feed(T + step, T + step + 1, False)
        if full.schedule_due(step):
            every.route(f"step {step}")
            b = bare.route(f"step {step}")
            pairs.append((full.route(f"step {step}"), b))
    for a, b in pairs:
        if a is None:
            assert b is None
            continue
        for name in ("layer", "head", "unit", "src", "dst", "ledger_write"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    for li in range(L):
        assert torch.equal(full.tiers(li), bare.tiers(li))
        assert torch.equal(full.tiers(li), every.tiers(li))
        if not policy.coupled:  # the channel tiers and set, and no codes
            for x, y in zip(full.channel_tiers(li), bare.channel_tiers(li), strict=True):
                assert torch.equal(x, y)
            assert not bare.layers[li].k.codes
    assert full.bytes_used() == bare.bytes_used() and full.occupancy() == bare.occupancy()
    assert every.stack.n_tokens == bare.stack.n_tokens == [T + steps] * L
    if len(policy.tiers) > 1:  # something moved
        assert sum(len(a) for a, _ in pairs if a is not None) > 0


def prefilled_pair(policy, L: int, H: int, d: int, T: int, steps: int, seed: int):
    """Two stores holding the same ``T``-token prompt after prefill (its signals observed, routed),
    the generator for what follows, and ``grow(t)``: both append token ``t - 1``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, T + steps, d, generator=g)
    v = torch.randn(L, H, T + steps, d, generator=g)
    stores = [TierStore(policy, n_layers=L, n_heads=H, head_dim=d, dtype=torch.float32)
              for _ in range(2)]  # fmt: skip
    for s in stores:
        for li in range(L):
            s.append(li, k[li, :, :T], v[li, :, :T])
            s.observe(li, signals(torch.Generator().manual_seed(li), s.view(li)[2], d, True))
        s.after_prefill()

    def grow(t: int) -> None:
        for s in stores:
            for li in range(L):
                s.append(li, k[li, :, t - 1 : t], v[li, :, t - 1 : t])

    return g, stores, grow


@pytest.mark.parametrize("path", COUPLED, ids=lambda p: p.stem)
def test_observe_attn_of_all_layers_equals_per_layer_observe(path):
    """One decode step's attention for every layer at once (the SGLang decode path) advances
    scores exactly as one observe per layer does."""
    L, H, d, T = 3, 2, 16, 120
    g, stores, grow = prefilled_pair(load_policy(str(path)), L, H, d, T, 20, seed=5)
    for step in range(20):
        t = T + step + 1
        attn = torch.rand(L, H, t, generator=g)
        grow(t)
        for li in range(L):
            stores[0].observe(li, Signals(attn=attn[li]))
        stores[1].observe_attn(attn)
        if stores[0].schedule_due(step):
            for s in stores:
                s.route(f"step {step}")
    for li in range(L):
        assert torch.equal(stores[0].tiers(li), stores[1].tiers(li))
    for node, buf in stores[0].scores._state.items():
        assert torch.equal(buf, stores[1].scores._state[node])


@pytest.mark.parametrize("path", COUPLED, ids=lambda p: p.stem)
def test_folded_decode_attention_routes_like_one_observe_per_step(path):
    """Where the policy allows it (``attn_decay``), decode attention summed over the steps
    between routings and folded in before each routing decides the same tiers as observing
    every step."""
    policy = load_policy(str(path))
    L, H, d, T = 2, 2, 16, 120
    decay = TierStore(policy, n_layers=L, n_heads=H, head_dim=d).attn_decay()
    if decay is None:
        with pytest.raises(Exception, match="cannot be folded"):
            TierStore(policy, n_layers=L, n_heads=H, head_dim=d).fold_attn(torch.zeros(L, H, 0), 1)
        return
    g, stores, grow = prefilled_pair(policy, L, H, d, T, 40, seed=7)
    acc, pending = None, 0
    for step in range(40):
        t = T + step + 1
        attn = torch.rand(L, H, t, generator=g)
        grow(t)
        stores[0].observe_attn(attn)
        acc = attn if acc is None else torch.nn.functional.pad(acc, (0, 1)) * decay + attn
        pending += 1
        if stores[0].schedule_due(step):
            stores[1].fold_attn(acc, pending)
            acc, pending = None, 0
            for s in stores:
                s.route(f"step {step}")
    assert stores[0].events.steps and len(stores[0].events.steps) == len(stores[1].events.steps)
    for li in range(L):
        assert torch.equal(stores[0].tiers(li), stores[1].tiers(li))


def test_settle_puts_units_where_the_rows_holder_left_them():
    """Units the holder of the rows could not quantize (out of ledger blocks) and evicted
    instead: ``settle`` gives them that tier and no copy, the bytes drop by their copies, and
    one left at full precision marks the step over budget. (qevict as it routed before issue
    18: right after prefill, on the last query's attention alone.)"""
    policy = load_policy(Path(__file__).parents[2] / "examples" / "qevict_v1.yaml")
    L, H, d, T = 1, 2, 64, 32 * 40
    store = TierStore(policy, n_layers=L, n_heads=H, head_dim=d, reader=lambda li: None)
    store.append_tokens(None, T)
    g = torch.Generator().manual_seed(0)
    store.observe(0, Signals(attn=torch.rand(H, T, generator=g)))
    store.after_prefill()
    ts = store.tier_set
    q = (store.tiers(0) == ts.first_quantized).nonzero()[:3]
    assert len(q) == 3 and not store.events.steps[-1].over_budget
    before = store.bytes_used()
    ly, h, u = torch.zeros(3, dtype=torch.long), q[:, 0], q[:, 1]
    store.settle(ly[:2], h[:2], u[:2], torch.full((2,), ts.evict), torch.zeros(2, dtype=torch.bool))
    assert (store.tiers(0)[h[:2], u[:2]] == ts.evict).all()
    unit = store.stack.stores[ts.first_quantized].unit_nbytes
    assert store.bytes_used() == before - 2 * unit
    assert not store.events.steps[-1].over_budget
    store.settle(
        ly[2:], h[2:], u[2:], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool)
    )
    assert store.tiers(0)[h[2], u[2]] == 0 and store.events.steps[-1].over_budget


def test_seeded_states_are_the_store_own():
    """``seed_states`` (a prefix lent by a radix cache at its holders' states): the store reads
    back the seeded tiers, counts the seeded bytes (a quantized unit with its ledger copy costs
    less than a full one) and routes from them (its next plan sees them as placed)."""
    policy = load_policy("qevict")
    L, H, d, W = 2, 2, 16, 32
    full = TierStore(policy, n_layers=L, n_heads=H, head_dim=d, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    for li in range(L):
        full.append(
            li, torch.randn(H, 8 * W, d, generator=g), torch.randn(H, 8 * W, d, generator=g)
        )
    store = TierStore(
        policy, n_layers=L, n_heads=H, head_dim=d, dtype=torch.float32, reader=full.view
    )
    store.append_tokens(None, 8 * W)
    before = store.bytes_used()
    q = store.tier_set.names.index("int2")
    tier = torch.zeros(L, H, 8, dtype=torch.long)
    tier[:, :, 2:6] = q  # four windows quantized, written once
    store.seed_states(tier, tier == q)
    for li in range(L):
        assert torch.equal(store.tiers(li), tier[li])
    assert store.bytes_used() < before
    assert store.stack.routed_units == [8] * L
