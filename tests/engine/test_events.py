"""The event log: every routing step with its transitions by default; with ``keep`` (a server's
stores: ``TierStore(history=1)``) only the last ones keep their transitions, so a request's moved
units do not stay on the device for its life, and then no counters."""

from __future__ import annotations

import pytest
import torch
from test_store import signals

from tiered_radix import load_policy
from tiered_radix.engine.events import EventLog
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.model import Budget

L, H, D = 2, 2, 16


def _routed(history: int | None, routings: int = 4) -> TierStore:
    """An h2o store at half the bytes fed a prompt of 400 tokens, then a token and a routing at
    a time."""
    g, n = torch.Generator().manual_seed(0), 400
    store = TierStore(load_policy("h2o"), n_layers=L, n_heads=H, head_dim=D, history=history,
                      budget_override=Budget("fraction", 0.5))  # fmt: skip
    for li in range(L):
        store.append(li, torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g))
        store.observe(li, signals(g, torch.ones(H, n, dtype=torch.bool), D, True))
    store.route("after_prefill")
    for step in range(routings - 1):
        for li in range(L):
            t = store.n_tokens(li)
            store.append(li, torch.randn(H, 1, D, generator=g), torch.randn(H, 1, D, generator=g))
            store.observe(li, signals(g, torch.ones(H, t + 1, dtype=torch.bool), D, False))
        store.route(f"decode step {step}")
    return store


def test_a_log_that_keeps_one_step_holds_the_last_transitions_and_counts_nothing():
    full, last = _routed(None), _routed(1)
    assert len(full.events.steps) == len(last.events.steps) == full.step == last.step == 4
    for a, b in zip(full.events.steps, last.events.steps, strict=True):
        assert (a.reason, a.bytes_used, a.over_budget) == (b.reason, b.bytes_used, b.over_budget)
    assert len(full.events.steps[0].transitions) > 0  # the first routing moved units
    assert [len(e.transitions) for e in last.events.steps[:-1]] == [0, 0, 0]  # let go
    a, b = full.events.steps[-1], last.events.steps[-1]
    assert list(a.transitions) == list(b.transitions)
    assert sum(full.events.counters.values()) > 0  # the routings moved units
    with pytest.raises(ValueError, match="counts nothing"):
        last.events.counters  # noqa: B018 - the property refuses


def test_a_log_keeps_at_least_one_step():
    with pytest.raises(ValueError, match="at least one step"):
        EventLog(keep=0)
