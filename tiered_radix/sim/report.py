"""The simulator's report: per-policy summary numbers, a JSON document and a markdown table.

``report.json`` (``SCHEMA_VERSION`` 1)::

    {"schema": 1, "trace": {model, path, layers, n_heads_q, n_heads_kv, head_dim, prompt_len,
     steps}, "budget_override": "10% of ..." | null, "skipped": [{"policy", "reason"}],
     "policies": [{"policy", "description", "budget", "summary": {SUMMARY_FIELDS},
                   "series": {seq_len, bytes_used, bytes_peak, budget_bytes, full_bytes,
                              routed, occupancy: {tier: [...]}, transitions: {kind: [...]},
                              error_mean: [...]},
                   "per_layer": {layers, fmm, lir, lir_oracle, error_mean}}]}

Series have ``steps + 1`` entries (entry 0: after prefill routing), except ``error_mean`` (one per
decode step, mean over layers and query heads).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .simulate import SimResult
from .trace import TraceMeta

SCHEMA_VERSION = 1
SUMMARY_FIELDS = (
    "error_mean",
    "error_p95",
    "error_max",
    "fmm",
    "lir",
    "lir_oracle",
    "churn",
    "churn_share",
    "routes",
    "promotions",
    "demotions",
    "evictions",
    "bytes_mean",
    "bytes_max",
    "bytes_peak_max",
    "budget_mean",
    "bytes_fraction_mean",
    "bytes_fraction_final",
    "over_budget_steps",
    "peak_over_budget_steps",
)


def summarize(r: SimResult) -> dict[str, float | int]:
    """Scalar summary of one run; keys are ``SUMMARY_FIELDS``."""
    err, dg = r.error.astype(np.float64), r.diagnostics
    frac = r.bytes_used / r.full_bytes
    empty = err.size == 0
    return {
        "error_mean": 0.0 if empty else float(err.mean()),
        "error_p95": 0.0 if empty else float(np.quantile(err, 0.95)),
        "error_max": 0.0 if empty else float(err.max()),
        "fmm": float(dg.fmm.mean()),
        "lir": float(dg.lir.mean()),
        "lir_oracle": float(dg.lir_oracle.mean()),
        "churn": float(dg.churn),
        "churn_share": float(dg.churn_share),
        "routes": int(dg.routes),
        "promotions": int(r.transitions["promote"].sum()),
        "demotions": int(r.transitions["demote"].sum()),
        "evictions": int(r.transitions["evict"].sum()),
        "bytes_mean": float(r.bytes_used.mean()),
        "bytes_max": int(r.bytes_used.max()),
        "bytes_peak_max": int(r.bytes_peak.max()),
        "budget_mean": float(r.budget_bytes.mean()),
        "bytes_fraction_mean": float(frac.mean()),
        "bytes_fraction_final": float(frac[-1]),
        "over_budget_steps": int((r.bytes_used > r.budget_bytes).sum()),
        "peak_over_budget_steps": int((r.bytes_peak > r.budget_bytes).sum()),
    }


def _policy_entry(r: SimResult) -> dict:
    ints = ("seq_len", "bytes_used", "bytes_peak", "budget_bytes", "full_bytes")
    series = {name: getattr(r, name).tolist() for name in ints}
    series["routed"] = r.routed.tolist()
    series["occupancy"] = {k: v.tolist() for k, v in r.occupancy.items()}
    series["transitions"] = {k: v.tolist() for k, v in r.transitions.items()}
    series["error_mean"] = r.error.mean(axis=(1, 2)).tolist()
    dg = r.diagnostics
    per_layer = {
        "layers": list(r.layers),
        "fmm": dg.fmm.mean(axis=1).tolist(),
        "lir": dg.lir.mean(axis=1).tolist(),
        "lir_oracle": dg.lir_oracle.mean(axis=1).tolist(),
        "error_mean": r.error.mean(axis=(0, 2)).tolist() if r.error.size else [],
    }
    return {
        "policy": r.policy,
        "description": r.description,
        "budget": r.budget,
        "summary": summarize(r),
        "series": series,
        "per_layer": per_layer,
    }


def build_report(
    results: list[SimResult],
    meta: TraceMeta,
    *,
    trace_path: str = "",
    budget_override: str | None = None,
    skipped: list[tuple[str, str]] = (),
) -> dict:
    """The ``report.json`` document (see the module docstring)."""
    trace = {
        "model": meta.model,
        "path": trace_path,
        "layers": list(meta.layers),
        "n_heads_q": meta.n_heads_q,
        "n_heads_kv": meta.n_heads_kv,
        "head_dim": meta.head_dim,
        "prompt_len": meta.prompt_len,
        "steps": meta.steps,
    }
    return {
        "schema": SCHEMA_VERSION,
        "trace": trace,
        "budget_override": budget_override,
        "skipped": [{"policy": p, "reason": why} for p, why in skipped],
        "policies": [_policy_entry(r) for r in results],
    }


def write_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


COLUMNS = (
    ("policy", "policy", "{}"),
    ("bytes_fraction_mean", "bytes / full", "{:.1%}"),
    ("bytes_max", "max bytes / budget", None),
    ("error_mean", "err mean", "{:.4f}"),
    ("error_p95", "err p95", "{:.4f}"),
    ("fmm", "FMM", "{:.4f}"),
    ("lir", "LIR", "{:.3f}"),
    ("lir_oracle", "LIR oracle", "{:.3f}"),
    ("churn", "churn/route", "{:.1f}"),
    ("promotions", "promote", "{}"),
    ("demotions", "demote", "{}"),
    ("evictions", "evict", "{}"),
)


def markdown_table(report: dict) -> str:
    """One row per policy of a ``build_report`` document, as a GitHub markdown table."""
    lines = [
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "|".join("---" if key == "policy" else "---:" for key, _, _ in COLUMNS) + "|",
    ]
    for entry in report["policies"]:
        s = entry["summary"]
        cells = []
        for key, _, fmt in COLUMNS:
            if key == "policy":
                cells.append(entry["policy"])
            elif key == "bytes_max":  # the worst step, bytes over that step's own budget
                b = entry["series"]
                ratio = np.array(b["bytes_used"]) / np.array(b["budget_bytes"])
                cells.append(f"{ratio.max():.2f}")
            else:
                cells.append(fmt.format(s[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(report: dict) -> str:
    """``report.md``: what was replayed, the comparison table, and how to read it."""
    t = report["trace"]
    budget = report["budget_override"] or "each policy's own"
    out = [
        f"# Simulation: {t['model']}",
        "",
        f"Trace `{t['path']}`: layers {t['layers']}, {t['n_heads_q']} query / {t['n_heads_kv']} "
        f"KV heads, d={t['head_dim']}, prompt {t['prompt_len']} tokens, {t['steps']} decode "
        f"steps. Budget: {budget}.",
        "",
        markdown_table(report),
        "",
        "bytes / full: mean store bytes over the full-precision bytes of the same tokens. "
        "max bytes / budget: the worst step, bytes after that step (and its routing, if any) "
        "over its budget; > 1.00 is over budget: new tokens stay at full precision between "
        "routing steps, and a policy without an evict tier cannot go below its cheapest tier. "
        "err: relative "
        "attention-output error ||o - o_full|| / ||o_full|| over steps, layers and query heads. "
        "FMM: share of the oracle's attention on evicted tokens. LIR: Global LIR with active = "
        "the policy's full tier; LIR oracle: active = the oracle's 90% mass set. churn/route: "
        "tier changes per routing step.",
    ]
    for s in report["skipped"]:
        out += ["", f"Skipped {s['policy']}: {s['reason']}"]
    return "\n".join(out) + "\n"
