"""Host cost of one routing in the tiered SGLang backend (CPU harness, no GPU needed).

Drives the CPU harness of ``tests/adapters/sglang_adapter`` at Qwen2.5-0.5B's attention shapes
(24 layers, 2 KV heads, head dim 64) with a qevict-shaped policy (windows of 32, INT2, 10%,
routing after every prefill chunk, as ``examples/qevict_v1.yaml``, and every ``--every`` decode
steps) and times the routings only: ``TieredAttnBackend._route_due`` of a prefill chunk
(``route_extend``) and of a decode step (``route``). The decode kernel is stubbed (zeros, and
random attention mass for the side output, so the scores move and routings move units); the
extend runs the CPU gather path. Reported per kind of routing: the median wall ms of
``_route_due`` over the routings, and from one routing under ``torch.profiler`` the top-level
ATen ops that launch work, the host syncs (ops whose size or value the host waits for on CUDA,
``tolist``/``item``) and the ops per function. On the GPU every launching op costs the host
~5-15 us and every sync drains the queue; on this CPU the wall ms is mostly the same Python and
dispatcher overhead.

    python bench/route_host.py --batch 1 8 --out bench/results/route-host-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))

POLICY = """
policy: route-bench
budget: BUDGET%
units: window(size=32)
protect: {sinks: 4, recent: 64}
scores:
  score: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=32)
  evicted: evict
allocate: {method: rank, by: score, shares: {full: 50%, int2: 50%}, hysteresis: 10%}
schedule: after_prefill, every(EVERY)
ledger: write_once
"""

FUNCS = [  # (module, class or None, attribute): functions whose ops are listed
    ("tiered_radix.engine.planner", None, "plan_routes"),
    ("tiered_radix.engine.planner", None, "plan_route"),
    ("tiered_radix.engine.store", "TierStore", "apply"),
    ("tiered_radix.engine.store", "TierStore", "begin_routes"),
    ("tiered_radix.engine.pending", "PendingRoutes", "land"),
    ("tiered_radix.engine.coupled", "CoupledStack", "begin"),
    ("tiered_radix.engine.coupled", "CoupledStack", "finish"),
    ("tiered_radix.engine.stacked", "StackedMoves", "__init__"),
    ("tiered_radix.engine.stacked", "StackedMoves", "finish"),
    ("tiered_radix.engine.stacked", "StackedMoves", "nbytes"),
    ("tiered_radix.engine.store", "TierStore", "_applied"),  # before 797f61e
    ("tiered_radix.engine.store", "TierStore", "finish_apply"),
    ("tiered_radix.engine.store", "TierStore", "_bytes"),
    ("tiered_radix.engine.events", "Transitions", "on"),
    ("tiered_radix.engine.events", "Transitions", "gather"),
    ("tiered_radix.engine.store", "TierStore", "route_many"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "route_many"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "move"),
    ("tiered_radix.adapters.sglang.stats", "BackendStats", "routed"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_settle"),
]


def _wrap(owner, name: str, label: str, record: bool = True, clock: list | None = None):
    import functools

    from torch.autograd.profiler import record_function

    f = getattr(owner, name)
    static = isinstance(owner.__dict__.get(name), staticmethod) if isinstance(owner, type) else 0

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        with record_function(label):
            out = f(*a, **k)
        if clock is not None:
            clock.append((time.perf_counter() - t) * 1e3)
        return out

    setattr(owner, name, staticmethod(g) if static else g)


def run(batch: int, args) -> dict:
    import importlib

    from backend_host_ops import SYNCS, VIEWS
    from test_backend import Harness

    from tiered_radix.adapters.sglang import backend
    from tiered_radix.adapters.sglang.options import KVOptions
    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    def stub(q, layout, plan, mass=None, **kw):  # host work only; random mass moves the scores
        if mass is not None:
            mass.copy_(torch.rand(mass.shape, generator=gen) ** 8)
        return torch.zeros_like(q)

    gen = torch.Generator().manual_seed(batch)
    backend.decode.run = stub
    policy = POLICY.replace("EVERY", str(args.every)).replace("BUDGET", str(args.budget))
    W = 32
    pages = batch * (args.prompt // W + args.steps // W + 4) + 8
    h = Harness(policy=policy, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                pages=pages, blocks=PoolBlocks(pages * args.heads + 16, pages * args.heads + 16),
                context=args.prompt + args.steps + 64, requests=max(16, batch),
                options=KVOptions(overlap=args.overlap), overlap_schedule=args.overlap)  # fmt: skip
    clock: list[float] = []
    b = backend.TieredAttnBackend
    _wrap(b, "_route_due", "X:_route_due", clock=clock)
    lands: list[float] = []  # --overlap: a decode routing lands at the next step's metadata
    if args.overlap:
        _wrap(b, "_land", "X:_land", clock=lands)
    for mod, obj, name in FUNCS:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError:
            continue  # an older tree (the "before" run) lacks it
        if not hasattr(getattr(m, obj, None) if obj else m, name):
            continue  # an older tree (the "before" run) lacks it
        _wrap(getattr(m, obj) if obj else m, name, f"X:{obj + '.' if obj else ''}{name}")
    _wrap(torch.Tensor, "tolist", "SYNC:tolist")
    _wrap(torch.Tensor, "item", "SYNC:item")
    _wrap(torch, "_assert_async", "ASSERT")  # a host sync on CPU only: not counted
    reqs = [
        h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(args.prompt)]) for i in range(batch)
    ]
    c = args.prompt // args.chunks
    out = {"batch": batch}
    ext = []
    for k in range(args.chunks):
        n0 = len(clock)
        toks = [r.origin_input_ids[k * c : (k + 1) * c] for r in reqs]
        if k == args.chunks - 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                h.step(reqs, toks, extend=True)
            out["route_extend_ops"] = report(prof.events(), SYNCS, VIEWS)
        else:
            h.step(reqs, toks, extend=True)
        ext += clock[n0:]
    routes, landed, profiled = [], [], None
    for t in range(args.steps):
        n0, l0 = len(clock), len(lands)
        due = (t + 1) % args.every == 0
        if (due and profiled is None and t > args.every) or profiled == t - 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                h.step(reqs, [[60 + t % 30]] * batch, extend=False)
            key = "route_ops" if profiled is None else "land_ops"
            if key == "route_ops" or args.overlap:
                out[key] = report(prof.events(), SYNCS, VIEWS)
            profiled = t if profiled is None else profiled
            continue
        h.step(reqs, [[60 + t % 30]] * batch, extend=False)
        if due:
            routes += clock[n0:]
        if t % args.every == 0 and t > 0 and lands[l0:]:  # after a due step: the landing
            landed.append(max(lands[l0:]))  # (the step's other _land calls find none)
    out["route_extend_ms"] = statistics.median(ext)
    out["route_ms"] = statistics.median(routes)
    if args.overlap:
        out["land_ms"] = statistics.median(landed)
    out["routings_timed"] = {"extend": len(ext), "decode": len(routes)}
    out["degraded"] = int(h.sim.pool.degraded)
    return out


def report(events, syncs: set[str], views: set[str]) -> dict:
    """Launching ops, syncs and CPU ms of ``_route_due``, and launching ops per function."""
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    checks = [e.time_range for e in events if e.name == "ASSERT"]
    sync = [
        e
        for e in events
        if e.name in syncs | {"SYNC:item"}
        and not any(c.start <= e.time_range.start and e.time_range.end <= c.end for c in checks)
    ]
    rows = {}
    for x in (e for e in events if e.name.startswith("X:")):
        s, t = x.time_range.start, x.time_range.end
        inside = [e for e in top if s <= e.time_range.start and e.time_range.end <= t]
        r = rows.setdefault(x.name[2:], {"calls": 0, "ops": 0, "syncs": 0})
        r["calls"] += 1
        r["ops"] += sum(1 for e in inside if e.name not in views)
        r["syncs"] += sum(1 for e in sync if s <= e.time_range.start and e.time_range.end <= t)
    return rows


def shape_args(ap: argparse.ArgumentParser) -> None:
    """``--layers``, ``--heads``, ``--head-dim``: the harness's attention shapes (default
    Qwen2.5-0.5B's: 24 layers, 2 KV heads, head dim 64)."""
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    shape_args(ap)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--chunks", type=int, default=2, help="prefill chunks (a routing after each)")
    ap.add_argument("--steps", type=int, default=40, help="decode steps")
    ap.add_argument("--every", type=int, default=4, help="decode steps between routings")
    ap.add_argument(
        "--budget",
        type=int,
        default=40,
        help="percent (short prompts: the recent window alone is 10%% of 640 tokens)",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="--kv-overlap: a decode routing is planned at its step (route_ms, route_ops) and "
        "lands at the next step's metadata (land_ms, land_ops)",
    )
    ap.add_argument("--out", default=None, help="folder for route_host.json")
    run_batches(run, ap.parse_args(), "route_host.json")


def run_batches(run, args, name: str) -> None:
    """``run(batch, args)`` for every ``args.batch`` on one CPU thread under the Triton
    interpreter, each row printed, all of them written to ``args.out / name``."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    res = {"args": vars(args), "torch": torch.__version__, "rows": []}
    for b in args.batch:
        r = run(b, args)
        res["rows"].append(r)
        print(json.dumps(r, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / name).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
