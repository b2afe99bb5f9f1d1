"""The trace simulator: attention against a float64 reference, end-to-end properties on a
synthetic trace (full policy exact, streaming misses mass, budgets held), report and plots."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiered_radix.sim.plot import write_plots
from tiered_radix.sim.report import SUMMARY_FIELDS, build_report, markdown_table, write_json
from tiered_radix.sim.simulate import DiagnosticsRecorder, SimError, attend, simulate
from tiered_radix.sim.trace import synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(0, steps=32)


@pytest.fixture(scope="module")
def runs(trace):
    return {
        "full": simulate("full", trace, progress=False),
        "streaming": simulate("streaming", trace, "10%", progress=False),
    }


def _dense_attention(q, k, v, kept, scale):
    """float64, one query head at a time, evicted tokens dropped by indexing (not masking)."""
    hq, d = q.shape
    h = k.shape[0]
    g = hq // h
    out = np.zeros((hq, d))
    mass = np.zeros(k.shape[:2])
    for i in range(hq):
        kv = i // g
        idx = np.flatnonzero(kept[kv])
        logits = k[kv, idx].astype(np.float64) @ q[i].astype(np.float64) * scale
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[i] = p @ v[kv, idx].astype(np.float64)
        mass[kv, idx] += p
    return out, mass


def test_attend_matches_float64_reference_with_gqa_and_eviction():
    rng = np.random.default_rng(1)
    h, g, t, d = 2, 3, 40, 16
    q = rng.standard_normal((h * g, d)).astype(np.float32)
    k = rng.standard_normal((h, t, d)).astype(np.float32)
    v = rng.standard_normal((h, t, d)).astype(np.float32)
    kept = rng.random((h, t)) < 0.6
    kept[:, 0] = True
    k_poisoned, v_poisoned = k.copy(), v.copy()
    k_poisoned[~kept], v_poisoned[~kept] = np.nan, np.nan  # what the store returns when evicted
    tk = [torch.from_numpy(x) for x in (q, k_poisoned, v_poisoned)]
    out, mass = attend(*tk, torch.from_numpy(kept), 0.3)
    ref_out, ref_mass = _dense_attention(q, k, v, kept, 0.3)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mass.numpy(), ref_mass, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mass.sum(1).numpy(), g, rtol=1e-5)  # each query row sums to 1
    full_out, _ = attend(*(torch.from_numpy(x) for x in (q, k, v)), None, 0.3)
    ref_full, _ = _dense_attention(q, k, v, np.ones((h, t), bool), 0.3)
    np.testing.assert_allclose(full_out.numpy(), ref_full, rtol=1e-5, atol=1e-6)


def test_recorder_churn_counts_tier_changes_between_routes():
    rec = DiagnosticsRecorder(1, 2, 1, 4)
    rec.route([np.array([[0, 0, 1], [0, 1, 1]])])
    rec.route([np.array([[0, 1, 1, 0], [1, 1, 1, 1]])])  # 2 changes; the 4th unit is new
    rec.route([np.array([[0, 1, 1, 0], [1, 1, 1, 1]])])  # none
    assert rec._churn() == pytest.approx((2 / 2, (2 / 6) / 2))


def test_recorder_fmm_pads_short_rows_and_sums_mass_over_steps():
    rec = DiagnosticsRecorder(1, 1, 2, 3)
    rec.step(0, 0, torch.tensor([[0.5, 0.5]]), torch.tensor([[False, True]]), torch.ones(1, 2) > 0)
    rec.step(
        0,
        1,
        torch.tensor([[0.2, 0.3, 0.5]]),
        torch.tensor([[False, True, False]]),
        torch.tensor([[True, False, True]]),
    )
    rec.route([np.zeros((1, 3), np.int64)])
    d = rec.finish()
    assert d.fmm[0, 0] == pytest.approx((0.5 + 0.3) / 2.0)
    assert d.routes == 1 and d.churn == 0


def test_full_policy_is_exact(runs):
    r = runs["full"]
    assert r.error.shape == (32, 2, 4)
    assert r.seq_len[0] == 192 and r.seq_len[-1] == 192 + 32
    assert (r.error == 0).all()
    assert (r.diagnostics.fmm == 0).all()
    assert r.transitions["evict"].sum() == 0
    np.testing.assert_array_equal(r.bytes_used, r.full_bytes)


def test_streaming_at_small_budget_misses_mass_and_holds_budget(runs):
    r = runs["streaming"]
    assert (r.diagnostics.fmm > 0).all()
    assert r.error.mean() > 1e-3
    assert r.transitions["evict"].sum() > 0
    assert r.routed.all()  # every(1): a routing step after prefill and after each decode step
    assert (r.bytes_used <= r.budget_bytes).all()
    assert (r.bytes_used < 0.15 * r.full_bytes).all()
    assert (r.budget_bytes <= 0.1 * r.full_bytes + 1).all()


def test_oracle_lir_is_policy_independent(runs):
    np.testing.assert_array_equal(
        runs["full"].diagnostics.lir_oracle, runs["streaming"].diagnostics.lir_oracle
    )


def test_policy_needing_obs_attn_is_refused_on_a_trace_without_it():
    with pytest.raises(SimError, match="obs_attn"):
        simulate("snapkv", synthetic_trace(0, steps=32, version=1), progress=False)


def test_snapkv_runs_on_a_trace_with_obs_attn(trace):
    r = simulate("snapkv", trace, progress=False)
    assert r.transitions["evict"].sum() > 0 and r.diagnostics.fmm.mean() > 0


def test_report_json_table_and_plots(runs, trace, tmp_path):
    report = build_report(list(runs.values()), trace.meta, trace_path="t.npz")
    path = write_json(report, tmp_path / "report.json")
    back = json.loads(path.read_text())
    assert back["schema"] == 1 and back["trace"]["steps"] == 32
    for entry in back["policies"]:
        assert set(entry["summary"]) == set(SUMMARY_FIELDS)
        series = entry["series"]
        assert len(series["bytes_used"]) == len(series["budget_bytes"]) == 33
        assert len(series["error_mean"]) == 32
        assert set(entry["per_layer"]) == {"layers", "fmm", "lir", "lir_oracle", "error_mean"}
    stream = back["policies"][1]["summary"]
    assert stream["over_budget_steps"] == 0 and stream["fmm"] > 0
    table = markdown_table(back)
    assert table.count("\n") == 3 and "| streaming |" in table
    pngs = write_plots(back, tmp_path)
    assert [p.name for p in pngs] == ["bytes.png", "occupancy.png", "quality.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_custom_policy_runs_in_the_simulator(trace):
    """examples/custom_policy.yaml (QEvict windows + RDKV allocation) runs with no code change."""
    from pathlib import Path

    custom = Path(__file__).resolve().parents[2] / "examples" / "custom_policy.yaml"
    # 192 prompt tokens: sinks + the recent 64 hold about half the bytes, so 10% cannot bind
    r = simulate(str(custom), trace, budget="60%", progress=False)
    assert (r.bytes_used[r.routed] <= r.budget_bytes[r.routed]).all()
    quantized = [name for name in r.occupancy if name in ("b2", "b4")]
    assert quantized and sum(int(r.occupancy[n].max()) for n in quantized) > 0
    assert r.transitions["evict"].sum() > 0 and 0 < r.error.mean() < 0.3
