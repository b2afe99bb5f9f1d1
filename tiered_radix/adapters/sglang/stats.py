"""What the tiered backend reports: transitions so far, pool bytes and blocks, units per state,
the peak.

Written to the server log every :data:`LOG_EVERY_S` seconds (``tiered-radix: {...}``), when
``--kv-stats FILE`` names a file rewritten there as JSON after every routing that planned (not
a deferred one) and at SGLang's ``flush_cache`` (the GPU test and the benchmark read it; one
per rank under ``--tp``), and with SGLang's ``--enable-metrics`` exported as Prometheus series
every :data:`~.metrics.METRICS_EVERY_S` seconds (:mod:`.metrics`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tiered_radix.engine.events import KINDS, StepEvents, kinds_of

from .metrics import TierMetrics, from_server_args

log = logging.getLogger("tiered_radix.adapters.sglang.backend")
LOG_EVERY_S = 30.0
COUNTS = (*KINDS, "ledger_writes", "over_budget_routings", "borrowed_quantized")  # on the device
COUNT_EVERY = 64  # routings counted together: ~17 device ops per count, not per routing


def device_memory(device) -> dict[str, float] | None:
    """The server process's CUDA memory on ``device`` (MiB, PyTorch's caching allocator):
    ``allocated`` now, ``peak_allocated`` since startup (the most its tensors ever held at once)
    and ``reserved`` (what the cache holds, freed tensors' blocks included: what ``nvidia-smi``
    shows, less the CUDA context). A reserve far above the peak is the cache's, not demand.
    None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    mib = 1 << 20
    return {
        "allocated": round(torch.cuda.memory_allocated(device) / mib, 1),
        "peak_allocated": round(torch.cuda.max_memory_allocated(device) / mib, 1),
        "reserved": round(torch.cuda.memory_reserved(device) / mib, 1),
    }


@dataclass
class BackendStats:
    """Counters since startup. ``peak_bytes``: the most pool bytes held at the end of a forward
    (before its routing), ``peak_tokens`` the tokens the allocator held then (running requests
    and the radix tree's cache, in whole windows: what a plain bf16 pool would hold). On CUDA a
    forward whose pool counts are still on their way to the host (a routing that landed or new
    windows taken in that step: ``pool.counts_ready()``) is not waited for: the next forward's
    read counts it (under ``--kv-overlap`` the landing step's read waited for the routing's
    moves on the device).

    Two counters let a reader check the others (``bench/soak.py`` does): ``over_budget_routings``,
    routings after which a request's bytes exceeded its budget without its forced content
    (protected tokens, keep rules) explaining it, and ``borrowed_quantized``, units a request
    borrowed from the radix cache at a quantized state: its engine may promote those without
    having demoted them, so ``promote <= demote + borrowed_quantized`` over all requests."""

    routes: int = 0  # requests routed, deferred prefill routings included
    deferred_routings: int = 0  # of those, prefill chunks' under after_prefill(defer=true)
    dropped_routings: int = 0  # requests' parts of a late landing dropped: their view closed
    rows_routings: int = 0  # requests routed because a batch's new windows lacked rows
    request_decode_steps: int = 0  # decode steps summed over the requests that ran them
    peak_bytes: int = 0
    peak_tokens: int = 0
    kernel_steps: int = 0  # decode steps run by the TriZone kernel
    tokens_held: int = 0  # at the end of the last forward
    last_log: float = field(default_factory=time.monotonic)
    metrics: TierMetrics | None = None  # made at the first publish, with --enable-metrics
    metrics_checked: bool = False
    rank: int | None = None  # under --tp: the stats file is per rank (``name.rank{r}.json``)
    counts: Tensor | None = None  # int64 [len(COUNTS)] on the device
    path: str | None = None  # --kv-stats: the JSON file rewritten after every routing
    # routings not yet counted: (transitions with moves, routed steps, device) each
    uncounted: list = field(default_factory=list)

    def forward_done(self, pool, tokens: int) -> None:
        self.tokens_held = tokens
        if not pool.counts_ready():
            return
        used = pool.bytes_used()
        if used > self.peak_bytes:
            self.peak_bytes, self.peak_tokens = used, tokens

    def _add(self, add: Tensor) -> None:
        self.counts = add if self.counts is None else self.counts + add

    def routed(self, moves: list, device: torch.device, stores: list = ()) -> None:
        """Count a routing's transitions (one ``Transitions`` per routed request) on ``device``,
        and the routed ``stores`` (``TierStore``, after any settling) whose last routing ended
        over budget without its forced content explaining it, without a host sync: :meth:`moved`
        reads them. A store whose routing was deferred is not counted. The device work is done
        for :data:`COUNT_EVERY` routings at once, or when :meth:`moved` reads the counts."""
        self.routes += len(moves)
        steps = [s.events.steps[-1] for s in stores if not s.deferred and s.events.steps]
        parts = [m for m in moves if len(m)]
        if parts or steps:
            self.uncounted.append((parts, steps, device))
            if len(self.uncounted) >= COUNT_EVERY:
                self._count()

    def _count(self) -> None:
        """The uncounted routings' transitions per kind, ledger copies and unforced
        over-budget steps, added to :attr:`counts` in one pass (a ``kinds_of`` per evict tier
        index: stores of several policies may route together)."""
        if not self.uncounted:
            return
        device = self.uncounted[-1][2]
        parts = [m for p, _, _ in self.uncounted for m in p]
        steps = [s for _, st, _ in self.uncounted for s in st]
        self.uncounted = []
        add = torch.zeros(len(COUNTS), dtype=torch.long, device=device)
        if steps:
            add[COUNTS.index("over_budget_routings")] = StepEvents.count_unforced(steps, device)
        for ev in dict.fromkeys(m.evict_index for m in parts):
            cols = [m.on(device, "src", "dst", "ledger_write") for m in parts
                    if m.evict_index == ev]  # fmt: skip
            src, dst, wrote = (torch.cat([c[i] for c in cols]) for i in range(3))
            add[: len(KINDS)] += torch.bincount(kinds_of(src, dst, ev), minlength=len(KINDS))
            add[len(KINDS)] += wrote.sum()
        self._add(add)

    def borrowed(self, quantized: Tensor) -> None:
        """A request opened on a radix hit borrowed ``quantized`` units (a 0-d device count)
        at a quantized state (no host sync)."""
        add = torch.zeros(len(COUNTS), dtype=torch.long, device=quantized.device)
        add[COUNTS.index("borrowed_quantized")] = quantized
        self._add(add)

    def moved(self) -> dict[str, int]:
        """Transitions so far per kind, ledger copies written, over-budget routings and
        borrowed quantized units (one host sync)."""
        self._count()
        c = [0] * len(COUNTS) if self.counts is None else self.counts.tolist()
        return dict(zip(COUNTS, c, strict=True))

    def snapshot(self, pool, requests: int, decode: str, kernel_error: str | None) -> dict:
        """Pool bytes and blocks in use, transitions so far and the peak (a bf16 pool would
        hold ``peak_tokens * bf16_bytes_per_token``; ``bf16_bytes_held`` for the tokens held
        now). ``units``: (layer, head, window) units per owner state; ``blocks``: blocks in use
        per representation (``pool.occupancy()``). Two device-to-host copies (the occupancy
        counts, the 4 transition counts)."""
        per_token = 2 * 2 * pool.layer_num * pool.head_num * pool.head_dim
        units, blocks = pool.occupancy()
        rows_free, ledger_free = pool.blocks_free()
        return {
            "requests": requests,
            "pool_bytes_used": pool.bytes_used(),
            "tokens_held": self.tokens_held,
            "bf16_bytes_held": self.tokens_held * per_token,
            "units": units,
            "blocks": blocks,
            "row_blocks_free": rows_free,
            "ledger_blocks_free": ledger_free,
            "routes": self.routes,
            "deferred_routings": self.deferred_routings,
            "dropped_routings": self.dropped_routings,
            "rows_routings": self.rows_routings,
            "request_decode_steps": self.request_decode_steps,
            **self.moved(),
            "degraded_moves": getattr(pool, "degraded", 0),  # moves short of blocks (pool.move)
            "zone_full_routings": getattr(pool, "zone_full", 0),  # repacks with no room (rdkv)
            **getattr(pool, "reclaimed", {}),  # cached rows demoted / evicted for new tokens
            "peak_bytes": self.peak_bytes,
            "peak_tokens": self.peak_tokens,
            "bf16_bytes_per_token": per_token,
            "decode": decode,
            "kernel_steps": self.kernel_steps,
            "kernel_error": kernel_error,
            "device_memory": device_memory(pool.device),
        }

    def publish(self, snapshot, routed: bool) -> None:
        """After a forward: rewrite the stats file after a routing, update the Prometheus series
        at most every :data:`~.metrics.METRICS_EVERY_S` and log at most every
        :data:`LOG_EVERY_S`. ``snapshot()`` (two host syncs) runs only when one of them is due."""
        if not self.metrics_checked:
            self.metrics_checked = True
            self.metrics = from_server_args()
        now = time.monotonic()
        path = self.path if routed else None
        if path and self.rank is not None:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{self.rank}{ext}"
        export = self.metrics is not None and self.metrics.due(now)
        log_due = now - self.last_log >= LOG_EVERY_S
        if not (path or export or log_due):
            return
        snap = snapshot()
        if path:
            with open(path, "w") as f:
                json.dump(snap, f)
        if export:
            self.metrics.update(snap, now)
        if log_due:
            self.last_log = now
            log.info("tiered-radix: %s", snap)
