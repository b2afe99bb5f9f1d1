"""PNG plots of an evaluation report (matplotlib, Agg backend).

- ``score_vs_budget.png``: one panel per task (lengths pooled by mean), one line per policy
  over the *measured* KV bytes (% of full precision; the budget label where a run reported no
  bytes), 95% intervals as error bars when one length ran, full KV as a dashed line;
- ``needle_heatmap.png``: needle depth x length score per (policy, budget), when the ``needle``
  sweep ran;
- ``diagnostics.png``: FMM / LIR / churn per (policy, budget), when the engine reported them.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report import DIAGNOSTICS, budget_order  # noqa: E402


def write_plots(report: dict, out: str | Path) -> list[Path]:
    """Write whichever plots the report has data for; return their paths."""
    out = Path(out)
    paths = [_score_vs_budget(report, out / "score_vs_budget.png")]
    if report["depths"]:
        paths.append(_heatmap(report, out / "needle_heatmap.png"))
    if any(r[d] is not None for r in report["rows"] for d in DIAGNOSTICS):
        paths.append(_diagnostics(report, out / "diagnostics.png"))
    return paths


def _score_vs_budget(report: dict, path: Path) -> Path:
    tasks = list(dict.fromkeys(r["task"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=False):
        series: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for r in report["rows"]:
            if r["task"] == task and r["score"] is not None:
                series[r["policy"]][r["budget"]].append(r)
        for policy, by_budget in series.items():
            if policy == "full":
                full = _mean([_mean([r["score"] for r in v]) for v in by_budget.values()])
                ax.axhline(full, color="black", ls="--", lw=1, label="full KV")
                continue
            labels = sorted(by_budget, key=budget_order)
            rows = [by_budget[b] for b in labels]
            xs = [_x(rs, b) for rs, b in zip(rows, labels, strict=True)]
            ys = [_mean([r["score"] for r in rs]) for rs in rows]
            err = None
            if all(len(rs) == 1 and rs[0]["ci_low"] is not None for rs in rows):
                err = [[y - rs[0]["ci_low"] for y, rs in zip(ys, rows, strict=True)],
                       [rs[0]["ci_high"] - y for y, rs in zip(ys, rows, strict=True)]]  # fmt: skip
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, label=policy)
        ax.set(title=task, xlabel="KV bytes (% of full precision)", ylabel="score (%)",
               ylim=(-3, 103))  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{report['meta'].get('model')}: score vs KV budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _x(rows: list[dict], label: str) -> float:
    fr = [r["bytes_fraction"] for r in rows if r.get("bytes_fraction") is not None]
    return 100 * _mean(fr) if fr else budget_order(label)


def _heatmap(report: dict, path: Path) -> Path:
    configs = list(dict.fromkeys((c["policy"], c["budget"]) for c in report["depths"]))
    depths = sorted({c["depth"] for c in report["depths"]})
    lengths = sorted({c["length"] for c in report["depths"]})
    cols = min(4, len(configs))
    rows = -(-len(configs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat[len(configs) :]:
        ax.axis("off")
    for ax, (policy, budget) in zip(axes.flat, configs, strict=False):
        grid = [[float("nan")] * len(depths) for _ in lengths]
        for c in report["depths"]:
            if (c["policy"], c["budget"]) == (policy, budget):
                grid[lengths.index(c["length"])][depths.index(c["depth"])] = c["score"]
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_title(f"{policy} @ {budget}", fontsize=9)
        ax.set(xlabel="needle depth", ylabel="length (tokens)")
    fig.colorbar(im, ax=axes, shrink=0.8, label="score (%)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _diagnostics(report: dict, path: Path) -> Path:
    acc: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in report["rows"]:
        for d in DIAGNOSTICS:
            if r[d] is not None:
                acc[(r["policy"], r["budget"])][d].append(r[d])
    configs = sorted(acc, key=lambda c: (c[0], budget_order(c[1])))
    fig, axes = plt.subplots(1, len(DIAGNOSTICS), figsize=(4.2 * len(DIAGNOSTICS), 3.2))
    for ax, d in zip(axes, DIAGNOSTICS, strict=False):
        vals = [sum(acc[c][d]) / len(acc[c][d]) if acc[c][d] else 0.0 for c in configs]
        ax.bar(range(len(configs)), vals)
        ax.set_xticks(
            range(len(configs)),
            [f"{p}@{b}" for p, b in configs],
            rotation=60,
            fontsize=7,
            ha="right",
        )
        ax.set_title(d.upper())
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
