"""Soak (issue 21): one SGLang server per shipped policy under a long, rough load.

Per policy (``--policies``, default every ``policies/*.yaml``) this starts
``python -m sglang.launch_server --model-path M --kv-policy P --context-length 32768
--mem-fraction-static 0.5 --enable-metrics --enable-cache-report`` (``bench/serving/servers.py``
runs and stops it by its PID), takes the start snapshot, sends ``--requests`` requests (default
1,000) from ``--clients`` concurrent clients (default 32): prompts of 1K-30K tokens,
continuations that hit the radix cache, 10% of the sessions disconnecting mid-stream, prompts
longer than the context, empty prompts, max_tokens 0 and 1, bursts of 64
(``bench/serving/soak_workload.py``, ``soak_client.py``), then takes the end snapshot and
checks (``soak_checks.py``): no crash, no NaN/inf logprob, free slots back at their start, the
pool empty after a flush, no routing over budget, consistent counters, a 400 for every
too-long prompt. ``--minutes`` stops starting sessions after that long (in-flight requests get
``--grace`` more seconds), so one policy fits a ~9-minute GPU call at a reduced
``--requests``. ``--parallel N`` soaks N policies at once on one GPU (servers on ``--port``,
``--port + 10``, ...; started one after another, each waiting for the last to be healthy so
each sizes its pool from what the others left), each pool capped at ``--kv-gib`` GiB of KV
(``--max-total-tokens``: the slots the policy's own cell size fits in those bytes,
``sizing.cell_bytes``; every policy gets the same bytes). Writes to ``--out``:
``soak-summary.json`` (``gpu``, ``commit``, one row per policy, with how it was run; rows of
earlier runs into the same folder are kept), ``records/<policy>.jsonl`` (one line per
request), ``<policy>.log`` (the server's log). Exit status 0 when every row passed.

    python3 bench/soak.py --model /tmp/models/qwen2.5-0.5b --policies qevict --requests 200 \\
        --minutes 4 --out bench/results/soak-qevict --commit COMMIT
    python3 bench/soak.py --policies qevict,rdkv --parallel 2 --kv-gib 8 --minutes 4 ...
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `serving`, also under python -P

from serving.servers import GpuMemory, Server, ServerError  # noqa: E402
from serving.soak_checks import ROW_KEYS, check_schema, merge, parse_prometheus, row  # noqa: E402
from serving.soak_client import SoakRun  # noqa: E402
from serving.soak_workload import SoakScale, plan  # noqa: E402
from serving.workload import TokenSizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROBE = "Reply with the word OK."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/tmp/models/qwen2.5-0.5b")
    p.add_argument("--policies", default=None, help="comma list (default: policies/*.yaml)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--burst", type=int, default=64, help="requests sent together (0: none)")
    p.add_argument("--prompt", default="1000:30000", help="prompt tokens MIN:MAX")
    p.add_argument("--minutes", type=float, default=60.0, help="no session starts after this")
    p.add_argument("--grace", type=float, default=120.0, help="seconds in-flight requests get")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--max-total-tokens", type=int, default=None, help="cap the pool's slots")
    p.add_argument("--parallel", type=int, default=1, help="policies soaked at once")
    p.add_argument(
        "--kv-gib",
        type=float,
        default=None,
        help="each pool's KV bytes (GiB; --max-total-tokens from the policy's cell)",
    )
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--port", type=int, default=31200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/soak")
    p.add_argument("--commit", default=None, help="recorded in the summary (default: git)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands only")
    return p.parse_args(argv)


def pool_tokens(args, policy: str) -> int | None:
    """``--max-total-tokens`` for ``policy``: ``--max-total-tokens`` itself, or the slots its
    cell size (``sizing.cell_bytes`` at its own default budget) fits in ``--kv-gib``."""
    if args.max_total_tokens or not args.kv_gib:
        return args.max_total_tokens
    from serving.servers import KVGeometry

    from tiered_radix.policy import load_policy

    p = load_policy(policy)
    return int(args.kv_gib * (1 << 30)) // KVGeometry.of_model(args.model).tiered_cell(p, p.budget)


def server_command(args, policy: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
        "--host", "127.0.0.1", "--port", str(args.port), "--kv-policy", policy,
        "--context-length", str(args.context), "--mem-fraction-static", str(args.mem_fraction),
        "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip
    if tokens := pool_tokens(args, policy):
        cmd += ["--max-total-tokens", str(tokens)]
    return cmd + args.server_args.split()


def _post_json(url: str, body: dict, timeout: float = 120.0) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def snapshot(server: Server) -> dict[str, float]:
    """Flush the radix cache (retried while aborted requests drain), send the probe, read
    ``/metrics`` (see ``soak_checks``)."""
    t0 = time.time()
    flushed = server.flush_cache()
    while not flushed and time.time() - t0 < 120:
        time.sleep(2)
        flushed = server.flush_cache()
    time.sleep(1.5)  # the tiered gauges export at most once a second
    body = {"model": "default", "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "user", "content": PROBE}]}  # fmt: skip
    status = _post_json(server.url + "/v1/chat/completions", body)
    time.sleep(1.0)  # SGLang reports a prefill's pool gauges after streaming its output
    snap = parse_prometheus(server.metrics())
    snap["probe_status"], snap["flushed"] = status, flushed
    return snap


def soak_policy(
    args, policy: str, scale: SoakScale, sizer: TokenSizer, started: threading.Event | None = None
) -> dict:
    """One policy's soak on its own server (``args.port``): its row. ``started`` is set once
    the server is healthy or gave up (the next parallel server starts then). The row's
    ``gpu_peak_mib``: the most GPU memory the server's processes held (``nvidia-smi``, every
    2 s; None without it): a server beside others must stay near its pool and graphs (GPU run
    32's h2o server grew to 53.5 GiB beside an 8 GiB pool)."""
    sessions, bursts = plan(args.seed, scale, sizer)
    log = args.out / f"{policy}.log"
    server = Server(server_command(args, policy), args.port, log)
    memory = GpuMemory(every_s=2.0, pid=lambda: server.proc.pid if server.proc else None)
    with memory:  # polls while the server runs
        try:
            server.start()
            try:
                startup = server.wait_healthy(args.startup_timeout)
            finally:
                if started is not None:
                    started.set()
            start = snapshot(server)
            from tqdm import tqdm

            bar = tqdm(total=scale.requests, desc=policy, unit="req", disable=args.no_progress,
                       mininterval=2)  # fmt: skip
            deadline = args.minutes * 60
            run = SoakRun(server.url, "default", deadline, deadline + args.grace, bar)
            records = asyncio.run(run.run(sessions, bursts, scale.clients))
            bar.close()
            alive = server.healthy()
            end = snapshot(server) if alive else {}
            alive = alive and server.healthy()
            out = row(policy, records, start, end, alive=alive, not_sent=run.not_sent)
            out |= {"startup_s": round(startup, 1), "load_s": round(run.now(), 1),
                    "probe_status": [start.get("probe_status"), end.get("probe_status")],
                    "flushed": [start.get("flushed"), end.get("flushed")]}  # fmt: skip
            rec = args.out / "records" / f"{policy}.jsonl"
            rec.parent.mkdir(parents=True, exist_ok=True)
            rec.write_text("".join(json.dumps(r) + "\n" for r in records))
        except ServerError as err:
            out = dict.fromkeys(ROW_KEYS) | {"policy": policy, "ok": False, "crashes": 1,
                                              "error": str(err)[-4000:]}  # fmt: skip
        finally:
            server.stop()
    out["gpu_peak_mib"] = memory.peak_mib
    tail = log.read_text(errors="replace") if log.exists() else ""
    out["log_tracebacks"] = tail.count("Traceback (most recent call last)")
    out["log_leak_warnings"] = tail.count("memory leak detected")
    out["backend"] = backend_paths(tail)
    return out


def backend_paths(log_text: str) -> dict | None:
    """What the tiered backend ran, from the last stats line of its server log (``tiered-radix:
    {...}``, every 30 s): its decode and extend paths (``kernel`` or ``gather``), kernel steps,
    a kernel error if one sent it to PyTorch, its CUDA memory (``device_memory``: MiB allocated,
    the peak allocated, and reserved by PyTorch's cache), and the share of decode steps under
    CUDA graphs (SGLang's ``Decode batch`` lines, ``cuda graph: True``). None without a stats
    line."""
    import ast

    stats = None
    for line in log_text.splitlines():
        at = line.find("tiered-radix: {")
        if at >= 0:
            try:
                stats = ast.literal_eval(line[at + len("tiered-radix: ") :])
            except (ValueError, SyntaxError):
                continue
    if stats is None:
        return None
    decodes = [x for x in log_text.splitlines() if "Decode batch" in x]
    graphed = sum("cuda graph: True" in x for x in decodes)
    keys = ("decode", "extend", "kernel_steps", "kernel_error", "device_memory")
    return {k: stats.get(k) for k in keys} | {
        "decode_log_lines": len(decodes),
        "graphed_share": round(graphed / len(decodes), 3) if decodes else None,
    } | graph_buffers(log_text)


def graph_buffers(log_text: str) -> dict:
    """The decode graphs' capacity and buffers from the backend's startup line (``tiered-radix:
    decode CUDA graphs up to batch B, T tokens, M MiB of buffers``): ``graph_tokens`` and
    ``graph_buffers_mib``, None without the line (graphs off)."""
    import re

    m = re.search(r"decode CUDA graphs up to batch \d+, (\d+) tokens, ([\d.]+) MiB", log_text)
    return {"graph_tokens": int(m[1]) if m else None,
            "graph_buffers_mib": float(m[2]) if m else None}  # fmt: skip


def soak_together(args, policies: list[str], scale: SoakScale, sizer: TokenSizer) -> list[dict]:
    """Soak ``policies`` at once, one server each on ``--port``, ``--port + 10``, ...: the
    servers start one after another (each sizes its pool from the memory the others left),
    the loads run together. Their rows, in ``policies``' order."""
    if len(policies) == 1:
        return [soak_policy(args, policies[0], scale, sizer)]
    events = [threading.Event() for _ in policies]

    def one(i: int) -> dict:
        if i:
            events[i - 1].wait()
        mine = copy.copy(args)
        mine.port = args.port + 10 * i
        return soak_policy(mine, policies[i], scale, sizer, started=events[i])

    with ThreadPoolExecutor(len(policies)) as pool:
        return list(pool.map(one, range(len(policies))))


def _gpu() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "none"


def _commit(args) -> str:
    if args.commit:
        return args.commit
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                         text=True)  # fmt: skip
    return git.stdout.strip() or "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    lo, _, hi = args.prompt.partition(":")
    scale = SoakScale(requests=args.requests, clients=args.clients, context=args.context,
                      prompt_min=int(lo), prompt_max=int(hi or lo), burst=args.burst)  # fmt: skip
    shipped = sorted(p.stem for p in (ROOT / "policies").glob("*.yaml"))
    policies = args.policies.split(",") if args.policies else shipped
    sizer = TokenSizer.for_model(args.model)
    if args.dry_run:
        sessions, bursts = plan(args.seed, scale, sizer)
        kinds = {}
        for s in sessions + [s for g in bursts for s in g]:
            kinds[s.kind] = kinds.get(s.kind, 0) + len(s.turns)
        print(json.dumps({"sessions": len(sessions), "bursts": [len(g) for g in bursts],
                          "requests_by_kind": kinds, "sizer_exact": sizer.exact}))  # fmt: skip
        for p in policies:
            print(" ".join(server_command(args, p)))
        return 0
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server
    meta = {"gpu": _gpu(), "commit": _commit(args), "model": args.model,
            "parallel": args.parallel, "kv_gib": args.kv_gib,
            "scale": {"requests": scale.requests, "clients": scale.clients,
                      "prompt": [scale.prompt_min, scale.prompt_max], "burst": scale.burst,
                      "minutes": args.minutes, "context": args.context,
                      "mem_fraction": args.mem_fraction, "seed": args.seed},
            "sizer_exact": sizer.exact}  # fmt: skip
    rows, summary = [], {}
    try:
        step = max(1, args.parallel)
        for i in range(0, len(policies), step):
            group = policies[i : i + step]
            for got in soak_together(args, group, scale, sizer):
                # how this row was run (the summary keeps rows of earlier runs)
                got |= {"soaked_with": group, "mem_fraction": args.mem_fraction,
                        "pool_tokens_flag": pool_tokens(args, got["policy"])}  # fmt: skip
                rows.append(got)
                brief = {k: got.get(k) for k in ("policy", "ok", "requests", "aborted",
                         "errors_4xx", "unexpected", "timeouts", "crashes", "nan_outputs",
                         "free_slots_start", "free_slots_end", "held_bytes_after_flush",
                         "over_budget_routings", "error")}  # fmt: skip
                print(json.dumps(brief)[:1500], flush=True)
                if not got.get("ok"):
                    print(json.dumps(got.get("checks"))[:800], flush=True)
            summary = merge(meta, rows, args.out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    check_schema(summary)
    return 0 if rows and all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
