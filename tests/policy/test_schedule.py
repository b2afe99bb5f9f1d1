"""The schedule's ``after_prefill(defer=true)`` option: parsing and the compiled value."""

from __future__ import annotations

import pytest

from tiered_radix import PolicyError, compile_text
from tiered_radix.policy.model import Schedule

BASE = """
budget: 10%
units: window(size=32)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=32)
  evicted: evict
allocate:
  method: rank
  by: cumulative(attn, decay=0.99)
schedule: {}
"""


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("after_prefill, every(16)", Schedule(True, False, 16)),
        ("after_prefill(defer=false), every(16)", Schedule(True, False, 16)),
        ("after_prefill(defer=true), every(16)", Schedule(True, True, 16)),
        ("every(4), after_prefill(defer=true)", Schedule(True, True, 4)),
        ("after_prefill(defer = true)", Schedule(True, True)),
        ("every(8)", Schedule(False, False, 8)),
    ],
)
def test_schedule_values(text: str, want: Schedule) -> None:
    assert compile_text(BASE.format(text)).schedule == want


def test_default_schedule_routes_after_each_prefill_chunk() -> None:
    p = compile_text(BASE.format("after_prefill").replace("schedule: after_prefill\n", ""))
    assert p.schedule == Schedule() and not p.schedule.prefill_defers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("after_prefill(defer=true), after_prefill", "listed twice"),
        ("after_prefill(defer=no)", "expected: true or false"),
        ("after_prefill(evict=false)", "unexpected 'evict'"),
        ("after_prefill(demote=true)", "unexpected 'demote'"),
    ],
)
def test_schedule_errors(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        compile_text(BASE.format(text))
