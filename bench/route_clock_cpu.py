"""The route clock's host cost (CPU harness, no GPU needed): requests that joined a server at
different steps route at different steps on the request clock, together on the server clock.

Drives the CPU harness of ``tests/adapters/sglang_adapter`` at Qwen2.5-0.5B's attention shapes
with the qevict-shaped policy of ``bench/route_host.py`` (routing every ``--every`` decode
steps), SGLang's overlap order (a routing lands a step late) and the decode kernel stubbed as
there. ``--batch`` requests join one at a time, ``--every // batch`` or more decode steps apart
(the last has prefilled before the others' periodic routings fall), then all decode together
for ``--steps`` steps, each ``--kv-route-clock`` in turn. Counted over those steps: the decode
forwards with a routing planned, the requests routed, and the launching ATen ops (views left
out, as ``route_host.py`` counts them) and host syncs in ``_route_due`` and ``_land`` (the
plans and the landings), per step. On the GPU every launching op costs the host ~40 us
(``routing_notes.md``); this CPU's wall ms also carry the ops' own work.

``--graphs``: the counted steps are decode graph replays (capture at ``--batch``, the way
SGLang's graph runner drives the backend; the joins stay eager), where the side output is
summed on the device and folded into the engines (``fold_pending``): then also the ops of
the step's metadata and lists (``init_forward_metadata_out_graph``, the folds it runs
included) and the rows folded (``fold_attn`` calls), per step.

    python bench/route_clock_cpu.py --batch 8 --out bench/results/route-clock-cpu
    python bench/route_clock_cpu.py --batch 16 --graphs --clocks request --out DIR

``--rank-kernel``: the rank allocation runs as the Triton kernel (``kernels/rank.py``, under the
interpreter here; on CUDA ``rank_allocate`` picks it by itself); ``--stack-kernels``: the pool's
free stacks take and give blocks with ``kernels/stacks.py``; ``--move-kernels``: the pool's moves
keep their block tables with ``kernels/moves.py`` too (both on CUDA by default). Each launch
counts as one op, the interpreter's own tensor copies inside it not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))

from route_host import POLICY, _wrap, shape_args  # noqa: E402


def run(clock: str, args) -> dict:
    """One clock's row, in this process: the decode kernel stays stubbed and ``fold_attn``
    counted for the run only (a test calling :func:`main` runs on with the real ones)."""
    from tiered_radix.adapters.sglang import backend
    from tiered_radix.engine.store import TierStore

    kernel, fold = backend.decode.run, TierStore.fold_attn
    try:
        return _run(clock, args)
    finally:
        backend.decode.run, TierStore.fold_attn = kernel, fold


def _run(clock: str, args) -> dict:
    from backend_host_ops import SYNCS, VIEWS
    from test_backend import Harness

    from tiered_radix.adapters.sglang import backend
    from tiered_radix.adapters.sglang.options import KVOptions
    from tiered_radix.adapters.sglang.sizing import PoolBlocks
    from tiered_radix.engine.store import TierStore

    gen = torch.Generator().manual_seed(args.batch)

    def stub(q, layout, plan, mass=None, **kw):  # host work only; random mass moves the scores
        if mass is not None:
            mass.copy_(torch.rand(mass.shape, generator=gen) ** 8)
        return torch.zeros_like(q)

    backend.decode.run = stub
    if args.rank_kernel:
        _use_rank_kernel()
    if args.stack_kernels or args.move_kernels:
        _use_stack_kernels()
    if args.move_kernels:
        _count_move_kernels()
    policy = POLICY.replace("EVERY", str(args.every)).replace("BUDGET", str(args.budget))
    W, B = 32, args.batch
    gap = max(1, args.every // B)
    total = args.steps + gap * B
    pages = B * (args.prompt // W + total // W + 4) + 8
    h = Harness(policy=policy, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                pages=pages, blocks=PoolBlocks(pages * args.heads + 16, pages * args.heads + 16),
                context=args.prompt + total + 64, requests=max(16, B),
                options=KVOptions(overlap=True, route_clock=clock), kernels=args.move_kernels,
                overlap_schedule=True)  # fmt: skip
    running = []
    for i in range(B):  # request i joins after gap * i decode steps of the others
        r = h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(args.prompt)])
        h.step([r], [r.origin_input_ids], extend=True)
        running.append(r)
        for t in range(gap):
            h.step(running, [[60 + t % 30]] * len(running), extend=False)
    stores = [h.backend.sessions[r.rid].store for r in running]
    routed0 = [s.step for s in stores]
    steps_with_routing = 0
    if args.graphs:  # SGLang captures its batch sizes after the pool is set up
        h.backend.init_cuda_graph_state(B, B)
        h.capture(B)
    folds = []
    fold = TierStore.fold_attn
    TierStore.fold_attn = lambda store, *a: (folds.append(1), fold(store, *a))[1]
    t0 = time.perf_counter()
    # Python stacks on the ops need the verbose experimental config since torch 2.13
    stacks = {"experimental_config": _ExperimentalConfig(verbose=True)} if args.by_function else {}
    with profile(activities=[ProfilerActivity.CPU], with_stack=args.by_function, **stacks) as prof:
        for t in range(args.steps):
            before = sum(s.step for s in stores)
            if args.graphs:
                h.replay(running, [[60 + t % 30]] * B, B, rids=True)
            else:
                h.step(running, [[60 + t % 30]] * B, extend=False)
            steps_with_routing += sum(s.step for s in stores) > before
    wall = time.perf_counter() - t0
    events = prof.events()
    meta = [e.time_range for e in events if e.name == "X:init_forward_metadata_out_graph"]
    spans = [e.time_range for e in events if e.name in ("X:_route_due", "X:_land")]
    kernel_events = [e for e in events if e.name.startswith("K:")]  # one launch each
    launches = [e.time_range for e in kernel_events]
    aten = [e for e in events if e.name.startswith("aten::") and not any(
        k.start <= e.time_range.start and e.time_range.end <= k.end for k in launches)]  # fmt: skip
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]

    def inside(e) -> bool:
        return any(s.start <= e.time_range.start and e.time_range.end <= s.end for s in spans)

    outer = [s for s in spans if not any(o is not s and o.start <= s.start and s.end <= o.end
                                         for o in spans)]  # fmt: skip
    route_us = sum(s.end - s.start for s in outer)
    counted = [e for e in top if e.name not in VIEWS and inside(e)]
    ops = len(counted)
    kernels = [e for e in kernel_events if inside(e)]
    ops += len(kernels)
    syncs = sum(1 for e in events if e.name in SYNCS and inside(e))
    routed = sum(s.step for s in stores) - sum(routed0)
    graphs = {}
    if args.graphs:  # the step's metadata and lists (a fold there included), rows folded
        in_meta = [e for e in top if e.name not in VIEWS and any(
            s.start <= e.time_range.start and e.time_range.end <= s.end for s in meta)]  # fmt: skip
        steady = h.backend.stats()["host_s"].get("steady_steps", 0)
        graphs = {"metadata_ops_per_step": round(len(in_meta) / args.steps, 1),
                  "rows_folded_per_step": round(len(folds) / args.steps, 2),
                  "steady_steps": int(steady)}  # fmt: skip
        if args.by_function:  # the metadata's own ops, the routing's left out
            rest = [e for e in in_meta if not inside(e)]
            graphs["metadata_ops_by_function"] = _by_function(rest, [], args.steps)
    return {
        "clock": clock, "batch": B, "steps": args.steps, "joined_gap_steps": gap,
        "steps_with_routing": steps_with_routing, "requests_routed": routed,
        "route_ops_per_step": round(ops / args.steps, 1),
        "route_syncs_per_step": round(syncs / args.steps, 2),
        "route_ms_per_step": round(route_us / 1e3 / args.steps, 2),
        "wall_ms_per_step": round(1e3 * wall / args.steps, 2),
        "over_budget_routings": h.backend.stats()["over_budget_routings"], **graphs,
        **({"route_ops_by_function": _by_function(counted, kernels, args.steps)}
           if args.by_function else {}),
    }  # fmt: skip


def _by_function(events, kernels, steps: int) -> dict[str, float]:
    """Ops a step per innermost ``tiered_radix`` / ``kernels`` function on the op's stack, and
    the Triton launches (``K:<kernel>``)."""
    out: dict[str, int] = {}
    for e in kernels:
        out[e.name] = out.get(e.name, 0) + 1
    for e in events:
        frame = next((f for f in e.stack if "tiered_radix" in f or "/kernels/" in f), "?")
        name = frame.rsplit(": ", 1)[-1]
        where = frame.split("(")[0].rsplit("/", 1)[-1].removesuffix(".py")
        key = f"{where}.{name}"
        out[key] = out.get(key, 0) + 1
    ranked = sorted(out.items(), key=lambda kv: -kv[1])
    return {k: round(v / steps, 1) for k, v in ranked if v / steps >= 1}


def _counted(kernel, name: str):
    """``kernel[grid](...)`` run inside a ``K:<name>`` span (one launch on a GPU)."""
    from torch.autograd.profiler import record_function

    class Counted:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                with record_function(f"K:{name}"):
                    return kernel[grid](*a, **kw)

            return launch

    return Counted()


def _use_rank_kernel() -> None:
    """Route with the Triton rank allocation where it applies (for the run only)."""
    from tiered_radix.kernels import rank

    from tiered_radix.engine import allocate_rank

    twin = allocate_rank.rank_allocate

    def forced(score, cost, budget, **kw):
        fits = rank.fits(score, cost, kw.get("rounds"))
        return twin(score, cost, budget, **kw, impl="triton" if fits else "torch")

    rank._rank_allocate_kernel = _counted(rank._rank_allocate_kernel, "rank_allocate")
    allocate_rank.rank_allocate = forced


def _use_stack_kernels() -> None:
    """The pool's free stacks take and give with the Triton kernels (for the run only)."""
    from tiered_radix.kernels import stacks

    from tiered_radix.adapters.sglang import freelist

    stacks._stack_take_kernel = _counted(stacks._stack_take_kernel, "stack_take")
    stacks._stack_give_kernel = _counted(stacks._stack_give_kernel, "stack_give")
    init = freelist.FreeStacks.__init__
    freelist.FreeStacks.__init__ = lambda self, *a, **kw: init(self, *a, **(kw | {"kernel": True}))


def _count_move_kernels() -> None:
    """Count the move kernels' launches as ops (the pool runs them with ``kernels=True``)."""
    from tiered_radix.kernels import moves

    moves._move_claim_kernel = _counted(moves._move_claim_kernel, "move_claim")
    moves._move_refs_kernel = _counted(moves._move_refs_kernel, "move_refs")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    shape_args(ap)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=32, help="decode steps counted")
    ap.add_argument("--every", type=int, default=16, help="decode steps between routings")
    ap.add_argument("--budget", type=int, default=40, help="percent (short prompts)")
    ap.add_argument("--clocks", nargs="+", default=["request", "server"])
    ap.add_argument("--graphs", action="store_true", help="count decode graph replays")
    ap.add_argument("--rank-kernel", action="store_true", help="Triton rank allocation")
    ap.add_argument("--stack-kernels", action="store_true", help="Triton free-stack take/give")
    ap.add_argument("--move-kernels", action="store_true", help="pool moves: kernels/moves.py")
    ap.add_argument(
        "--by-function",
        action="store_true",
        help="routing ops a step by innermost tiered_radix function (slower; PyTorch paths only)",
    )
    ap.add_argument("--out", default=None, help="folder for route_clock.json")
    args = ap.parse_args(argv)
    if args.by_function and (args.rank_kernel or args.stack_kernels or args.move_kernels):
        # the profiler records the Triton interpreter's ops with their Python stacks: 24 GiB
        # were not enough even at 6 steps
        ap.error("--by-function counts the PyTorch paths only: drop the kernel flags")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from tiered_radix.adapters.sglang import backend

    for name in ("_route_due", "_land", "init_forward_metadata_out_graph"):  # counted spans
        _wrap(backend.TieredAttnBackend, name, f"X:{name}")
    if len(args.clocks) == 1:
        rows = [run(args.clocks[0], args)]
    else:  # each clock in a fresh process: a second harness in one process runs its steps slower
        rows = []
        for clock in args.clocks:
            one = [a for a in argv if a not in args.clocks and a != "--clocks"]
            if "--out" in one:
                k = one.index("--out")
                del one[k : k + 2]
            done = subprocess.run([sys.executable, __file__, *one, "--clocks", clock],
                                  capture_output=True, text=True, check=True)  # fmt: skip
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for r in rows:
        print(json.dumps(r))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        res = {"command": "python bench/route_clock_cpu.py " + " ".join(argv), "args": vars(args),
               "torch": torch.__version__, "rows": rows}  # fmt: skip
        (Path(args.out) / "route_clock.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
