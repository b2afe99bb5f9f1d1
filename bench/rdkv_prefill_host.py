"""Host cost of RDKV's chunked prefill in the tiered SGLang backend (CPU harness, no GPU).

Drives the CPU harness of ``tests/adapters/sglang_adapter`` (``test_backend.Harness``) at
Qwen2.5-0.5B's KV shapes (24 layers, 2 KV heads, head dim 64; the harness's 4 query heads) with
``policies/rdkv.yaml`` and a variant, ``--variant chunks``, that routes after every prefill
chunk on each chunk's own signals (the shipped file before issue 19's change). A batch of
prompts is prefilled in ``--chunks`` chunks, then one decode step (where the shipped policy's
deferred routing runs). Per forward: wall ms, the host seconds of each backend phase
(``StepTimer``), and from ``torch.profiler`` the top-level ATen ops that launch work and the
host syncs (``tolist``/``item``/``bool``/``float``/``int`` of a tensor: on CUDA each one waits
for the device), also per function.

The Triton kernels are stubbed (the extend kernels' launches: zeros out, random signals;
decode: zeros), so what is counted is the host work around them (their launchers' tensor ops
included, the stubs' own fills excluded); a chunk that cannot run the extend kernel (a request
that reads Zone A pages) runs the real gather path (per request and layer: unpack the pages,
attend in float32), which is what it does on the GPU too. ``--policy qevict`` (or a file) runs
another policy at the same shapes (``--variant`` applies to rdkv's text only).

    python bench/rdkv_prefill_host.py --prompt 4096 --chunks 4 --batch 1 \\
        --out bench/results/rdkv-prefill-cpu
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))

from route_host import shape_args  # noqa: E402

DEFERRED = "schedule: after_prefill(defer=true)"
FUNCS = [  # (module, class or None, attribute): host work listed per function (where present)
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_metadata"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_admit"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_open"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "open_view"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "sync_view"),
    ("tiered_radix.engine.store", "TierStore", "__init__"),
    ("tiered_radix.engine.store", "TierStore", "append_tokens"),
    ("tiered_radix.engine.coupled", "CoupledStack", "__init__"),
    ("tiered_radix.engine.coupled", "CoupledStack", "count"),
    ("tiered_radix.engine.decoupled", "ChannelK", "__init__"),
    ("tiered_radix.engine.decoupled", "ChannelK", "append"),
    ("tiered_radix.engine.scores", "ScoreEvaluator", "__init__"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "prepare_write"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "set_kv_buffer"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_gather"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_extend_kernel"),
    ("tiered_radix.adapters.sglang.trizone", None, "build_extend"),
    ("tiered_radix.adapters.sglang.trizone", None, "extend_layer"),
    ("tiered_radix.kernels.extend", None, "run"),
    ("tiered_radix.kernels.extend", None, "signals"),
    ("tiered_radix.kernels.extend", None, "chunk_qnorm"),
    ("tiered_radix.kernels.extend", None, "qnorm_of"),
    ("tiered_radix.engine.store", "TierStore", "observe_layers"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_observe_extend"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_route_due"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_repack"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "read_request"),
    ("tiered_radix.formats.zone_a", None, "pack"),
    ("tiered_radix.formats.zone_a", None, "pack_layers"),
    ("tiered_radix.adapters.sglang.zones", "ZoneStore", "put"),
    ("tiered_radix.engine.planner", None, "plan_route"),
    ("tiered_radix.engine.pending", "PendingRoutes", "land"),
]
COUNTS = ("extend_batches", "decode_steps", "steady_steps", "graph_steps")  # not seconds
SYNC_METHODS = ("tolist", "item", "__bool__", "__float__", "__int__")


def _wrap(owner, name: str, label: str) -> None:
    f = getattr(owner, name)
    static = isinstance(owner.__dict__.get(name), staticmethod) if isinstance(owner, type) else 0

    @functools.wraps(f)
    def g(*a, **k):
        with record_function(label):
            return f(*a, **k)

    setattr(owner, name, staticmethod(g) if static else g)


class _Stub:
    """A Triton kernel's stand-in: ``stub[grid](*args, **kw)`` runs ``fill(args, kw)`` inside
    a ``STUB`` range (its ops are not counted)."""

    def __init__(self, fill) -> None:
        self.fill = fill

    def __getitem__(self, grid):
        def launch(*args, **kw):
            with record_function("STUB"):
                self.fill(args, kw)

        return launch


def _stubs(seed: int) -> None:
    """The kernels out of the way: their host cost on the GPU is one launch each."""
    from tiered_radix.kernels import extend

    from tiered_radix.adapters.sglang import backend

    gen = torch.Generator().manual_seed(seed)

    def attn(args, kw):  # q, q_st, q_sh, out, o_st, o_sh, lse, ..., qnorm_sq (position 25)
        args[3].zero_()
        args[6].zero_()
        if kw.get("QNORM"):
            args[25].copy_(torch.rand(args[25].shape, generator=gen))

    def sig(args, kw):  # ..., colmass, obs, attn (positions 17-19)
        for on, x in zip(("COLMASS", "OBS", "LAST"), args[17:20], strict=True):
            if kw[on]:
                x.copy_(torch.rand(x.shape, generator=gen) ** 8)

    def decode_run(q, layout, plan, mass=None, **kw):
        with record_function("STUB"):
            if mass is not None:
                mass.copy_(torch.rand(mass.shape, generator=gen) ** 8)
            return torch.zeros_like(q)

    extend._extend_attn_kernel = _Stub(attn)
    extend._extend_signals_kernel = _Stub(sig)
    backend.decode.run = decode_run


def report(events) -> dict:
    """Top-level launching ATen ops and host syncs of the profiled forward, and per function."""
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    views = {"aten::view", "aten::reshape", "aten::as_strided", "aten::slice", "aten::select",
             "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::t", "aten::expand",
             "aten::permute", "aten::detach", "aten::alias", "aten::_reshape_alias",
             "aten::lift_fresh", "aten::empty", "aten::result_type", "aten::split",
             "aten::unbind", "aten::chunk", "aten::narrow", "aten::flatten"}  # fmt: skip
    stubs = [(e.time_range.start, e.time_range.end) for e in events if e.name == "STUB"]

    def counted(e) -> bool:
        return not any(s <= e.time_range.start and e.time_range.end <= t for s, t in stubs)

    launch = [e for e in top if e.name not in views and counted(e)]
    syncs = [e for e in events if e.name.startswith("SYNC:") and counted(e)]
    out = {"ops": len(launch), "syncs": len(syncs), "by_function": {}}
    for x in (e for e in events if e.name.startswith("X:")):
        s, t = x.time_range.start, x.time_range.end
        r = out["by_function"].setdefault(x.name[2:], {"calls": 0, "ops": 0, "syncs": 0})
        r["calls"] += 1
        r["ops"] += sum(1 for e in launch if s <= e.time_range.start and e.time_range.end <= t)
        r["syncs"] += sum(1 for e in syncs if s <= e.time_range.start and e.time_range.end <= t)
    return out


def run(variant: str, batch: int, args) -> dict:
    import importlib

    from test_backend import Harness

    from tiered_radix.adapters.sglang.options import KVOptions
    from tiered_radix.adapters.sglang.sizing import PoolBlocks
    from tiered_radix.policy import compile_text

    named = ROOT / "policies" / f"{args.policy}.yaml"
    text = (named if named.exists() else Path(args.policy)).read_text()
    if variant == "chunks":  # routed after every chunk, on that chunk's signals
        text = text.replace(DEFERRED, "schedule: after_prefill")
        text = text.replace("cumulative(colmass)", "colmass")
        text = text.replace("sqrt(cumulative(qnorm ^ 2))", "qnorm")
    text = text.replace("budget: 10%", f"budget: {args.budget}%")
    W = 32
    pages = batch * (args.prompt // W + 4) + 8
    zone = batch * args.prompt * args.heads * 4 * args.head_dim + (1 << 20)
    coupled = compile_text(text).coupled
    blocks = PoolBlocks(pages * args.heads + 16, pages * args.heads + 16 if coupled else 0,
                        0 if coupled else zone)  # fmt: skip
    h = Harness(policy=text, layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                pages=pages, blocks=blocks,
                context=args.prompt + 64,
                options=KVOptions(extend="kernel", decode="kernel"))  # fmt: skip
    assert h.backend.extend_kernel and h.backend.kernel, "the stubbed kernels should serve"
    for mod, obj, name in FUNCS:
        m = importlib.import_module(mod)
        owner = getattr(m, obj) if obj else m
        if hasattr(owner, name):  # an older tree may not have it
            _wrap(owner, name, f"X:{obj + '.' if obj else ''}{name}")
    reqs = [
        h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(args.prompt)]) for i in range(batch)
    ]
    c = args.prompt // args.chunks
    rows = []
    forwards = [([r.origin_input_ids[k * c : (k + 1) * c] for r in reqs], True, f"chunk {k + 1}")
                for k in range(args.chunks)]  # fmt: skip
    forwards.append(([[60 + i] for i in range(batch)], False, "decode 1"))
    for new, extend, name in forwards:
        before = dict(h.backend.timer.report().get("host_s", {}))
        gathered = h.backend.extend_kernel_batches
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            h.step(reqs, new, extend=extend)
            wall = (time.perf_counter() - t0) * 1e3
        after = h.backend.timer.report().get("host_s", {})
        phases = {
            k: round((v - before.get(k, 0.0)) * 1e3, 2)
            for k, v in after.items()
            if k not in COUNTS and v - before.get(k, 0.0) > 0
        }
        row = {"forward": name, "wall_ms": round(wall, 1), "phases_ms": phases}
        if extend:
            row["extend_kernel"] = h.backend.extend_kernel_batches > gathered
        row |= report(prof.events())
        rows.append(row)
        print(
            args.policy,
            variant,
            batch,
            json.dumps({k: v for k, v in row.items() if k != "by_function"}),
        )
    return {"policy": args.policy, "variant": variant, "batch": batch, "forwards": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="rdkv", help="shipped name or policy file")
    ap.add_argument("--variant", nargs="+", default=["chunks", "shipped"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    shape_args(ap)
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens per request")
    ap.add_argument("--chunks", type=int, default=4, help="prefill chunks")
    ap.add_argument("--budget", type=int, default=10, help="percent")
    ap.add_argument("--out", default=None, help="folder for rdkv_prefill_host.json")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel paths run (stubbed) on CPU
    torch.set_num_threads(1)
    for m in SYNC_METHODS:
        _wrap(torch.Tensor, m, f"SYNC:{m}")
    _stubs(0)
    res = {"args": vars(args), "torch": torch.__version__, "rows": []}
    for v in args.variant:
        for b in args.batch:
            res["rows"].append(run(v, b, args))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rdkv_prefill_host.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
