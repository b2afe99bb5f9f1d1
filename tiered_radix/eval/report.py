"""Aggregate evaluation records into rows, a JSON document and markdown tables.

``report.json`` (``SCHEMA_VERSION`` 1)::

    {"schema": 1, "meta": {engine, model, seed, samples, lengths, ...},
     "rows": [{task, length, policy, budget, reference, n, score, ci_low, ci_high, retention,
               bytes_fraction, archived_fraction, over_budget, fmm, lir, churn, seconds,
               errors}],
     "depths": [{policy, budget, length, depth, n, score}],       # needle sweep cells
     "errors": [{policy, budget, task, length, index, error}]}

Scores and interval ends are percents; ``retention`` is the row's score over the full-KV score
of the same task, length and engine (kvpress's presses over kvpress's own full-KV run), in
percent (null when the reference scored 0 or is missing).
``bytes_fraction`` is the mean of ``bytes_used / full_bytes`` at the end of generation
(``archived_fraction`` that of ``archived_bytes``, ``evict(archive=...)``'s copies, else None);
``over_budget`` counts samples whose engine reported a routing step that missed the budget.
Diagnostics (``fmm``, ``lir``, ``churn``) are means of any stats key ending in that name.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .scoring import mean_ci

SCHEMA_VERSION = 1
DIAGNOSTICS = ("fmm", "lir", "churn")


def budget_order(label: str) -> float:
    try:
        return float(label.rstrip("%")) if label.endswith("%") else float(label.split()[0])
    except ValueError:
        return math.inf


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _stat(r: dict, name: str) -> float | None:
    return _mean([v for k, v in r.get("stats", {}).items() if k.split(".")[-1] == name])


def _bytes_fraction(r: dict, name: str = "bytes_used") -> float | None:
    st = r.get("stats", {})
    used, full = st.get(name), st.get("full_bytes")
    return used / full if isinstance(used, int | float) and full else None


def build_rows(records: Sequence[dict]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    errors: dict[tuple, int] = defaultdict(int)
    engine = {}  # each policy's engine: its retention is over that engine's own full-KV row
    for r in records:
        engine[r["policy"]] = r.get("engine")
        key = (r["task"], r["length"], r["policy"], r["budget"])
        if "error" in r:
            errors[key] += 1
        else:
            groups[key].append(r)
    rows = []
    for key in sorted(set(groups) | set(errors), key=_row_order(records)):
        recs = groups.get(key, [])
        row: dict[str, Any] = dict(zip(("task", "length", "policy", "budget"), key, strict=False))
        row["reference"] = any(r.get("reference") for r in recs) or key[2] == "full"
        row["n"], row["errors"] = len(recs), errors.get(key, 0)
        if recs:
            m, lo, hi = mean_ci([r["score"] for r in recs])
            row.update(score=100 * m, ci_low=100 * lo, ci_high=100 * hi)
        else:
            row.update(score=None, ci_low=None, ci_high=None)
        row["bytes_fraction"] = _mean([_bytes_fraction(r) for r in recs])
        # evict(archive=...): copies kept for later turns, outside the budget (None: no archive)
        row["archived_fraction"] = (
            _mean([_bytes_fraction(r, "archived_bytes") for r in recs]) or None
        )
        row["over_budget"] = sum(bool(r.get("stats", {}).get("over_budget")) for r in recs)
        for name in DIAGNOSTICS:
            row[name] = _mean([_stat(r, name) for r in recs])
        row["seconds"] = _mean([r.get("seconds") for r in recs])
        rows.append(row)

    def home(row: dict) -> tuple:
        return row["task"], row["length"], engine.get(row["policy"])

    ref = {home(r): r["score"] for r in rows if r["reference"]}
    for row in rows:
        base = ref.get(home(row))
        ok = base and row["score"] is not None
        row["retention"] = 100 * row["score"] / base if ok else None
    return rows


def _row_order(records: Sequence[dict]):
    tasks = list(dict.fromkeys(r["task"] for r in records))

    def order(key: tuple) -> tuple:
        task, length, policy, budget = key
        return (tasks.index(task), length, policy != "full", policy, budget_order(budget))

    return order


def depth_cells(records: Sequence[dict]) -> list[dict[str, Any]]:
    """Mean score per (policy, budget, length, depth) over the ``needle`` sweep."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        if r["task"] == "needle" and "score" in r:
            groups[(r["policy"], r["budget"], r["length"], r["depth"])].append(r["score"])
    return [
        {
            "policy": p,
            "budget": b,
            "length": n,
            "depth": d,
            "n": len(v),
            "score": 100 * sum(v) / len(v),
        }
        for (p, b, n, d), v in sorted(
            groups.items(),
            key=lambda kv: (
                kv[0][0] != "full",
                kv[0][0],
                budget_order(kv[0][1]),
                kv[0][2],
                kv[0][3],
            ),
        )
    ]


def build_report(records: Sequence[dict], meta: dict[str, Any]) -> dict[str, Any]:
    errors = [
        {k: r[k] for k in ("policy", "budget", "task", "length", "index", "error")}
        for r in records
        if "error" in r
    ]
    return {
        "schema": SCHEMA_VERSION,
        "meta": meta,
        "rows": build_rows(records),
        "depths": depth_cells(records),
        "errors": errors,
    }


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown_table(report: dict) -> str:
    """One line per (task, length, policy, budget): score, 95% CI, n, retention, KV bytes."""
    lines = [
        "| task | length | policy | budget | score | 95% CI | n | retention vs full | KV bytes "
        "| FMM | LIR | churn |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        ci = "-" if r["ci_low"] is None else f"[{r['ci_low']:.0f}, {r['ci_high']:.0f}]"
        n = f"{r['n']}" + (f" ({r['errors']} failed)" if r["errors"] else "")
        lines.append(
            f"| {r['task']} | {r['length']} | {r['policy']} | {r['budget']} | {_f(r['score'])} "
            f"| {ci} | {n} | {_f(r['retention'], '{:.0f}%')} "
            f"| {_f(r['bytes_fraction'] and 100 * r['bytes_fraction'], '{:.1f}%')}"
            f"{_archived(r)}"
            f"{' (' + str(r['over_budget']) + ' over)' if r.get('over_budget') else ''} "
            f"| {_f(r['fmm'], '{:.3f}')} | {_f(r['lir'], '{:.3f}')} | {_f(r['churn'], '{:.3f}')} |"
        )
    return "\n".join(lines)


def _archived(row: dict) -> str:
    a = row.get("archived_fraction")
    return f" + {100 * a:.1f}% archived" if a else ""


def markdown_report(report: dict) -> str:
    meta = report["meta"]
    head = [f"# Evaluation: {meta.get('model')} ({meta.get('engine')})", ""]
    head += [
        f"- {k}: {v}" for k, v in meta.items() if k not in ("model", "engine") and v is not None
    ]
    head += [
        "",
        "Score: RULER string match (percent of answer strings found), mean over "
        "samples; 95% CI: Wilson (0/1 scores) or bootstrap. Retention: score / full-KV "
        "score of the same task, length and engine. KV bytes: bytes used / full-precision bytes "
        "at the end of generation ('+ x% archived': copies of evicted windows kept for later "
        "turns, evict(archive=...), outside the budget); '(k over)': k samples had a routing "
        "step that could not meet the budget.",
        "",
    ]
    tail = [""]
    if report["errors"]:
        tail += ["## Failed cells", ""]
        tail += [
            f"- {e['policy']} @ {e['budget']}, {e['task']}/{e['length']}/{e['index']}: {e['error']}"
            for e in report["errors"][:50]
        ]
    return "\n".join(head) + "\n" + markdown_table(report) + "\n" + "\n".join(tail) + "\n"
