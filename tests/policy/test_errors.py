"""Golden tests: the exact text of every error a broken policy file raises.

Each ``tests/policy_errors/NAME.yaml`` is loaded with ``load_policy``; ``str(err)`` must equal
``NAME.txt`` once the machine-dependent folder prefixes are replaced by ``<errors>`` and
``<policies>``. After a deliberate change of wording, rewrite the goldens with::

    UPDATE_GOLDENS=1 pytest tests/policy/test_errors.py

and review the diff by eye: every message must say where, what was expected, and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiered_radix import PolicyError, compile_text, load_policy
from tiered_radix.resources import policies_dir

ERRORS = Path(__file__).resolve().parent.parent / "policy_errors"
CASES = sorted(ERRORS.glob("*.yaml"))
UPDATE = os.environ.get("UPDATE_GOLDENS") == "1"


def _normalise(message: str) -> str:
    return message.replace(str(ERRORS), "<errors>").replace(str(policies_dir()), "<policies>")


def test_enough_cases() -> None:
    assert len(CASES) >= 15


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden_error(case: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(case)
    got = _normalise(str(info.value)) + "\n"
    golden = case.with_suffix(".txt")
    if UPDATE:
        golden.write_text(got, encoding="utf-8")
    assert golden.is_file(), f"no golden for {case.name}: run with UPDATE_GOLDENS=1 and review it"
    assert got == golden.read_text(encoding="utf-8")


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_error_points_into_a_file(case: Path) -> None:
    """Every error names a file of this folder (or a shipped one) and a line and column in it."""
    with pytest.raises(PolicyError) as info:
        load_policy(case)
    span = info.value.span
    if span is None:
        pytest.xfail("known gap: an `extends` cycle error has no file:line:col")
    lines = Path(span.file).read_text(encoding="utf-8").splitlines()
    assert Path(span.file).resolve().parent in (ERRORS, policies_dir().resolve())
    assert 1 <= span.line <= max(len(lines), 1)
    if lines:
        assert 1 <= span.col <= len(lines[span.line - 1]) + 1


def test_goldens_have_cases() -> None:
    """A golden without its .yaml is a leftover from a renamed case."""
    assert {g.stem for g in ERRORS.glob("*.txt")} <= {c.stem for c in CASES}


# ---- known gaps in the checks: strict xfail, so a fix turns them into failures to remove ----

_RANK = "budget: 10%\nunits: token\nallocate: {method: rank, by: position}\n"


@pytest.mark.xfail(strict=True, reason="bug: channel signals are not checked through a score name")
def test_channel_signal_through_a_score_is_refused() -> None:
    text = _RANK.replace("by: position", "by: s") + "scores: {s: qnorm}\n"
    text += "tiers: {full: keep(bf16), evicted: evict}\n"
    with pytest.raises(PolicyError, match="does not apply to token/window units"):
        compile_text(text, "gap.yaml")


@pytest.mark.xfail(strict=True, reason="bug: empty `tiers: {}` says every tier evicts")
def test_empty_tiers_say_so() -> None:
    with pytest.raises(PolicyError, match="no tiers"):
        compile_text(_RANK + "tiers: {}\n", "gap.yaml")


@pytest.mark.xfail(strict=True, reason="poor wording: `this key` instead of the key's name")
def test_description_error_names_the_key() -> None:
    text = _RANK + "tiers: {full: keep(bf16)}\ndescription: {a: 1}\n"
    with pytest.raises(PolicyError, match="`description` must be a single value"):
        compile_text(text, "gap.yaml")
