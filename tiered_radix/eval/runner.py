"""Run a (policy, budget, task, length, sample) grid and keep every result in a JSONL cache.

Full KV (the shipped ``full`` policy at its own 100% budget) is always the first configuration:
it is the reference every retention figure divides by. Samples are the outer loop, so a run cut
short still has every configuration on its first samples. Each finished cell is appended to
``results.jsonl`` at once; a rerun with the same grid skips the cells already there (keyed by
model, policy name and content hash, budget, task, length, sample, seed and token cap) and
retries cells that failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..policy import Policy, load_policy
from ..policy.model import Budget
from .engines import Engine
from .scoring import score
from .tasks import Sample, make_samples

RESULTS = "results.jsonl"


@dataclasses.dataclass(frozen=True)
class Grid:
    """What to run. ``budgets``: labels like ``"10%"``; empty means each policy's own budget.
    ``max_new_tokens`` caps every task's own answer length when set."""

    policies: tuple[Policy, ...]
    budgets: tuple[str, ...]
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    seed: int = 0
    max_new_tokens: int | None = None


def budget_label(budget: Budget) -> str:
    if budget.kind == "fraction":
        return f"{budget.value * 100:g}%"
    return f"{budget.value:g} {'tokens' if budget.kind == 'tokens' else 'bytes'}"


def configurations(grid: Grid) -> list[tuple[Policy, str]]:
    """``(policy with its budget set, budget label)``; the full-KV reference first."""
    from ..sim.simulate import parse_budget

    full = load_policy("full")
    out = [(full, budget_label(full.budget))]
    for policy in grid.policies:
        if policy.name == full.name:
            continue
        for label in grid.budgets or (budget_label(policy.budget),):
            out.append((dataclasses.replace(policy, budget=parse_budget(label)), label))
    return out


def policy_hash(policy: Policy) -> str:
    return hashlib.sha256(repr(dataclasses.replace(policy, source="")).encode()).hexdigest()[:12]


def cell_key(engine: Engine, policy: Policy, label: str, s: Sample, grid: Grid) -> str:
    parts = [
        engine.name,
        engine.model,
        policy.name,
        policy_hash(policy),
        label,
        s.key,
        grid.seed,
        grid.max_new_tokens,
    ]
    return json.dumps(parts)


def load_results(path: Path) -> list[dict[str, Any]]:
    """Records of ``path`` (a torn last line from an interrupted write is ignored)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def run_cell(engine: Engine, policy: Policy, label: str, s: Sample, cap: int | None) -> dict:
    """Generate and score one sample under one configuration; never raises for engine errors."""
    max_new = min(s.max_new_tokens, cap) if cap else s.max_new_tokens
    rec: dict[str, Any] = {
        "engine": engine.name,
        "model": engine.model,
        "policy": policy.name,
        "budget": label,
        "reference": policy.name == "full",
        "task": s.task,
        "length": s.length,
        "index": s.index,
        "tokens": s.meta.get("tokens"),
        "depth": s.meta.get("depth"),
        "answers": list(s.answers),
        "metric": s.metric,
        "max_new_tokens": max_new,
    }
    t0 = time.perf_counter()
    try:
        if len(s.turns) == 1:
            replies = [engine.generate(s.turns[0], policy, max_new)]
        else:
            replies = engine.chat(s.turns, policy, max_new)
    except Exception as e:  # noqa: BLE001  (one failing policy must not end the run)
        return {**rec, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    rec["seconds"] = time.perf_counter() - t0
    rec["prediction"] = replies[-1].text
    rec["score"] = score(replies[-1].text, s.answers, s.metric)
    rec["stats"] = dict(replies[-1].stats)
    if len(replies) > 1:
        rec["turns"] = [{"text": r.text, "stats": dict(r.stats)} for r in replies]
    return rec


def cells(grid: Grid, engine: Engine) -> Iterator[tuple[Policy, str, Sample]]:
    configs = configurations(grid)
    for task in grid.tasks:
        for length in grid.lengths:
            for s in make_samples(task, length, grid.samples, engine.count_tokens, grid.seed):
                for policy, label in configs:
                    yield policy, label, s


def run_grid(
    engine: Engine, grid: Grid, out: str | Path, *, progress: bool = True
) -> list[dict[str, Any]]:
    """Run every cell of ``grid`` not yet in ``out/results.jsonl``; return the grid's records.

    Cells whose engine call raised are recorded with an ``error`` field (and no ``score``).
    """
    path = Path(out) / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"]: r for r in load_results(path) if "error" not in r}
    todo: list[tuple[Policy, str, Sample]] = list(cells(grid, engine))
    records: list[dict[str, Any]] = []
    bar = tqdm(todo, desc="eval", unit="cell", disable=not progress)
    with open(path, "a") as f:
        for policy, label, s in bar:
            key = cell_key(engine, policy, label, s, grid)
            if key in done:
                records.append(done[key])
                continue
            bar.set_postfix_str(f"{policy.name}@{label} {s.key}")
            rec = {
                "key": key,
                "seed": grid.seed,
                **run_cell(engine, policy, label, s, grid.max_new_tokens),
            }
            f.write(json.dumps(rec) + "\n")
            f.flush()
            records.append(rec)
    return records
