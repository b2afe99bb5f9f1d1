"""Trace file format: round trip, validation messages, prefill stats, synthetic structure."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tiered_radix.sim.trace import (
    FORMAT_VERSION,
    OBS_WINDOW,
    Trace,
    TraceError,
    prefill_stats,
    synthetic_trace,
)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return synthetic_trace(7)


def _decode_probs(tr: Trace, li: int, s: int) -> np.ndarray:
    """float64 softmax of decode step ``s``: ``[H_q, prompt_len + s + 1]``."""
    m = tr.meta
    q = tr.q[li][s].astype(np.float64)  # [H_q, d]
    k = tr.k[li][:, : m.prompt_len + s + 1].astype(np.float64)  # [H_kv, L, d]
    k = np.repeat(k, m.group, axis=0)
    logits = np.einsum("hd,htd->ht", q, k) * m.sm_scale
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


def test_round_trip(trace, tmp_path):
    path = trace.save(tmp_path / "t.npz")
    back = Trace.load(path)
    assert back.meta == trace.meta
    for name in ("k", "v", "q", "colmass", "qnorm", "obs_attn"):
        for a, b in zip(getattr(trace, name), getattr(back, name), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    with np.load(path, allow_pickle=False) as z:
        assert json.loads(str(z["meta"]))["version"] == FORMAT_VERSION


def _dense_probs(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """float64 causal softmax of a whole prefill: ``[H_q, P, P]`` (row = query, col = key)."""
    p, hq, _ = q.shape
    g = hq // k.shape[1]
    out = np.zeros((hq, p, p))
    for h in range(hq):
        s = q[:, h].astype(np.float64) @ k[:, h // g].astype(np.float64).T * scale
        s[np.triu_indices(p, 1)] = -np.inf
        e = np.exp(s - s.max(axis=1, keepdims=True))
        out[h] = e / e.sum(axis=1, keepdims=True)
    return out


@pytest.mark.parametrize("p, window", [(37, OBS_WINDOW), (37, 5), (20, OBS_WINDOW), (1, 3)])
def test_prefill_stats_match_dense_float64(p, window):
    rng = np.random.default_rng(p + window)
    hq, hkv, d, scale = 6, 2, 8, 0.9
    q = rng.standard_normal((p, hq, d)).astype(np.float32)
    k = rng.standard_normal((p, hkv, d)).astype(np.float32)
    stats = prefill_stats(q, k, scale, obs_window=window)
    g = hq // hkv
    probs = _dense_probs(q, k, scale).reshape(hkv, g, p, p)
    np.testing.assert_allclose(stats.colmass, probs.sum(axis=(1, 2)), rtol=1e-5, atol=1e-6)
    rows = probs[:, :, max(0, p - window) :]  # the last `window` query rows (all when P <= it)
    np.testing.assert_allclose(stats.obs_attn, rows.sum(axis=(1, 2)), rtol=1e-5, atol=1e-6)
    assert stats.obs_attn.sum() == pytest.approx(hq * min(p, window), rel=1e-5)
    if p > window:  # the data tells the window from the whole prompt
        assert not np.allclose(stats.obs_attn, stats.colmass, rtol=1e-2)
    qn = np.sqrt((q.astype(np.float64) ** 2).reshape(p, hkv, g, d).sum(axis=(0, 2)))
    np.testing.assert_allclose(stats.qnorm, qn, rtol=1e-5)


def test_prefill_stats_chunks_rows_never_a_full_matrix(monkeypatch):
    """The observation window runs through the row-chunked column mass, 32 rows at a time."""
    from tiered_radix.kernels import colmass_ref

    seen = []
    real = colmass_ref.column_mass_ref

    def spy(q, k, **kw):
        seen.append((q.shape[0], k.shape[0], kw["q_offset"]))
        return real(q, k, **kw)

    monkeypatch.setattr(colmass_ref, "column_mass_ref", spy)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((100, 4, 8)).astype(np.float32)
    k = rng.standard_normal((100, 2, 8)).astype(np.float32)
    prefill_stats(q, k, 0.3)
    assert (OBS_WINDOW, 100, 100 - OBS_WINDOW) in seen


def test_synthetic_structure(trace):
    m = trace.meta
    # sink: token 0 collects the most prefill mass in every head
    for cm in trace.colmass:
        assert (cm.argmax(axis=1) == 0).all()
    # observation window: a heavy window whose prefill queries fall in the last 32 rows collects
    # several times the obs_attn of the windows read only by earlier rows
    first = m.prompt_len - OBS_WINDOW
    seen = [s1 + (s1 - s0) > first for s0, s1 in m.extra["windows"]]
    assert any(seen) and not all(seen)
    for obs in trace.obs_attn:
        mass = np.array([obs[:, s0:s1].sum(axis=1).mean() for s0, s1 in m.extra["windows"]])
        assert mass[seen].min() > 3 * mass[~np.array(seen)].max(), mass
    # heavy windows: mass is high when on, drops in the gap between the two on-intervals (the
    # gap keeps a baseline share: 16 of ~240 tokens, more when the window is recent)
    for li in range(len(m.layers)):
        probs = [_decode_probs(trace, li, s) for s in range(m.steps)]
        for (w0, w1), ((a0, a1), (b0, b1)) in zip(
            m.extra["windows"], m.extra["active"], strict=True
        ):
            mass = np.array([p[:, w0:w1].sum(axis=1).mean() for p in probs])
            on = np.r_[mass[a0:a1], mass[b0:b1]]
            gap = mass[a1:b0]
            assert on.mean() > 0.4 and on.mean() > 4 * gap.mean(), (mass, on, gap)
    # recency: with no window on, the newest prompt half outweighs the oldest (sink excluded)
    busy = {s for iv in m.extra["active"] for a, b in iv for s in range(a, b)}
    p0 = _decode_probs(trace, 0, min(set(range(m.steps)) - busy))
    half = m.prompt_len // 2
    assert p0[:, half : m.prompt_len].sum() > p0[:, 1:half].sum()


def _with(trace: Trace, **changes) -> Trace:
    return dataclasses.replace(trace, **changes)


def _swap(arrays, i, a):
    return tuple(a if j == i else x for j, x in enumerate(arrays))


@pytest.mark.parametrize(
    "field, make, message",
    [
        ("k", lambda t: _swap(t.k, 0, t.k[0][:, :-1]), r"k_0: expected shape \(2, 240, 32\)"),
        ("v", lambda t: _swap(t.v, 1, t.v[1].astype(np.float32)), "v_1: expected float16"),
        ("q", lambda t: t.q[:1], r"q: 1 arrays for 2 layers"),
        ("qnorm", lambda t: _swap(t.qnorm, 0, t.qnorm[0] * np.nan), "qnorm_0: contains NaN"),
        ("colmass", lambda t: _swap(t.colmass, 0, t.colmass[0] * 1.1), "colmass_0: .* sum to"),
        (
            "obs_attn",
            lambda t: _swap(t.obs_attn, 1, t.colmass[1]),
            r"obs_attn_1: .* sum to G \* min\(32, prompt_len\) = 64",
        ),
        (
            "obs_attn",
            lambda t: _swap(t.obs_attn, 0, t.obs_attn[0][:, :-1]),
            r"obs_attn_0: expected shape \(2, 192\)",
        ),
        ("obs_attn", lambda t: None, "a version 2 trace must carry obs_attn"),
    ],
)
def test_array_validation_names_field(trace, field, make, message):
    with pytest.raises(TraceError, match=message):
        _with(trace, **{field: make(trace)})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"layers": (1, 0)}, "meta.layers: expected strictly increasing"),
        ({"n_heads_q": 3}, "meta.n_heads_q: 3 is not a multiple of n_heads_kv=2"),
        ({"sm_scale": 0.0}, "meta.sm_scale"),
        ({"prompt_ids": (1, 2)}, "meta.prompt_ids: expected 192 integer token ids, got 2"),
        ({"version": 0}, r"meta.version: expected one of \[1, 2\], got 0"),
        ({"version": 1}, "a version 1 trace must not carry obs_attn"),
        ({"steps": -1}, "meta.steps: expected a non-negative int"),
    ],
)
def test_meta_validation_names_field(trace, changes, message):
    with pytest.raises(TraceError, match=message):
        _with(trace, meta=dataclasses.replace(trace.meta, **changes))


def _rewrite(src, dst, edit) -> None:
    with np.load(src, allow_pickle=False) as z:
        data = {n: z[n] for n in z.files}
    edit(data)
    np.savez(dst, **data)


def test_load_errors(trace, tmp_path):
    good = trace.save(tmp_path / "good.npz")

    def newer(d):
        meta = json.loads(str(d["meta"]))
        meta["version"] = FORMAT_VERSION + 1
        d["meta"] = np.array(json.dumps(meta))

    cases = [
        (lambda d: d.pop("v_1"), r"missing arrays \['v_1'\]"),
        (lambda d: d.update(extra_0=np.zeros(3)), r"unexpected arrays \['extra_0'\]"),
        (lambda d: d.update(meta=np.array("{not json")), "meta: not valid JSON"),
        (newer, "newer than this reader"),
        (lambda d: d.update(meta=np.array(json.dumps({"model": "x"}))), "meta: missing fields"),
    ]
    for i, (edit, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}.npz"
        _rewrite(good, bad, edit)
        with pytest.raises(TraceError, match=message):
            Trace.load(bad)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="not a readable trace"):
        Trace.load(tmp_path / "junk.npz")


def test_version_1_files_load_without_obs_attn(trace, tmp_path):
    old = synthetic_trace(7, version=1)
    assert old.obs_attn is None and old.meta.version == 1
    np.testing.assert_array_equal(old.colmass[0], trace.colmass[0])  # same data otherwise
    path = old.save(tmp_path / "v1.npz")
    with np.load(path, allow_pickle=False) as z:
        assert not [n for n in z.files if n.startswith("obs_attn")]
        assert json.loads(str(z["meta"]))["version"] == 1
    back = Trace.load(path)
    assert back.obs_attn is None and back.meta == old.meta
    # a version 2 file without obs_attn arrays is incomplete, not silently downgraded
    v2 = tmp_path / "v2.npz"
    _rewrite(trace.save(tmp_path / "good.npz"), v2, lambda d: d.pop("obs_attn_1"))
    with pytest.raises(TraceError, match=r"missing arrays \['obs_attn_1'\]"):
        Trace.load(v2)


def test_index(trace):
    assert trace.index(1) == 1
    with pytest.raises(TraceError, match=r"layer 5 was not recorded; have \[0, 1\]"):
        trace.index(5)


def test_shipped_needle_trace():
    path = Path(__file__).resolve().parents[2] / "examples" / "traces" / "smollm2-needle.npz"
    tr = Trace.load(path)
    m = tr.meta
    assert m.model == "smollm2-135m" and 64 <= m.steps <= 96 and path.stat().st_size < 8 << 20
    assert m.extra["answer"] in m.generated_text and m.version == FORMAT_VERSION
    a, b = m.extra["needle_tokens"]
    li = tr.index(17)
    mass = np.array([_decode_probs(tr, li, s)[:, a:b].sum(axis=1).max() for s in range(m.steps)])
    # the needle is read, dropped, and read again when the digits are written
    assert mass[1:4].min() > 0.3 and mass[6:10].max() < 0.05 and mass[12:18].min() > 0.5
