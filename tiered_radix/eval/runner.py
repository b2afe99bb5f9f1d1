"""Run a (policy, budget, task, length, sample) grid and keep every result in a JSONL cache.

Full KV (the shipped ``full`` policy at its own 100% budget) is always the first configuration:
it is the reference every retention figure divides by. Samples are the outer loop, so a run cut
short still has every configuration on its first samples. Each finished cell is appended to
``results.jsonl`` at once; a rerun with the same grid skips the cells already there (keyed by
model, policy name and content hash, budget, task, length, sample, seed and token cap) and
retries cells that failed.

Shared prefill: when the engine has ``prefill``/``decode`` (:class:`~.engines.SharedPrefill`)
and ``Grid.shared_prefill`` is on, a single-turn sample is prefilled once and every
configuration decodes from it (multi-turn samples run each configuration from scratch). A policy
with a single tier (``kivi``: every unit int2) cannot trade bytes for anything, so it runs once,
at its own budget, whatever ``budgets`` says. ``deadline`` (a ``time.monotonic()`` value) stops
the run before the next *sample* once passed: every configuration has the same samples.

An engine with ``answer_batch`` (:class:`~.sglang_engine.SGLangEngine`: a server per
configuration) turns the loops around: configurations outer, each answering every sample not
yet done in one call; its deadline falls between configurations.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..policy import Policy, load_policy
from ..policy.model import Budget
from .engines import Engine, Reply
from .scoring import score
from .tasks import DEPTHS, Sample, make_sample

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
    shared_prefill: bool = True
    stop_when_answered: bool = False  # end a decode once every answer string is in the text
    shard: tuple[int, int] = (0, 1)  # (i, n): only samples whose index is i modulo n


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
        own = (budget_label(policy.budget),)
        for label in own if len(policy.tiers) == 1 else grid.budgets or own:
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
    variant = getattr(engine, "variant", "")  # numerics other than the adapter's own
    parts += [variant] if variant else []
    parts += ["stop-when-answered"] if grid.stop_when_answered else []
    return json.dumps(parts)


_LENGTH = re.compile(r"^(\d+(?:\.\d+)?)([kK]?)$")


def parse_length(text: str) -> int:
    """``"1k"`` -> 1024, ``"1.5k"`` -> 1536, ``"800"`` -> 800: a grid's context length.

    Raises:
        ValueError: not a token count.
    """
    m = _LENGTH.match(text.strip())
    if not m:
        raise ValueError(f"bad length {text!r}: use a token count like 800, 1k or 2k")
    return int(float(m.group(1)) * (1024 if m.group(2) else 1))


def parse_shard(text: str) -> tuple[int, int]:
    """``"1/4"`` -> ``(1, 4)``: the second of four processes splitting a grid's samples.

    Raises:
        ValueError: not ``I/N`` with ``0 <= I < N``.
    """
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"bad shard {text!r}: use I/N with 0 <= I < N, e.g. 0/4")
    return i, n


def merge_results(dirs: list[Path]) -> list[dict[str, Any]]:
    """The records of every ``DIR/results.jsonl`` (shards of one grid, or runs to show in one
    table), one per cell key; a scored record beats one that failed.

    Raises:
        FileNotFoundError: a folder without ``results.jsonl``.
    """
    out: dict[str, dict[str, Any]] = {}
    for d in dirs:
        path = Path(d) / RESULTS
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        for r in load_results(path):
            if r["key"] not in out or "error" in out[r["key"]]:
                out[r["key"]] = r
    return list(out.values())


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


def sample_fields(
    s: Sample, *, engine: str, model: str, policy: str, budget: str, reference: bool, max_new: int
) -> dict[str, Any]:
    """The fields every results.jsonl row carries about its configuration and sample (the
    kvpress runner writes its rows with the same function)."""
    return {
        "engine": engine,
        "model": model,
        "policy": policy,
        "budget": budget,
        "reference": reference,
        "task": s.task,
        "length": s.length,
        "index": s.index,
        "tokens": s.meta.get("tokens"),
        "depth": s.meta.get("depth"),
        "answers": list(s.answers),
        "metric": s.metric,
        "max_new_tokens": max_new,
    }


def run_cell(
    engine: Engine,
    policy: Policy,
    label: str,
    s: Sample,
    cap: int | None,
    prefill: Any = None,
    stop_when_answered: bool = False,
) -> dict:
    """Generate and score one sample under one configuration; never raises for engine errors.
    ``prefill``: the sample's shared prefill (an exception if it failed), or None."""
    max_new = answer_cap(s, cap)
    t0 = time.perf_counter()
    try:
        if isinstance(prefill, Exception):
            raise prefill
        if prefill is not None:
            answers = s.answers if stop_when_answered else ()
            replies = [engine.decode(prefill, policy, max_new, answers)]
        elif len(s.turns) == 1:
            replies = [engine.generate(s.turns[0], policy, max_new)]
        else:
            replies = engine.chat(s.turns, policy, max_new)
    except Exception as e:  # noqa: BLE001  (one failing policy must not end the run)
        replies = e
    return record(engine, policy, label, s, max_new, replies, time.perf_counter() - t0)


def record(
    engine: Engine, policy: Policy, label: str, s: Sample, max_new: int,
    replies: Sequence[Reply] | Exception, seconds: float,
) -> dict:  # fmt: skip
    """One cell's row: the sample's fields and either the scored last reply (with every turn
    for multi-turn samples) or the error."""
    rec = sample_fields(
        s, engine=engine.name, model=engine.model, policy=policy.name, budget=label,
        reference=policy.name == "full", max_new=max_new,
    )  # fmt: skip
    rec["seconds"] = seconds
    if isinstance(replies, Exception):
        return {**rec, "error": f"{type(replies).__name__}: {replies}"}
    rec["prediction"] = replies[-1].text
    rec["score"] = score(replies[-1].text, s.answers, s.metric)
    rec["stats"] = dict(replies[-1].stats)
    if len(replies) > 1:
        rec["turns"] = [{"text": r.text, "stats": dict(r.stats)} for r in replies]
    return rec


def answer_cap(s: Sample, cap: int | None) -> int:
    """New tokens a sample may generate: its task's own cap, lowered by ``cap`` when given."""
    return min(s.max_new_tokens, cap) if cap else s.max_new_tokens


def _per_task(grid: Grid) -> dict[str, int]:
    """Samples of each task per length (the needle sweep: ``samples`` per depth)."""
    return {t: grid.samples * (len(DEPTHS) if t == "needle" else 1) for t in grid.tasks}


def samples(grid: Grid, engine: Engine) -> Iterator[Sample]:
    """Round-robin over (task, length): sample 0 of each, then sample 1 of each, ... so a run
    stopped by its deadline has about as many samples of every task and length. With
    ``grid.shard = (i, n)``, samples ``i, i + n, ...`` only (several processes split a grid)."""
    pairs = [(task, length) for task in grid.tasks for length in grid.lengths]
    per = _per_task(grid)
    i0, n = grid.shard
    for i in range(i0, max(per.values(), default=0), n):  # lazily: long prompts take a while
        for task, length in pairs:
            if i < per[task]:
                yield make_sample(
                    task, length, i, engine.count_tokens, grid.seed, engine.context_window
                )


def run_grid(
    engine: Engine,
    grid: Grid,
    out: str | Path,
    *,
    progress: bool = True,
    deadline: float | None = None,
) -> list[dict[str, Any]]:
    """Run every cell of ``grid`` not yet in ``out/results.jsonl``; return the grid's records
    (those of the samples reached before ``deadline``, if given).

    Cells whose engine call raised are recorded with an ``error`` field (and no ``score``).
    """
    path = Path(out) / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"]: r for r in load_results(path) if "error" not in r}
    configs = configurations(grid)
    i0, every = grid.shard
    n = sum(len(range(i0, per, every)) for per in _per_task(grid).values())
    shared = grid.shared_prefill and hasattr(engine, "prefill") and hasattr(engine, "decode")
    records: list[dict[str, Any]] = []
    total = n * len(grid.lengths) * len(configs)
    bar = tqdm(total=total, desc="eval", unit="cell", disable=not progress)
    if hasattr(engine, "answer_batch"):
        with bar, open(path, "a") as f:
            _run_by_configuration(engine, grid, configs, done, records, f, bar, deadline)
        return records
    with bar, open(path, "a") as f:
        for s in samples(grid, engine):
            if deadline is not None and time.monotonic() > deadline:
                break
            prefill = prefill_peak = None
            for policy, label in configs:
                bar.update(1)
                key = cell_key(engine, policy, label, s, grid)
                if key in done:
                    records.append(done[key])
                    continue
                bar.set_postfix_str(f"{policy.name}@{label} {s.key}")
                if shared and prefill is None and len(s.turns) == 1:
                    _cuda_peak_mib()
                    prefill = _prefill(engine, s, [p for p, _ in configs])
                    prefill_peak = _cuda_peak_mib()
                cap, stop = grid.max_new_tokens, grid.stop_when_answered
                _cuda_peak_mib()
                rec = {"key": key, "seed": grid.seed,
                       **run_cell(engine, policy, label, s, cap, prefill, stop)}  # fmt: skip
                peak = _cuda_peak_mib()
                if peak is not None:  # which phase holds the memory (run 7: 30-38 GB at 32K)
                    rec["cuda_peak_mib"] = peak
                    if prefill is not None:
                        rec["prefill_cuda_peak_mib"] = prefill_peak
                f.write(json.dumps(rec) + "\n")
                f.flush()
                records.append(rec)
    return records


def _run_by_configuration(engine, grid, configs, done, records, f, bar, deadline) -> None:
    """An engine with ``answer_batch`` (one server per configuration): configurations outer,
    every sample not yet done answered in one call; ``deadline`` is checked between
    configurations."""
    todo = list(samples(grid, engine))
    cap = grid.max_new_tokens
    for policy, label in configs:
        if deadline is not None and time.monotonic() > deadline:
            break
        pending = []
        for s in todo:
            key = cell_key(engine, policy, label, s, grid)
            if key in done:
                records.append(done[key])
                bar.update(1)
            else:
                pending.append((s, key))
        if not pending:
            continue
        bar.set_postfix_str(f"{policy.name}@{label}: {len(pending)} samples")
        max_new = [answer_cap(s, cap) for s, _ in pending]
        t0 = time.perf_counter()
        got = engine.answer_batch(policy, label, [s.turns for s, _ in pending], max_new)
        seconds = (time.perf_counter() - t0) / len(pending)
        got = [got] * len(pending) if isinstance(got, Exception) else got
        for (s, key), m, replies in zip(pending, max_new, got, strict=True):
            rec = {"key": key, "seed": grid.seed,
                   **record(engine, policy, label, s, m, replies, seconds)}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
            records.append(rec)
            bar.update(1)
        f.flush()


def _cuda():
    """torch, where this process has used CUDA (the runner itself never imports torch)."""
    torch = sys.modules.get("torch")
    ok = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch if ok else None


_process_peak = [0]  # MiB: the process's peak across _cuda_peak_mib's resets


def _cuda_peak_mib() -> int | None:
    """CUDA memory allocated at peak (MiB) since the last call, then reset (None without
    CUDA); :func:`process_cuda_peak_mib` keeps the process's peak."""
    torch = _cuda()
    if torch is None:
        return None
    peak = int(torch.cuda.max_memory_allocated() >> 20)
    _process_peak[0] = max(_process_peak[0], peak)
    torch.cuda.reset_peak_memory_stats()
    return peak


def process_cuda_peak_mib() -> int | None:
    """Peak CUDA memory this process allocated (MiB; None without CUDA), through the per-cell
    resets: how many shards fit a GPU."""
    torch = _cuda()
    if torch is None:
        return None
    return max(_process_peak[0], int(torch.cuda.max_memory_allocated() >> 20))


def _prefill(engine, s: Sample, policies: list[Policy]):
    try:
        return engine.prefill(s.turns[0], policies)
    except Exception as e:  # noqa: BLE001  (recorded in each of the sample's cells)
        return e
