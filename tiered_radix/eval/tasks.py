"""The task catalogue: names, groups, and the samples of a task (the generators live in
:mod:`.ruler`, :mod:`.counting`, :mod:`.distractor` and :mod:`.multiturn`; what they produce
in :mod:`.sample`).

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

from . import counting, distractor, multiturn, ruler
from .sample import (
    _REGISTRY,
    DEPTHS,
    Sample,
    TaskError,
    TokenCounter,
    fit,
    sample_rng,
)

__all__ = [
    "DEPTHS", "GROUPS", "Sample", "TaskError", "TokenCounter", "expand_tasks", "fit",
    "make_sample", "make_samples", "sample_rng", "task_names",
]  # fmt: skip
# each registers its tasks when imported
GENERATOR_MODULES = (counting, distractor, multiturn, ruler)

GROUPS = {
    "ruler": (
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
    ),
    "suite": (
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
        "distractor", "multiturn",
    ),
}  # fmt: skip


def task_names() -> list[str]:
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
