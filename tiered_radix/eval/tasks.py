"""Evaluation samples: what a task generator produces, how it is sized, and the task registry.

Every sample is a pure function of ``(task, length, index, seed)``: the generators draw from a
``random.Random`` seeded with that tuple as a string, so results do not depend on the process
or on ``PYTHONHASHSEED``. Lengths are measured with the model's tokenizer (``TokenCounter``) on
the *user text* (the chat template adds a few dozen tokens on top); for multi-turn samples, on
the first turn, which carries the document.

Task names follow RULER: ``niah_single``, ``niah_multikey``, ``niah_multivalue``,
``niah_multiquery``, ``vt``, ``cwe``, ``fwe``; plus ``needle`` (a needle depth sweep:
sample ``i`` sits at ``DEPTHS[i % len(DEPTHS)]``) and ``multiturn`` (a fact in turn 1,
asked for in the last turn) and ``distractor`` (3-6 facts of one kind about near-duplicate
project names, with near-duplicate values; the question names one). Groups: ``ruler`` (the
seven RULER tasks), ``suite`` (those, ``distractor`` and ``multiturn``: what a policy must
hold).
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

TokenCounter = Callable[[str], int]
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


class TaskError(ValueError):
    """An unknown task name or an impossible size; the message lists the valid choices."""


@dataclass(frozen=True)
class Sample:
    """One prompt (or conversation) and what a correct answer must contain.

    ``turns`` are user messages (one for single-turn tasks); the answer to the *last* turn is
    scored. ``metric`` is ``"all"`` (every answer string must appear) or ``"part"`` (any one).
    ``meta`` holds task details: ``depth`` / ``depths`` (needle positions as fractions of the
    haystack), ``tokens`` (measured length of the sized turn), ``haystack`` kind.
    """

    task: str
    length: int
    index: int
    turns: tuple[str, ...]
    answers: tuple[str, ...]
    metric: str = "all"
    max_new_tokens: int = 32
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"

    @property
    def prompt(self) -> str:
        return self.turns[-1] if len(self.turns) == 1 else "\n\n".join(self.turns)


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"{seed}/{task}/{length}/{index}")


def fit(
    build: Callable[[int], str], target: int, count: TokenCounter, limit: int = 1 << 20
) -> tuple[str, int]:
    """The largest ``n <= limit`` with ``count(build(n)) <= target``, and its text.

    ``build(n)`` must grow with ``n`` (n filler units); one unit of slack is the tolerance.

    Raises:
        TaskError: even ``build(0)`` (the template with no filler) exceeds ``target``.
    """
    if count(build(0)) > target:
        raise TaskError(
            f"a target of {target} tokens is too short for this task's template "
            f"({count(build(0))} tokens without any filler); use a longer --lengths value"
        )
    lo, hi = 0, 1
    while hi <= limit and count(build(hi)) <= target:
        lo, hi = hi, hi * 2
    if hi > limit and count(build(limit)) <= target:
        return build(limit), limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(build(mid)) <= target else (lo, mid)
    return build(lo), lo


Generator = Callable[[random.Random, int, int, TokenCounter], Sample]
_REGISTRY: dict[str, Generator] = {}
GROUPS = {
    "ruler": (
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
    ),
    "suite": (
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
        "distractor", "multiturn",
    ),
}  # fmt: skip


def register(name: str) -> Callable[[Generator], Generator]:
    def deco(fn: Generator) -> Generator:
        _REGISTRY[name] = fn
        return fn

    return deco


def task_names() -> list[str]:
    from . import counting, distractor, multiturn, ruler  # noqa: F401  (registers them)

    return sorted(_REGISTRY)


def expand_tasks(spec: str | list[str]) -> list[str]:
    """``"ruler,needle"`` to task names, groups expanded, order kept, duplicates dropped.

    Raises:
        TaskError: an unknown name; the message lists tasks and groups and the closest match.
    """
    valid = task_names()
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in (s.strip() for s in items if s.strip()):
        if item in GROUPS:
            names = list(GROUPS[item])
        elif item in valid:
            names = [item]
        else:
            close = difflib.get_close_matches(item, valid + list(GROUPS), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise TaskError(
                f"unknown task '{item}'.{hint} Tasks: {', '.join(valid)}; "
                f"groups: {', '.join(GROUPS)}"
            )
        out += [n for n in names if n not in out]
    return out


def make_sample(task: str, length: int, index: int, count: TokenCounter, seed: int = 0) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` target tokens (deterministic)."""
    expand_tasks([task])
    return _REGISTRY[task](sample_rng(seed, task, length, index), length, index, count)


def make_samples(
    task: str, length: int, n: int, count: TokenCounter, seed: int = 0
) -> list[Sample]:
    """The first ``n`` samples of ``task`` (for ``needle``: ``n`` per depth)."""
    total = n * len(DEPTHS) if task == "needle" else n
    return [make_sample(task, length, i, count, seed) for i in range(total)]
