"""Unit layouts against brute-force loops over tokens."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_radix.engine.units import UnitLayout
from tiered_radix.policy.model import Granularity, Protect


@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 9), t=st.integers(1, 40), h=st.integers(1, 3), seed=st.integers(0, 99))
def test_aggregate_and_expand_match_loops(w, t, h, seed):
    lay = UnitLayout.of(Granularity("window", w) if w > 1 else Granularity("token"), 8)
    x = torch.rand(h, t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    u = -(-t // w)
    assert lay.n_units(t) == u and lay.n_complete(t) == t // w
    xs = x.numpy()
    for how, fn in (("sum", np.sum), ("mean", np.mean), ("max", np.max)):
        want = np.stack([fn(xs[:, i * w : (i + 1) * w], axis=1) for i in range(u)], 1)
        np.testing.assert_allclose(lay.aggregate(x, how).numpy(), want, rtol=1e-12)
    per_unit = torch.arange(u, dtype=torch.float64)[None].expand(h, u)
    np.testing.assert_array_equal(lay.expand(per_unit, t).numpy()[0], np.arange(t) // w)
    assert lay.first_token(t).tolist() == [i * w for i in range(u)]
    assert lay.last_token(t).tolist() == [min((i + 1) * w, t) - 1 for i in range(u)]


@settings(max_examples=60, deadline=None)
@given(
    w=st.integers(1, 9), t=st.integers(1, 60), sinks=st.integers(0, 10), recent=st.integers(0, 20)
)
def test_protected_units(w, t, sinks, recent):
    lay = UnitLayout("window" if w > 1 else "token", w, 8)
    got = lay.protected(t, Protect(sinks, recent)).tolist()
    want = []
    for i in range(-(-t // w)):
        toks = range(i * w, min((i + 1) * w, t))
        want.append(any(k < sinks or k >= t - recent for k in toks) or len(toks) < w)
    assert got == want


def test_channel_layout():
    lay = UnitLayout.of(Granularity("channel"), 16)
    assert lay.n_units(100) == 16 and not lay.over_tokens
    assert not lay.protected(100, Protect(4, 4)).any()


def test_rows_cut_complete_units():
    lay = UnitLayout("window", 4, 3)
    x = torch.arange(2 * 10 * 3).reshape(2, 10, 3)
    r = lay.rows(x, 2)
    assert r.shape == (2, 2, 4, 3)
    assert torch.equal(r[1, 1, 2], x[1, 6])
