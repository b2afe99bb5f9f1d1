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
    assert span is not None
    lines = Path(span.file).read_text(encoding="utf-8").splitlines()
    assert Path(span.file).resolve().parent in (ERRORS, policies_dir().resolve())
    assert 1 <= span.line <= max(len(lines), 1)
    if lines:
        assert 1 <= span.col <= len(lines[span.line - 1]) + 1


def test_goldens_have_cases() -> None:
    """A golden without its .yaml is a leftover from a renamed case."""
    assert {g.stem for g in ERRORS.glob("*.txt")} <= {c.stem for c in CASES}


# ---- regressions: gaps in the checks found while writing the goldens, since fixed ----------

_RANK = "budget: 10%\nunits: token\nallocate: {method: rank, by: position}\n"


def test_channel_signal_through_a_score_is_refused() -> None:
    text = _RANK.replace("by: position", "by: s") + "scores: {s: qnorm}\n"
    text += "tiers: {full: keep(bf16), evicted: evict}\n"
    with pytest.raises(PolicyError, match="does not apply to token/window units") as info:
        compile_text(text, "gap.yaml")
    assert "(used by score 's')" in info.value.message
    assert (info.value.span.line, info.value.span.col) == (3, 30)  # the `s` after `by:`


def test_channel_signal_through_a_chain_of_scores_is_refused() -> None:
    text = _RANK.replace("by: position", "by: t") + "scores: {s: knorm * 2, t: s + attn}\n"
    text += "tiers: {full: keep(bf16), evicted: evict}\n"
    with pytest.raises(PolicyError, match="signal 'knorm' \\(used by score 't'\\)"):
        compile_text(text, "gap.yaml")


def test_token_signal_through_a_score_is_refused_on_channel_units() -> None:
    text = (
        "budget: 10%\nunits: {k: channel, v: token}\nscores: {s: attn}\n"
        "allocate: {method: rate_distortion, v_weight: attn, sigma: 1, k_weight: s}\n"
    )
    with pytest.raises(PolicyError, match="signal 'attn' \\(used by score 's'\\) does not apply"):
        compile_text(text, "gap.yaml")


def test_a_score_of_the_right_kind_is_accepted() -> None:
    text = _RANK.replace("by: position", "by: s") + "scores: {s: attn * 2}\n"
    text += "tiers: {full: keep(bf16), evicted: evict}\n"
    assert compile_text(text, "ok.yaml").allocate.by.id == "s"


def test_empty_tiers_say_so() -> None:
    with pytest.raises(PolicyError, match="`tiers:` lists no tiers"):
        compile_text(_RANK + "tiers: {}\n", "gap.yaml")


def test_description_error_names_the_key() -> None:
    text = _RANK + "tiers: {full: keep(bf16)}\ndescription: {a: 1}\n"
    with pytest.raises(PolicyError, match="`description` must be a single value"):
        compile_text(text, "gap.yaml")
