"""What the soak checks after its load, from its records and two metric snapshots.

A snapshot (:func:`parse_prometheus` of the server's ``/metrics``, SGLang's ``--enable-metrics``
series and the tiered cache's ``sglang:tiered_*``, summed over label sets) is taken twice, each
time the same way: after ``/flush_cache`` and one fixed probe request (1 new token), so the
gauges are fresh (the tiered gauges update after a forward; SGLang's pool gauges at a prefill)
and the pool holds only the probe. ``start`` is taken before the load, ``end`` after it. Then:

- ``crashes``: the server process exited or ``/health`` did not answer 200 at the end (1, else 0);
- ``nan_outputs``: requests with a logprob that is not finite;
- ``free_slots_start/end``: SGLang's free plus evictable token slots (``kv_available_tokens +
  kv_evictable_tokens``) in the two snapshots: equal, or the allocator leaked slots;
- ``held_bytes_after_flush``: the tiered pool's KV bytes at ``end`` minus at ``start``: 0, or
  the pool held blocks after the flush beyond the probe's own (free row and ledger blocks are
  compared the same way);
- ``over_budget_routings``: routings that left a request over its budget without its forced
  content explaining it (the counter, since startup): 0;
- counters consistent: ``promotions <= demotions + borrowed_quantized`` (a unit's promotion
  in a request's engine follows its demotion there or its borrowing at a quantized state);
- every request got a status its kind may get (``too_long``: 400), and none timed out.

The summary file (``soak-summary.json``: ``gpu``, ``commit``, ``rows``) keeps one row per
policy; a later run into the same folder replaces its policies' rows and keeps the others.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

SUMMARY = "soak-summary.json"
ROW_KEYS = ("policy", "requests", "aborted", "errors_4xx", "crashes", "nan_outputs",
            "free_slots_start", "free_slots_end", "over_budget_routings")  # fmt: skip
T = "sglang:tiered_"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name (``_total`` kept on counters), summed over label sets;
    ``*_created`` timestamps dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#") or m.group(1).endswith("_created"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def free_slots(snap: dict[str, float]) -> int | None:
    if "sglang:kv_available_tokens" not in snap:
        return None
    return int(snap["sglang:kv_available_tokens"] + snap.get("sglang:kv_evictable_tokens", 0))


def _get(snap: dict[str, float], name: str) -> int | None:
    return int(snap[name]) if name in snap else None


def _diff(end: dict, start: dict, name: str) -> int | None:
    a, b = _get(end, name), _get(start, name)
    return None if a is None or b is None else a - b


def row(policy: str, records: Sequence[dict], start: dict, end: dict, *, alive: bool,
        not_sent: int = 0) -> dict:  # fmt: skip
    """The policy's summary row: the issue's keys (:data:`ROW_KEYS`), the counters and the
    verdict of every check (``checks``; ``ok``: all passed)."""
    by_kind = Counter(r["kind"] for r in records)
    statuses = Counter(f"{r['kind']}:{r['status']}" for r in records)
    timeouts = sum(r["status"] == 0 for r in records)
    unexpected = [r for r in records if not r["expected"]]
    promote, demote = _get(end, T + "promotions_total"), _get(end, T + "demotions_total")
    borrowed = _get(end, T + "borrowed_quantized_total")
    over = _get(end, T + "over_budget_routings_total")
    held = _diff(end, start, T + "kv_bytes")
    rows_free = _diff(end, start, T + "row_blocks_free")
    ledger_free = _diff(end, start, T + "ledger_blocks_free")
    continuations = [r for r in records if r["turn"] > 0 and r["status"] == 200]
    out = {
        "policy": policy,
        "requests": len(records),
        "aborted": sum(bool(r["aborted"]) for r in records),
        "errors_4xx": sum(400 <= r["status"] < 500 for r in records),
        "crashes": 0 if alive else 1,
        "nan_outputs": sum(r["nonfinite"] > 0 for r in records),
        "free_slots_start": free_slots(start),
        "free_slots_end": free_slots(end),
        "over_budget_routings": over,
        "errors_5xx": sum(r["status"] >= 500 for r in records),
        "timeouts": timeouts,
        "unexpected": len(unexpected),
        "unexpected_examples": [f"{r['kind']}: {r['error']}" for r in unexpected[:5]],
        "not_sent": not_sent,
        "by_kind": dict(by_kind),
        "statuses": dict(statuses),
        "logprobs": sum(r["logprobs"] for r in records),
        "continuations": len(continuations),
        "continuations_cached_tokens": sum(r["cached_tokens"] for r in continuations),
        "held_bytes_after_flush": held,
        "row_blocks_free_change": rows_free,
        "ledger_blocks_free_change": ledger_free,
        "promotions": promote,
        "demotions": demote,
        "evictions": _get(end, T + "evictions_total"),
        "borrowed_quantized": borrowed,
        "degraded_moves": _get(end, T + "degraded_moves_total"),
        "routes": _get(end, T + "routes_total"),
    }
    counters = None
    if None not in (promote, demote, borrowed):
        counters = promote <= demote + borrowed
    out["checks"] = {
        "no_crash": alive,
        "no_nan": out["nan_outputs"] == 0,
        "statuses_as_expected": not unexpected,
        "no_timeouts": timeouts == 0,
        "too_long_got_400": by_kind["too_long"] == statuses["too_long:400"],
        "free_slots_back": out["free_slots_start"] is not None
        and out["free_slots_start"] == out["free_slots_end"],
        "pool_empty_after_flush": held == 0 and rows_free in (0, None) and ledger_free in (0, None),
        "within_budget_after_routings": over == 0,
        "counters_consistent": counters is True,
    }
    out["ok"] = all(out["checks"].values())
    return out


def merge(meta: dict, rows: list[dict], out: Path) -> dict:
    """``meta`` (``gpu``, ``commit``, ...) with the rows of ``out``'s summary, ``rows``
    replacing those of their policies; written to ``out / SUMMARY`` and returned."""
    path = out / SUMMARY
    old = json.loads(path.read_text()).get("rows", []) if path.exists() else []
    mine = {r["policy"] for r in rows}
    summary = dict(meta, rows=[r for r in old if r["policy"] not in mine] + rows)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return summary


def check_schema(summary: dict) -> None:
    """Raises ``ValueError`` where ``summary`` lacks the issue's keys."""
    missing = [k for k in ("gpu", "commit", "rows") if k not in summary]
    for r in summary.get("rows", []):
        missing += [f"{r.get('policy')}.{k}" for k in ROW_KEYS if k not in r]
    if missing:
        raise ValueError(f"soak summary lacks {', '.join(missing)}")
