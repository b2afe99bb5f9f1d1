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

import dataclasses
import difflib

from . import counting, distractor, multiturn, qa, ruler
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
    "DEPTHS", "GROUPS", "WINDOW_RESERVE", "Sample", "TaskError", "TokenCounter", "expand_tasks",
    "fit", "make_sample", "make_samples", "sample_rng", "task_names",
]  # fmt: skip
# each registers its tasks when imported
GENERATOR_MODULES = (counting, distractor, multiturn, qa, ruler)

GROUPS = {
    "ruler": (
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
    ),
    "suite": (
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
        "distractor", "multiturn", "qa",
    ),
}  # fmt: skip

# Tokens a sample leaves free in the model's context window beside its sized turn: the chat
# template, a conversation's other turns and answers (multiturn: two short turns, two replies)
# and the scored answer (at most 96 tokens, cwe).
WINDOW_RESERVE = 256


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


def make_sample(
    task: str,
    length: int,
    index: int,
    count: TokenCounter,
    seed: int = 0,
    window: int | None = None,
) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` target tokens (deterministic).

    ``window``: the model's context window. A sample must fit in it with its chat template, the
    other turns of a conversation and its answer, so the sized turn gets at most
    ``window - WINDOW_RESERVE`` tokens. The sample keeps its ``length`` label and its draws (the
    same facts, keys and depths), only its filler is shorter: a 32K cell on a 32,768-token model
    holds prompts of ~32,500 tokens.
    """
    expand_tasks([task])
    target = length if window is None else min(length, window - WINDOW_RESERVE)
    sample = _REGISTRY[task](sample_rng(seed, task, length, index), target, index, count)
    return sample if target == length else dataclasses.replace(sample, length=length)


def make_samples(
    task: str,
    length: int,
    n: int,
    count: TokenCounter,
    seed: int = 0,
    window: int | None = None,
) -> list[Sample]:
    """The first ``n`` samples of ``task`` (for ``needle``: ``n`` per depth); ``window`` as
    :func:`make_sample`."""
    total = n * len(DEPTHS) if task == "needle" else n
    return [make_sample(task, length, i, count, seed, window) for i in range(total)]
