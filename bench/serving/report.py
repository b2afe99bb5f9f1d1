"""The benchmark's summary file (``serve-summary.json``) and its plot.

Rows are keyed by system name and arrival; a later run into the same folder replaces its own
rows and keeps the others (so the six systems can be measured in two device calls), provided
the model, KV bytes and workload are the same; otherwise the old file is set aside as
``serve-summary.previous.json`` and a new one begins.
"""

from __future__ import annotations

import json
from pathlib import Path

SUMMARY = "serve-summary.json"
SAME_RUN = ("model", "kv_bytes", "scale", "seed")  # rows merge only under equal values


def merge(meta: dict, rows: list[dict], out: Path) -> dict:
    """``meta`` with the rows of ``out``'s summary (if it describes the same benchmark) updated
    by ``rows``; written back to ``out / SUMMARY`` and returned."""
    path = out / SUMMARY
    old: list[dict] = []
    if path.exists():
        prev = json.loads(path.read_text())
        if all(prev.get(k) == meta.get(k) for k in SAME_RUN):
            old = prev.get("rows", [])
        else:
            path.replace(out / "serve-summary.previous.json")
    new_keys = {(r["name"], r["arrival"]) for r in rows}
    kept = [r for r in old if (r["name"], r["arrival"]) not in new_keys]
    summary = dict(meta, rows=kept + rows)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return summary


def plot(summary: dict, path: Path) -> Path | None:
    """Bars of output tokens/s and TTFT p50 per system, one colour per arrival mode."""
    rows = [r for r in summary["rows"] if r.get("output_tok_s") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in summary["rows"]))
    arrivals = list(dict.fromkeys(r["arrival"] for r in rows))
    width = 0.8 / len(arrivals)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "output_tok_s", "output tokens / s"),
        (axes[1], "ttft_p50_s", "TTFT p50 (s)"),
    ):
        for j, arrival in enumerate(arrivals):
            by = {r["name"]: r.get(key) for r in rows if r["arrival"] == arrival}
            xs = [i + (j - (len(arrivals) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [by.get(n) or 0 for n in names], width, label=arrival)
        for i, name in enumerate(names):
            if not any(r["name"] == name for r in rows):  # the server failed: see its row
                ax.text(i, 0, "failed", ha="center", va="bottom", color="red", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    gib = summary["kv_bytes"] / (1 << 30)
    fig.suptitle(f"{Path(summary['model']).name}, {gib:.2f} GiB of KV per system, {summary['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
