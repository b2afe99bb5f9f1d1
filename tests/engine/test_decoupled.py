"""ChannelK's stacked start (:meth:`ChannelK.layers`), every layer's count at once
(:meth:`ChannelK.count_layers`) and routing at once (:meth:`ChannelK.apply_layers`) against one
layer at a time."""

from __future__ import annotations

import torch

from tiered_radix import load_policy
from tiered_radix.engine.decoupled import ChannelK
from tiered_radix.engine.routing import TierSet

L, H, D = 3, 2, 8


def _make(stacked: bool, keep_data: bool = False) -> list[ChannelK]:
    policy = load_policy("rdkv")
    ts = TierSet.of(policy)
    bits = [0] * ts.offset + list(policy.allocate.bits)
    kw = dict(tiers=ts, bits=bits, group=policy.allocate.group, n_heads=H, head_dim=D,
              dtype=torch.float32, device=torch.device("cpu"), keep_data=keep_data)  # fmt: skip
    return ChannelK.layers(L, **kw) if stacked else [ChannelK(**kw) for _ in range(L)]


def _state(k: ChannelK) -> tuple:
    return k.n_tokens, k.in_set.clone(), k.tier.clone(), k.n_set.clone(), k.index.shape


def test_count_layers_equals_appends_layer_by_layer():
    g = torch.Generator().manual_seed(0)
    stacked, apart = _make(True), _make(False)
    n_tiers = len(stacked[0].tiers.names)
    for n, route in [(5, False), (3, False), (9, True), (1, False), (40, True), (2, False)]:
        ChannelK.count_layers(stacked, n)
        for k in apart:
            k.append(None, n)
        if route:  # a routing's new set and channel tiers, the same on both sides
            t = stacked[0].n_tokens
            for a, b in zip(stacked, apart, strict=True):
                new_set = torch.rand(H, t, generator=g) < 0.5
                tier = torch.randint(0, n_tiers, (H, D), generator=g)
                v_tier = torch.randint(0, n_tiers, (H, t), generator=g)
                kept = torch.ones(H, t, dtype=torch.bool)
                a.apply(tier, new_set, kept, v_tier)
                b.apply(tier, new_set, kept, v_tier)
        for a, b in zip(stacked, apart, strict=True):
            sa, sb = _state(a), _state(b)
            assert sa[0] == sb[0] and sa[4] == sb[4]
            assert all(torch.equal(x, y) for x, y in zip(sa[1:4], sb[1:4], strict=True))


def test_stacked_layers_start_full_and_apart():
    ks = _make(True)
    assert all(k.n_tokens == 0 and not k.tier.any() and not k.n_set.any() for k in ks)
    ks[0].tier[0, 0] = 3  # views of one buffer, one layer each
    assert not any(k.tier.any() for k in ks[1:])
    ChannelK.count_layers(ks, 4)
    assert all(k.in_set.shape == (H, 4) and not k.in_set.any() for k in ks)


def test_count_layers_with_rows_falls_back_to_append():
    ks = _make(True, keep_data=True)
    for k in ks:
        k.append(torch.randn(H, 3, D))
    assert [k.n_tokens for k in ks] == [3] * L


def test_apply_layers_equals_apply_layer_by_layer():
    """A routing's counts, channel tiers and sets over the stacked layers (no host sync) equal
    each layer's :meth:`ChannelK.apply`, also where tokens arrived after the plan (a late
    landing: the set covers fewer tokens than the layers hold) and the decode steps after it."""
    g = torch.Generator().manual_seed(1)
    together, apart = _make(True), _make(False)
    n_tiers = len(together[0].tiers.names)
    for n, late in [(30, 0), (1, 1), (7, 0), (2, 2)]:
        ChannelK.count_layers(together, n)
        for k in apart:
            k.append(None, n)
        t = together[0].n_tokens - late  # the plan's tokens
        sets = [torch.rand(H, t, generator=g) < 0.5 for _ in range(L)]
        tiers = [torch.randint(0, n_tiers, (H, D), generator=g) for _ in range(L)]
        v_tier = torch.randint(-1, n_tiers, (L, H, t + 3), generator=g)  # wider: units of U
        assert ChannelK.apply_layers(together, tiers, sets, v_tier)
        for li, k in enumerate(apart):
            k.apply(tiers[li], sets[li], torch.ones(H, t, dtype=torch.bool), v_tier[li])
        ChannelK.count_layers(together, 3)
        for k in apart:
            k.append(None, 3)
        for a, b in zip(together, apart, strict=True):
            sa, sb = _state(a), _state(b)
            assert sa[0] == sb[0]
            assert all(torch.equal(x, y) for x, y in zip(sa[1:4], sb[1:4], strict=True))
    assert any(k.n_set.any() for k in together)


def test_apply_layers_leaves_layers_with_rows_to_apply():
    ks = _make(True, keep_data=True)
    sets = [torch.ones(H, 0, dtype=torch.bool)] * L
    tiers = [torch.zeros(H, D, dtype=torch.long)] * L
    assert not ChannelK.apply_layers(ks, tiers, sets, torch.zeros(L, H, 0, dtype=torch.long))
    assert not ChannelK.apply_layers([], [], [], torch.zeros(0, H, 0, dtype=torch.long))
