"""ChannelK's stacked start (:meth:`ChannelK.layers`) and every layer's count at once
(:meth:`ChannelK.count_layers`) against one layer at a time."""

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
