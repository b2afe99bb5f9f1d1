"""PNG plots of a simulator report (``build_report``'s document), one concept per figure.

- ``bytes.png``: store bytes per policy over the decode, beside each policy's budget (dashed).
- ``occupancy.png``: per policy, the share of units in each tier over the decode (stacked area).
- ``quality.png``: per policy, attention-output error (mean, p95) and FMM, labelled with the
  bytes actually held so that comparisons at equal bytes are visible.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

_COLORS = plt.get_cmap("tab10").colors


def _color(i: int):
    return _COLORS[i % len(_COLORS)]


def plot_bytes(report: dict, path: Path) -> Path:
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(13, 5.5))
    entries = report["policies"]
    shared = all(
        e["series"]["budget_bytes"] == entries[0]["series"]["budget_bytes"] for e in entries
    )
    top = 0.0
    for i, e in enumerate(entries):
        s = e["series"]
        x, full = np.array(s["seq_len"]), np.array(s["full_bytes"], float)
        held, budget = (100 * np.array(s[k]) / full for k in ("bytes_used", "budget_bytes"))
        for a in (ax, zoom):
            a.plot(x, held, color=_color(i), label=e["policy"])
            if not shared:
                a.plot(x, budget, color=_color(i), ls="--", lw=1, alpha=0.7)
        top = max(top, budget.max())
    for a in (ax, zoom):
        if shared:
            a.plot(x, budget, color="black", ls="--", lw=1.2, label="budget")
        else:
            a.plot([], [], color="gray", ls="--", lw=1, label="budget (same colour)")
        a.set_xlabel("tokens in cache (prompt + decoded)")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    pct = FuncFormatter(lambda y, _: f"{y:g}%")
    ax.yaxis.set_major_formatter(pct)
    ax.yaxis.set_minor_formatter(pct)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_ylabel("KV bytes, % of full precision (log scale)")
    ax.set_title("All policies")
    zoom.set_ylim(0, min(100.0, 3 * top))
    zoom.yaxis.set_major_formatter(pct)
    zoom.set_ylabel("KV bytes, % of full precision")
    zoom.set_title(f"Near the budget (0 to {min(100.0, 3 * top):g}%)")
    zoom.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9)
    fig.suptitle(f"Bytes held vs budget: {report['trace']['model']}")
    return _save(fig, path)


def plot_occupancy(report: dict, path: Path) -> Path:
    entries = report["policies"]
    cols = min(len(entries), 4)
    rows = math.ceil(len(entries) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, e in zip(axes.flat, entries, strict=False):
        s = e["series"]
        occ = s["occupancy"]
        counts = np.array([occ[t] for t in occ], float)
        share = 100 * counts / np.maximum(counts.sum(0), 1)
        ax.stackplot(
            s["seq_len"], share, labels=list(occ), colors=[_color(i) for i in range(len(occ))]
        )
        ax.set_title(e["policy"], fontsize=10)
        ax.set_xlabel("tokens in cache", fontsize=8)
        ax.set_ylabel("% of units", fontsize=8)
        ax.set_ylim(0, 100)
        ax.legend(loc="lower left", fontsize=7, framealpha=0.8)
    for ax in list(axes.flat)[len(entries) :]:
        ax.axis("off")
    fig.suptitle(f"Tier occupancy over the decode: {report['trace']['model']}")
    return _save(fig, path)


def plot_quality(report: dict, path: Path) -> Path:
    entries = report["policies"]
    names = [f"{e['policy']}\n{e['summary']['bytes_fraction_mean']:.1%} bytes" for e in entries]
    x = np.arange(len(entries))
    fig, (ax_e, ax_f) = plt.subplots(2, 1, figsize=(max(7, 1.25 * len(entries)), 8))
    mean = [e["summary"]["error_mean"] for e in entries]
    p95 = [e["summary"]["error_p95"] for e in entries]
    bars = [ax_e.bar(x - 0.2, mean, 0.4, label="mean", color=_color(0))]
    bars.append(ax_e.bar(x + 0.2, p95, 0.4, label="p95", color=_color(1)))
    ax_e.set_ylabel("||o - o_full|| / ||o_full||")
    ax_e.set_title("Attention-output error (over steps, layers, query heads)")
    ax_e.legend()
    bars.append(ax_f.bar(x, [e["summary"]["fmm"] for e in entries], 0.6, color=_color(3)))
    ax_f.set_ylabel("share of oracle attention\non evicted tokens")
    ax_f.set_title("Future missed mass (FMM)")
    for b in bars:
        b[0].axes.bar_label(b, fmt="%.3f", fontsize=7, padding=1)
    for ax in (ax_e, ax_f):
        ax.set_xticks(x, names, fontsize=8)
        ax.set_xlabel("policy (mean bytes held, % of full precision)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.12)
    fig.suptitle(f"Quality per policy: {report['trace']['model']}")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_plots(report: dict, out: str | Path) -> list[Path]:
    """Write ``bytes.png``, ``occupancy.png`` and ``quality.png`` into ``out``; return the paths."""
    out = Path(out)
    return [
        plot_bytes(report, out / "bytes.png"),
        plot_occupancy(report, out / "occupancy.png"),
        plot_quality(report, out / "quality.png"),
    ]
