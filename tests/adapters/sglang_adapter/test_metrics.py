"""Prometheus metrics of the tiered backend: with SGLang's ``--enable-metrics`` (server args
published, ``$PROMETHEUS_MULTIPROC_DIR`` set) the series that ``/metrics`` would serve, read back
through a ``MultiProcessCollector`` as SGLang's HTTP server does, equal the pool's own state and
the transitions the routings applied; counters never go down; updates are rate-limited; without
metrics nothing is created."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from sglang_sim import POLICY, require

require("sglang.srt.observability.metrics_collector")
prometheus_client = require("prometheus_client")

from prometheus_client import CollectorRegistry, multiprocess, values  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from test_backend import Harness  # noqa: E402

from tiered_radix.adapters.sglang import metrics  # noqa: E402

ROUTING_POLICY = POLICY.replace("schedule: after_prefill", "schedule: after_prefill, every(2)")
LABELS = {"model_name": "tiny", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


@pytest.fixture
def prom(tmp_path, monkeypatch):
    """A fresh multiprocess directory and value store, and a fresh default registry: each test
    sees only its own series, as a new server would."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    monkeypatch.setattr(prometheus_client, "REGISTRY", CollectorRegistry())
    return tmp_path


def serve(monkeypatch, enable: bool | None) -> None:
    """Publish server args as SGLang's scheduler does (``None``: none published)."""
    args = None
    if enable is not None:
        args = SimpleNamespace(enable_metrics=enable, served_model_name="tiny",
                               disaggregation_mode="null", extra_metric_labels=None)  # fmt: skip
    monkeypatch.setattr(get_context(), "_server_args", args)


def scrape(path) -> dict[tuple[str, tuple], float]:
    """What ``/metrics`` serves: ``{(sample name, sorted extra labels): value}`` of our series."""
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(path))
    out = {}
    for fam in text_string_to_metric_families(prometheus_client.generate_latest(reg).decode()):
        for s in fam.samples:
            if s.name.startswith(metrics.P):
                extra = {k: v for k, v in s.labels.items() if k not in LABELS}
                assert {k: s.labels[k] for k in LABELS} == LABELS, s
                out[s.name, tuple(sorted(extra.items()))] = s.value
    return out


def expected(h: Harness, moves: Counter) -> dict[tuple[str, tuple], float]:
    """The series from the pool itself (python counts over its tables and free lists) and the
    transitions recorded at the radix tree; ``peak`` and ``requests`` from the backend."""
    pool, alloc, snap = h.sim.pool, h.sim.alloc, h.backend.stats()
    own = pool.owner_all.flatten().tolist()
    names = ("full", "quantized", "restored", "evicted", "archived")
    blk = pool.block_all.transpose(0, 1).flatten(1).tolist()  # [kind FULL, Q, R][...]
    tokens = alloc.size - alloc.available_size()
    row_bytes = 2 * pool.layout.window * pool.head_dim * 2  # K and V, bf16
    rows_used = sum(pool.blocks.full - len(f) for f in pool.free_rows)
    ledger_used = sum(pool.blocks.quant - len(f) for f in pool.free_q)
    P = metrics.P
    out = {
        (P + "kv_bytes", ()): rows_used * row_bytes + ledger_used * pool.page_bytes,
        (P + "kv_peak_bytes", ()): snap["peak_bytes"],
        (P + "kv_bf16_bytes", ()): tokens * 2 * 2 * h.sim.L * h.sim.H * h.sim.d,
        (P + "kv_tokens", ()): tokens,
        (P + "row_blocks_free", ()): sum(len(f) for f in pool.free_rows),
        (P + "ledger_blocks_free", ()): sum(len(f) for f in pool.free_q),
        (P + "requests", ()): len(h.backend.sessions),
        (P + "routes_total", ()): moves["routes"],
        (P + "rows_routings_total", ()): moves["rows"],
        (P + "deferred_routings_total", ()): moves["deferred"],
        (P + "dropped_routings_total", ()): 0,  # routings land at once here (no overlap)
        (P + "request_decode_steps_total", ()): moves["decode_steps"],
        (P + "promotions_total", ()): moves["promote"],
        (P + "demotions_total", ()): moves["demote"],
        (P + "evictions_total", ()): moves["evict"],
        (P + "ledger_writes_total", ()): moves["ledger"],
        (P + "kernel_decode_steps_total", ()): 0,
        (P + "over_budget_routings_total", ()): moves["over"],
        (P + "borrowed_quantized_total", ()): moves["borrowed"],
        (P + "degraded_moves_total", ()): pool.degraded,
        (P + "zone_full_routings_total", ()): pool.zone_full,
        (P + "cached_windows_demoted_total", ()): pool.reclaimed["cached_windows_demoted"],
        (P + "cached_tokens_evicted_total", ()): pool.reclaimed["cached_tokens_evicted"],
        (P + "archived_copies_dropped_total", ()): pool.reclaimed["archived_copies_dropped"],
    }
    out |= {(P + "units", (("state", s),)): own.count(i) for i, s in enumerate(names)}
    for kind, row in zip(("full", "ledger", "restored"), blk, strict=True):
        out[P + "blocks", (("kind", kind),)] = sum(b > 0 for b in row)
    assert out[P + "blocks", (("kind", "ledger"),)] == ledger_used  # tables agree with the lists
    full, restored = (
        out[P + "blocks", (("kind", "full"),)],
        out[P + "blocks", (("kind", "restored"),)],
    )
    assert full + restored == rows_used
    return out


def record(h: Harness) -> Counter:
    """Count, at the radix tree, every transition a routing applies (one by one, not through
    the backend's counters), the units views borrow at the quantized state, and routings that
    leave a request's engine over its budget with its forced content within it (the engine's
    own bytes and budget, with the forced bytes the planner reports)."""
    from tiered_radix.adapters.sglang.reps import S_Q

    cache = h.sim.cache
    moves, route_many, open_view = Counter(), cache.route_many, cache.open_view

    def routed(many):
        for rid, transitions in many:
            moves["routes"] += 1
            for t in transitions[:]:
                moves[t.kind] += 1
                moves["ledger"] += t.ledger_write
            store = h.backend.sessions[rid].store
            if store.deferred:  # a prefill chunk's routing put off: no step recorded
                moves["deferred"] += 1
                continue
            step = store.events.steps[-1]
            moves["over"] += bool(store.bytes_used() > step.budget and not step.forced)
            moves["rows"] += step.reason == "rows short"
        return route_many(many)

    def opened(req, prefix_len):
        view = open_view(req, prefix_len)
        moves["borrowed"] += int((view.state == S_Q).sum())
        return view

    def stepped(reqs, tokens, extend):
        moves["decode_steps"] += 0 if extend else len(reqs)
        return step(reqs, tokens, extend=extend)

    cache.route_many, cache.open_view = routed, opened
    step, h.step = h.step, stepped
    return moves


def test_series_equal_the_pool_and_the_transitions(prom, monkeypatch):
    serve(monkeypatch, True)
    monkeypatch.setattr(metrics, "METRICS_EVERY_S", 0.0)  # every forward exports
    h = Harness(policy=ROUTING_POLICY)
    moves = record(h)
    a = h.start("a", list(range(1, 39)))
    h.step([a], [a.origin_input_ids], extend=True)
    assert h.backend.counters.metrics is not None
    got = scrape(prom)
    assert got == expected(h, moves)
    assert got[metrics.P + "demotions_total", ()] > 0  # the prefill's routing demoted units
    before = got
    for t in range(4):  # a routes every 2 decode steps
        h.step([a], [[50 + t]], extend=False)
        got = scrape(prom)
        assert got == expected(h, moves), t
        assert all(v >= before[k] for k, v in got.items() if k[0].endswith("_total")), t
        before = got
    h.finish(a)  # the tree keeps a's windows at the states a left them
    b = h.start("b", a.tokens + [90, 91, 92])  # a second turn: borrows a's windows
    c = h.start("c", list(range(20, 40)))
    assert b.prefix_len > 0
    h.step([b, c], [b.origin_input_ids[b.prefix_len :], c.origin_input_ids], extend=True)
    restored = 0  # the pool counts restored row blocks on the host: they must meet the table
    for t in range(4):
        h.step([b, c], [[60 + t], [70 + t]], extend=False)
        got = scrape(prom)
        assert got == expected(h, moves), t
        assert all(v >= before[k] for k, v in got.items() if k[0].endswith("_total")), t
        before = got
        restored = max(restored, got[metrics.P + "blocks", (("kind", "restored"),)])
    assert moves["routes"] >= 8 and moves["promote"] > 0 and got[metrics.P + "requests", ()] == 2
    assert moves["borrowed"] > 0  # b borrowed a's quantized windows
    assert moves["promote"] <= moves["demote"] + moves["borrowed"]
    assert restored > 0
    units = {k[1][0][1]: v for k, v in got.items() if k[0] == metrics.P + "units"}
    assert units["full"] > 0 and units["quantized"] > 0 and units["evicted"] > 0


def test_updates_are_rate_limited(prom, monkeypatch):
    serve(monkeypatch, True)
    monkeypatch.setattr(metrics, "METRICS_EVERY_S", 3600.0)
    h = Harness(policy=ROUTING_POLICY)
    moves = record(h)
    a = h.start("a", list(range(1, 39)))
    h.step([a], [a.origin_input_ids], extend=True)  # the first publish exports
    first = scrape(prom)
    assert first == expected(h, moves)
    for t in range(3):
        h.step([a], [[50 + t]], extend=False)
    assert moves["routes"] > 1  # the state moved on...
    assert scrape(prom) == first  # ...but no update within the interval
    h.backend.counters.metrics.last -= 3600.0
    h.step([a], [[60]], extend=False)
    assert scrape(prom) == expected(h, moves)


@pytest.mark.parametrize("enable", [None, False])
def test_nothing_is_created_without_metrics(prom, monkeypatch, enable):
    serve(monkeypatch, enable)
    h = Harness(policy=ROUTING_POLICY)
    a = h.start("a", list(range(1, 39)))
    h.step([a], [a.origin_input_ids], extend=True)
    h.step([a], [[50]], extend=False)
    assert h.backend.counters.metrics_checked and h.backend.counters.metrics is None
    assert list(prom.iterdir()) == []  # no value files
    names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith(metrics.P) for n in names)


def test_a_routing_counts_over_budget_only_where_forced_content_does_not_explain_it():
    """``over_budget_routings``: a step over its budget counts unless its forced content was
    over by itself; a deferred store (no new step) is not counted again; a settled step
    raised above its plan counts."""
    import torch

    from tiered_radix.adapters.sglang.stats import BackendStats
    from tiered_radix.engine.events import StepEvents, Transitions

    empty = torch.zeros(0, dtype=torch.long)
    none = Transitions.from_flat(("full",), None, empty, (1, 1, 1), empty, empty, empty)

    def store(used, budget, forced, deferred=False):
        t = torch.tensor
        ev = StepEvents(0, "r", none, t(used), budget, t(forced) | (t(used) > budget), t(forced))
        return SimpleNamespace(deferred=deferred, events=SimpleNamespace(steps=[ev]))

    stats = BackendStats()
    within, forced, over = store(10, 20, False), store(30, 20, True), store(30, 20, False)
    stats.routed([none] * 3, torch.device("cpu"), [within, forced, over])
    assert stats.moved()["over_budget_routings"] == 1
    stats.routed([none], torch.device("cpu"), [store(30, 20, False, deferred=True)])
    assert stats.moved()["over_budget_routings"] == 1
    within.events.steps[-1].mark_over(torch.tensor(True))  # a degraded move kept units higher
    stats.routed([none], torch.device("cpu"), [within])
    assert stats.moved() == dict(demote=0, promote=0, evict=0, ledger_writes=0,
                                 over_budget_routings=2, borrowed_quantized=0)  # fmt: skip
    stats.borrowed(torch.tensor(5))
    assert stats.moved()["borrowed_quantized"] == 5
