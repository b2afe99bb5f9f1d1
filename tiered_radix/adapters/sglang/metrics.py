"""Prometheus metrics of the tiered KV cache, exported through SGLang's ``/metrics``.

With ``--enable-metrics`` SGLang runs prometheus_client in multiprocess mode (the launcher sets
``$PROMETHEUS_MULTIPROC_DIR`` before the scheduler starts; the HTTP server merges every process's
files). :func:`from_server_args` creates this process's series the same way SGLang's
``SchedulerMetricsCollector`` does: ``sglang:`` names, gauges in ``mostrecent`` mode, and the
labels ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank`` (plus ``--extra-metric-labels``).

:meth:`TierMetrics.update` maps a :meth:`~.stats.BackendStats.snapshot` onto them: gauges are
set, counters grow by the change of the snapshot's running totals. The backend updates them at
most every :data:`METRICS_EVERY_S` seconds (:meth:`~.stats.BackendStats.publish`).
"""

from __future__ import annotations

import math
import weakref

from .reps import STATE_NAMES

METRICS_EVERY_S = 1.0
P = "sglang:tiered_"
GAUGES = {  # snapshot key -> (metric name, help)
    "pool_bytes_used": ("kv_bytes", "Bytes of KV blocks the tiered pool holds (rows and pages)."),
    "peak_bytes": ("kv_peak_bytes", "Most KV bytes held at the end of a forward since startup."),
    "bf16_bytes_held": ("kv_bf16_bytes", "Bytes a bf16 KV pool would need for the held tokens."),
    "tokens_held": ("kv_tokens", "Tokens the allocator holds (running and radix-cached)."),
    "row_blocks_free": ("row_blocks_free", "Free row blocks (one head-window of K and V)."),
    "ledger_blocks_free": ("ledger_blocks_free", "Free ledger pages (one quantized head-window)."),
    "requests": ("requests", "Requests with a tier session in the attention backend."),
}
COUNTERS = {  # snapshot running total -> (metric name, help); exported with a _total suffix
    "routes": ("routes", "Routings run (one request's tier engine planning and moving units)."),
    "rows_routings": (
        "rows_routings",
        "Routings run early because a forward's new windows lacked full-precision rows.",
    ),
    "deferred_routings": (
        "deferred_routings",
        "Prefill chunks' routings put off to the first decode step (counted in routes).",
    ),
    "dropped_routings": (
        "dropped_routings",
        "Requests' parts of a one-step-late routing dropped because their view had closed.",
    ),
    "request_decode_steps": (
        "request_decode_steps",
        "Decode steps summed over the requests that ran them (a batch of 8 counts 8).",
    ),
    "promote": ("promotions", "Units moved to a more precise tier."),
    "demote": ("demotions", "Units moved to a less precise tier (not evictions)."),
    "evict": ("evictions", "Units evicted."),
    "ledger_writes": ("ledger_writes", "Quantized ledger copies written."),
    "kernel_steps": ("kernel_decode_steps", "Decode steps run by the TriZone kernel."),
    "over_budget_routings": (
        "over_budget_routings",
        "Routings that left a request over its budget beyond its forced content.",
    ),
    "borrowed_quantized": (
        "borrowed_quantized",
        "Units requests borrowed from the radix cache quantized (promotable, never demoted).",
    ),
    "degraded_moves": ("degraded_moves", "Moves the pool was short of blocks for (degraded)."),
    "zone_full_routings": (
        "zone_full_routings",
        "Decoupled routings whose pages found no room in the Zone A store (read what they held).",
    ),
    "cached_windows_demoted": (
        "cached_windows_demoted",
        "Radix-cached windows whose rows went to their ledger copies to make room for new tokens.",
    ),
    "cached_tokens_evicted": (
        "cached_tokens_evicted",
        "Radix-cached tokens evicted to make room in the row blocks for new tokens.",
    ),
    "archived_copies_dropped": (
        "archived_copies_dropped",
        "Archived ledger copies (evict(archive=...)) dropped to make room for routings' copies.",
    ),
}
UNITS = (f"{P}units", "(layer, KV head, window) units of the cache by the owner's state.")
BLOCK_KINDS = ("full", "restored", "ledger")
BLOCKS = (f"{P}blocks", "Blocks in use by representation: full rows, restored rows, ledger.")

_FAMILIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> its series


def _families(labels: tuple[str, ...], registry) -> dict:
    """This process's metric families in ``registry``, created once (prometheus_client refuses
    a name twice in one registry)."""
    fam = _FAMILIES.get(registry)
    if fam is None:
        from prometheus_client import Counter, Gauge

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, [*labels, *extra], registry=registry,
                         multiprocess_mode="mostrecent")  # fmt: skip

        fam = {k: gauge(P + n, doc) for k, (n, doc) in GAUGES.items()}
        fam |= {
            k: Counter(P + n, doc, labels, registry=registry) for k, (n, doc) in COUNTERS.items()
        }
        fam["units"], fam["blocks"] = gauge(*UNITS, ["state"]), gauge(*BLOCKS, ["kind"])
        _FAMILIES[registry] = fam
    return fam


class TierMetrics:
    """The tiered cache's series with one set of label values; counters start from zero."""

    def __init__(self, labels: dict[str, str], registry=None) -> None:
        import prometheus_client

        registry = registry if registry is not None else prometheus_client.REGISTRY
        self.labels = {k: str(v) for k, v in labels.items()}
        fam = _families(tuple(self.labels), registry)
        self.series = {k: fam[k].labels(**self.labels) for k in (*GAUGES, *COUNTERS)}
        self.units = {s: fam["units"].labels(**self.labels, state=s) for s in STATE_NAMES}
        self.blocks = {k: fam["blocks"].labels(**self.labels, kind=k) for k in BLOCK_KINDS}
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.last = -math.inf

    def due(self, now: float) -> bool:
        """Whether :data:`METRICS_EVERY_S` has passed since the last update (``now``: seconds of
        ``time.monotonic``)."""
        return now - self.last >= METRICS_EVERY_S

    def update(self, snap: dict, now: float) -> None:
        """Set the gauges from ``snap`` and grow the counters by what its totals added."""
        self.last = now
        for k in GAUGES:
            self.series[k].set(snap[k])
        for k in COUNTERS:
            if snap[k] > self.totals[k]:  # totals only grow; a counter never goes down
                self.series[k].inc(snap[k] - self.totals[k])
                self.totals[k] = snap[k]
        for s, n in snap["units"].items():
            self.units[s].set(n)
        for k, n in snap["blocks"].items():
            self.blocks[k].set(n)


def _rank(name: str) -> int:
    from sglang.srt.distributed import parallel_state

    try:
        return getattr(parallel_state, name)()
    except AssertionError:  # no process group (a CPU test, an offline engine before init)
        return 0


def from_server_args(registry=None) -> TierMetrics | None:
    """The metrics of this scheduler process when SGLang runs with ``--enable-metrics``, else
    ``None`` (also where no server arguments were published: tests, scripts)."""
    from sglang.srt.server_args import get_global_server_args

    try:
        args = get_global_server_args()
    except ValueError:  # "Global server args is not set yet!"
        return None
    if not getattr(args, "enable_metrics", False):
        return None
    from sglang.srt.disaggregation.utils import DisaggregationMode

    labels = {
        "model_name": args.served_model_name,
        "engine_type": DisaggregationMode.to_engine_type(args.disaggregation_mode),
        "tp_rank": _rank("get_tensor_model_parallel_rank"),
        "pp_rank": _rank("get_pipeline_model_parallel_rank"),
    }
    labels.update(getattr(args, "extra_metric_labels", None) or {})
    return TierMetrics(labels, registry)
