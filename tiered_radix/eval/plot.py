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
    """One panel per (task, length): a line per policy with its 95% CI, full-KV rows dashed."""
    panels = list(dict.fromkeys((r["task"], r["length"]) for r in report["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    policies = sorted({r["policy"] for r in report["rows"] if not r["reference"]})
    color = {p: f"C{i % 10}" for i, p in enumerate(policies)}  # the same in every panel
    for ax, (task, length) in zip(axes[0], panels, strict=True):
        rows = [r for r in report["rows"] if (r["task"], r["length"]) == (task, length)]
        series: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            if r["score"] is not None:
                series[r["policy"]].append(r)
        for i, (policy, rs) in enumerate(series.items()):
            if rs[0]["reference"]:
                ax.axhline(rs[0]["score"], color="black", ls=("--", ":", "-.")[i % 3], lw=1,
                           label="full KV" if policy == "full" else policy)  # fmt: skip
                continue
            rs.sort(key=lambda r: budget_order(r["budget"]))
            ys = [r["score"] for r in rs]
            err = None
            if all(r["ci_low"] is not None for r in rs):
                err = [[y - r["ci_low"] for y, r in zip(ys, rs, strict=True)],
                       [r["ci_high"] - y for y, r in zip(ys, rs, strict=True)]]  # fmt: skip
            ax.errorbar([_x([r], r["budget"]) for r in rs], ys, yerr=err, marker="o", capsize=2,
                        color=color[policy], label=policy)  # fmt: skip
        ax.set(title=f"{task}, {length} tokens", xlabel="KV bytes (% of full precision)",
               ylabel="score (%)", ylim=(-3, 103))  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
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
