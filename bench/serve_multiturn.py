"""Multi-turn serving on one GPU, same KV memory for every system (issue 20).

Per system (``--systems``: plain bf16, fp8 KV, HiCache, tiered policies at a budget, a policy
file of one's own as ``PATH.yaml@10%``) this
starts an OpenAI-compatible SGLang server whose KV pool spends ``--kv-gib`` (or the bytes of
``--kv-tokens`` bf16 tokens), runs the same seeded conversations (``bench/serving/workload.py``:
private long histories, short new questions, a recall question in the last turn) under each
``--arrivals`` mode (Poisson at a rate, or saturation at a concurrency; the radix cache is
flushed between modes), and stops it by its PID. Results in ``--out``:

- ``records/<system>.<arrival>.jsonl``: one line per request (TTFT, TPOT, prompt, cached and
  output tokens, the answer, errors);
- ``serve-summary.json``: one row per system and arrival: output tokens/s, TTFT and TPOT
  p50/p99, radix hit rate, re-prefilled tokens, recall, peak GPU memory, pool bytes (rows of
  earlier runs into the same folder with the same workload are kept: systems can be measured
  in separate calls);
- ``serve.png``: output tokens/s and TTFT p50 per system; ``<system>.log``: server logs.

A system whose server fails to start gets rows with its ``error`` and the run goes on.
How each system's flags come from one byte target: ``bench/serving/servers.py``.

    python3 bench/serve_multiturn.py --model /tmp/models/qwen2.5-0.5b --preset quick --out OUT
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from serving import report
from serving.client import Load, run_load
from serving.servers import (
    GpuMemory,
    KVGeometry,
    Server,
    ServerOptions,
    System,
    pool_from_log,
    server_command,
)
from serving.stats import summarize
from serving.workload import PRESETS, Scale, TokenSizer, workload

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = "bf16,fp8,hicache,qevict@10%,qevict@25%,rdkv@10%"
# per preset: KV room (bf16 tokens: conversations x tokens each) and arrival modes
KV_TOKENS = {"full": 16 * 20_000, "quick": 4 * 4_000}
ARRIVALS = {"full": "poisson:1,saturation:32", "quick": "saturation:8"}
RUN_TIMEOUT_S = {"full": 3600.0, "quick": 180.0}  # per system and arrival


def parse_scale(base: Scale, spec: str | None) -> Scale:
    """``base`` with ``conversations=N,turns=N,history=MIN:MAX,output=MIN:MAX,question=N``."""
    if not spec:
        return base
    fields = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key in ("history", "output"):
            lo, _, hi = value.partition(":")
            fields[f"{key}_min"], fields[f"{key}_max"] = int(lo), int(hi or lo)
        elif key in ("conversations", "turns"):
            fields[key] = int(value)
        elif key == "question":
            fields["question_tokens"] = int(value)
        else:
            raise ValueError(f"unknown --scale key {key!r}")
    return dataclasses.replace(base, **fields)


def parse_load(spec: str, args) -> Load:
    """``poisson:RATE`` (conversations a second, at most ``--max-inflight`` at once) or
    ``saturation:CONCURRENCY``."""
    mode, _, value = spec.partition(":")
    timeouts = dict(seed=args.seed, request_timeout_s=args.request_timeout,
                    run_timeout_s=args.run_timeout)  # fmt: skip
    if mode == "poisson":
        return Load("poisson", args.max_inflight, rate=float(value), **timeouts)
    if mode == "saturation":
        return Load("saturation", int(value), **timeouts)
    raise ValueError(f"unknown arrival {spec!r}: poisson:RATE or saturation:N")


def _gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "none"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("TR_COMMIT", "unknown")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("TR_MODEL_PATH", "/tmp/models/qwen2.5-0.5b"))
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--scale", help="override the preset: conversations=N,turns=N,"
                   "history=MIN:MAX,output=MIN:MAX,question=N")  # fmt: skip
    p.add_argument(
        "--systems",
        default=SYSTEMS,
        help=f"comma separated (default {SYSTEMS.replace('%', '%%')}); a policy file of your "
        "own as PATH.yaml@BUDGET",
    )
    p.add_argument("--arrivals", help="comma separated poisson:RATE / saturation:N "
                   f"(default per preset: {ARRIVALS})")  # fmt: skip
    p.add_argument("--rate", type=float, help="Poisson arrivals, conversations a second "
                   "(with --concurrency and --arrivals: each mode is run)")  # fmt: skip
    p.add_argument("--concurrency", type=int, help="saturation: conversations in flight")
    p.add_argument("--kv-gib", type=float, help="KV pool bytes per system, GiB")
    p.add_argument(
        "--kv-tokens",
        type=int,
        help=f"KV pool as bf16 tokens of the model (default per preset: {KV_TOKENS})",
    )
    p.add_argument(
        "--max-inflight", type=int, default=64, help="poisson: most conversations in flight at once"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="conversations of another seed sent (all at once) before the measured loads, the "
        "cache flushed after: JIT compiles and allocator growth out of the numbers, their "
        "seconds recorded as warmup_s (0: none)",
    )
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--hicache-gb", type=float, default=40.0)
    p.add_argument("--graph-max-bs", type=int, default=32)
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument(
        "--start-together",
        action="store_true",
        help="launch every system's server at once (ports --port, --port + 10, ...) and run "
        "the loads one system at a time: the start-ups overlap (each server's peak GPU memory "
        "is then its own processes')",
    )
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--run-timeout",
        type=float,
        help=f"seconds per system and arrival (default per preset: {RUN_TIMEOUT_S})",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="stop at EOS (default: every answer has its drawn length)",
    )
    p.add_argument("--commit", default=None, help="recorded in the summary (default: git HEAD)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/serve-multiturn")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--dry-run", action="store_true", help="print each system's server command; start nothing"
    )
    return p.parse_args(argv)


class SystemRun:
    """One system's server through its life: started, waited for (``/health``), then its
    ``warm`` conversations and every load, then stopped; one row per load, a failure anywhere
    recorded as the rows' ``error``. ``alone``: the GPU's only user while it runs, so its peak
    memory is the device's over the baseline before the launch; else (``--start-together``)
    the peak of its own processes (:class:`~serving.servers.GpuMemory` with a PID)."""

    def __init__(self, system, kv_bytes, geometry, opts, args, *, alone: bool = True) -> None:
        name = system.name.replace("%", "")
        self.system, self.args, self.alone = system, args, alone
        self.server = Server(server_command(system, kv_bytes, geometry, opts), opts.port,
                             args.out / f"{name}.log")  # fmt: skip
        self.base = {
            "system": system.label, "budget": system.budget, "name": system.name,
            "pool_tokens_flag": system.pool_tokens(kv_bytes, geometry),
            "command": self.server.cmd[1:], "started_together": not alone,
        }  # fmt: skip
        self.error: Exception | None = None
        self.memory: GpuMemory | None = None
        self._t0 = 0.0

    def start(self) -> None:
        # beside other servers: one nvidia-smi call every 2 s per server, not 2 a second
        every = 0.5 if self.alone else 2.0
        self.memory = GpuMemory(every, pid=None if self.alone else lambda: self.server.pid)
        self.memory.__enter__()
        self._t0 = time.time()
        self.server.start()

    def wait(self) -> None:
        """Until healthy (``startup_s`` from the launch), then the server's own figures."""
        try:
            left = self.args.start_timeout - (time.time() - self._t0)
            self.server.wait_healthy(max(left, 1.0))
            self.base["startup_s"] = round(time.time() - self._t0, 1)
            info = self.server.info()
            self.base["max_total_num_tokens"] = info.get("max_total_num_tokens")
            self.base["pool"] = pool_from_log(self.server.log_tail(1 << 20))
            # SGLang's own GB figures (weights, kvcache: the pool's get_kv_size_bytes, graphs)
            states = info.get("internal_states") or [{}]
            self.base["memory_usage_gb"] = states[0].get("memory_usage")
        except Exception as err:  # noqa: BLE001 - recorded in the system's rows
            self.error = err

    def run(self, convs, loads, warm=()) -> list[dict]:
        """The warm-up and every load (after :meth:`wait`), then the server stopped."""
        args, rows = self.args, []
        try:
            if self.error is not None:
                raise self.error
            base = self.base
            if warm:
                base.update(_warm_up(self.server, warm, args))
            for i, load in enumerate(loads):
                # None: the cache was new
                flushed = None if i == 0 and not warm else self.server.flush_cache()
                if flushed is False:
                    print(f"[{self.system.name}] flush_cache failed: a warm cache", file=sys.stderr)
                recs = asyncio.run(
                    run_load(self.server.url, convs, load, ignore_eos=not args.no_ignore_eos,
                             progress=not args.no_progress)
                )  # fmt: skip
                name = self.system.name.replace("%", "")
                path = args.out / "records" / f"{name}.{load.label.replace(':', '-')}.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(json.dumps(r) + "\n" for r in recs))
                row = dict(base, arrival=load.label, flushed=flushed, **summarize(recs))
                tiered = _tiered_stats(self.server)
                if tiered:
                    row["tiered"] = tiered
                rows.append(row)
                print(f"[{self.system.name}] {load.label}: {_brief(rows[-1])}", flush=True)
        except Exception as err:  # noqa: BLE001 - recorded in the system's rows; on to the next
            print(f"[{self.system.name}] failed: {str(err)[:2000]}", file=sys.stderr)
            done = {r["arrival"] for r in rows}
            rows += [dict(self.base, arrival=ld.label, error=str(err)[-4000:])
                     for ld in loads if ld.label not in done]  # fmt: skip
        finally:
            self.stop()
        released = self.memory.wait_released() if self.alone else None
        for r in rows:
            r["peak_gpu_mib"] = self.memory.peak_mib  # over the server's life, all its loads
            r["gpu_released"] = released
        return rows

    def stop(self) -> None:
        self.server.stop()
        if self.memory is not None:
            self.memory.__exit__(None, None, None)


def run_system(system, convs, loads, kv_bytes, geometry, opts, args, warm=()) -> list[dict]:
    """Start ``system``'s server alone on the GPU, send it the ``warm`` conversations, run
    every load, stop it; one row per load."""
    run = SystemRun(system, kv_bytes, geometry, opts, args)
    run.start()
    run.wait()
    return run.run(convs, loads, warm)


def together(systems, kv_bytes, geometry, opts, args) -> list[SystemRun]:
    """``--start-together``: one run per system on ports ``port``, ``port + 10``, ...; the
    caller starts them all, waits for each, then runs the loads one system at a time, so the
    start-ups (compiles, graph captures) overlap."""
    return [SystemRun(s, kv_bytes, geometry, dataclasses.replace(opts, port=opts.port + 10 * i),
                      args, alone=False) for i, s in enumerate(systems)]  # fmt: skip


def _warm_up(server: Server, warm, args) -> dict:
    """The ``warm`` conversations, all in flight at once (a fresh server compiles its kernels
    for the batch shapes it meets first): their wall seconds and failed requests."""
    load = Load("saturation", len(warm), seed=args.seed, request_timeout_s=args.request_timeout,
                run_timeout_s=args.run_timeout)  # fmt: skip
    t0 = time.time()
    recs = asyncio.run(run_load(server.url, warm, load, ignore_eos=not args.no_ignore_eos,
                                progress=False))  # fmt: skip
    return {"warmup_s": round(time.time() - t0, 1),
            "warmup_errors": sum(1 for r in recs if r.get("error"))}  # fmt: skip


# what a tiered server's stats (/server_info) say about a load: where its rows and ledger stood,
# what new tokens took from the radix cache, and its host seconds per phase
TIERED_KEYS = ("tokens_held", "units", "blocks", "row_blocks_free", "ledger_blocks_free",
               "cached_windows_demoted", "cached_tokens_evicted", "degraded_moves",
               "over_budget_routings", "routes", "rows_routings", "host_s",
               "cuda_bytes")  # fmt: skip


def _tiered_stats(server: Server) -> dict | None:
    """The tiered backend's stats after a load (running totals since the start), or None for
    a server without ``--kv-policy``."""
    states = server.info().get("internal_states") or [{}]
    stats = states[0].get("tiered_radix")
    return {k: stats[k] for k in TIERED_KEYS if k in stats} if stats else None


def _brief(row: dict) -> str:
    """One line of a row; for a tiered server also its decode steps run without graphs and the
    host seconds it spent routing (running totals since its start)."""
    keys = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "hit_rate", "recall",
            "errors")  # fmt: skip
    line = ", ".join(
        f"{k}={row[k]:.3g}" if isinstance(row.get(k), float) else f"{k}={row.get(k)}" for k in keys
    )
    host = (row.get("tiered") or {}).get("host_s")
    if host:
        eager, steps = int(host.get("graph_too_long", 0)), int(host.get("decode_steps", 0))
        line += f", eager_steps={eager}/{steps}, route_s={host.get('route', 0):.3g}"
    return line


def main(argv=None) -> int:
    args = parse_args(argv)
    # `timeout` sends SIGTERM: exit through the `finally` that stops the running server
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    args.out = args.out.resolve()
    args.run_timeout = args.run_timeout or RUN_TIMEOUT_S[args.preset]
    try:  # what the command line names: a bad value stops here, with its reason
        scale = parse_scale(PRESETS[args.preset], args.scale)
        systems = [System.parse(s) for s in args.systems.split(",") if s.strip()]
        specs = [s for s in (args.arrivals or "").split(",") if s]
        if args.rate is not None:
            specs.append(f"poisson:{args.rate:g}")
        if args.concurrency is not None:
            specs.append(f"saturation:{args.concurrency}")
        loads = [parse_load(s, args) for s in specs or ARRIVALS[args.preset].split(",")]
        geometry = KVGeometry.of_model(args.model)
    except ValueError as e:
        raise SystemExit(f"serve_multiturn.py: {e}") from None
    if args.kv_gib is not None:
        kv_bytes = int(args.kv_gib * (1 << 30))
    else:
        kv_bytes = (args.kv_tokens or KV_TOKENS[args.preset]) * geometry.bytes_per_token()
    context = scale.max_context() + 1024  # chat template tokens, answers re-tokenized
    opts = ServerOptions(
        model=args.model, port=args.port, context_length=context, mem_fraction=args.mem_fraction,
        graph_max_bs=args.graph_max_bs, hicache_gb=args.hicache_gb,
        extra=tuple(args.server_args.split()),
    )  # fmt: skip
    t0 = time.time()
    sizer = TokenSizer.for_model(args.model)
    convs = workload(args.seed, scale, sizer)
    print(f"workload: {len(convs)} conversations x {scale.turns} turns, history "
          f"{min(c.history_tokens for c in convs)}-{max(c.history_tokens for c in convs)} "
          f"tokens ({'tokenizer' if sizer.exact else 'approximate'}), "
          f"{time.time() - t0:.1f}s; KV {kv_bytes / (1 << 30):.3f} GiB per system")  # fmt: skip
    if args.dry_run:
        for system in systems:
            print(system.name, " ".join(server_command(system, kv_bytes, geometry, opts)[1:]))
        return 0
    # the warm-up's own seed: none of its histories is a prefix of a measured one
    warm = []
    if args.warmup > 0:
        warm = workload(args.seed + 1, dataclasses.replace(scale, conversations=args.warmup), sizer)
    meta = {
        "gpu": _gpu_name(), "commit": args.commit or _commit(), "model": args.model,
        "kv_bytes": kv_bytes, "kv_bytes_per_bf16_token": geometry.bytes_per_token(),
        "preset": args.preset, "scale": dataclasses.asdict(scale), "seed": args.seed,
        "sizer": "tokenizer" if sizer.exact else "approximate",
        "history_tokens": [c.history_tokens for c in convs], "ignore_eos": not args.no_ignore_eos,
        "warmup_conversations": args.warmup, "command": sys.argv,
    }  # fmt: skip
    runs = together(systems, kv_bytes, geometry, opts, args) if args.start_together else []
    try:
        for r in runs:
            r.start()
        for r in runs:
            r.wait()
        for i, system in enumerate(systems):
            if runs:
                rows = runs[i].run(convs, loads, warm)
            else:
                rows = run_system(system, convs, loads, kv_bytes, geometry, opts, args, warm)
            summary = report.merge(meta, rows, args.out)
            try:
                report.plot(summary, args.out / "serve.png")
            except ImportError as err:  # the summary is what counts; the plot can be redrawn
                print(f"no plot: {err}", file=sys.stderr)
    finally:  # a timeout's SIGTERM while servers wait their turn: none outlives the benchmark
        for r in runs:
            r.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
