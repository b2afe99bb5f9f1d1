"""Statistics of one benchmark run from its per-request records.

A record (one turn of one conversation, :class:`~.client.TurnRecord` as a dict) holds
``ok``, ``start_s``, ``end_s`` (seconds since the run began), ``ttft_s``, ``tpot_s``,
``prompt_tokens``, ``cached_tokens``, ``output_tokens``, ``prior_tokens`` (the previous turn's
prompt and output tokens; 0 on the first turn) and, for the last turn, ``recalled``.
Failed requests (``ok`` false) count in ``errors`` only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default); None if
    ``values`` is empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def hit_rate(records: Sequence[dict]) -> float | None:
    """Cached prompt tokens over prompt tokens, over the successful requests."""
    prompt = sum(r["prompt_tokens"] for r in records if r["ok"])
    cached = sum(r["cached_tokens"] for r in records if r["ok"])
    return cached / prompt if prompt else None


def reprefilled(records: Sequence[dict]) -> int:
    """Tokens the server had computed for a conversation before (its previous turn's prompt
    and answer, ``prior_tokens``) that a later turn did not find cached, summed over the
    successful requests."""
    return sum(max(0, r["prior_tokens"] - r["cached_tokens"]) for r in records if r["ok"])


def _scaled(x: float | None, k: float) -> float | None:
    return None if x is None else x * k


def summarize(records: Sequence[dict]) -> dict:
    """Throughput, latency percentiles, radix hits and recall of one run's records.

    ``output_tok_s`` is output tokens over the span from the first request's start to the last
    one's end; TPOT is per request, (last token - first token) / (output tokens - 1), over
    requests with two tokens or more; ``reprefilled_tokens`` is prompt minus cached tokens
    the history the cache had lost (:func:`reprefilled`); ``recall`` is the
    share of finished last turns whose answer holds the planted value.
    """
    ok = [r for r in records if r["ok"]]
    span = (max(r["end_s"] for r in ok) - min(r["start_s"] for r in ok)) if ok else 0.0
    out_tokens = sum(r["output_tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    last = [r for r in ok if r.get("recalled") is not None]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "duration_s": span,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / span if span > 0 else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": _scaled(percentile(tpot, 50), 1e3),
        "tpot_p99_ms": _scaled(percentile(tpot, 99), 1e3),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "hit_rate": hit_rate(records),
        "reprefilled_tokens": reprefilled(records),
        "recall": sum(bool(r["recalled"]) for r in last) / len(last) if last else None,
        "recall_n": len(last),
    }
