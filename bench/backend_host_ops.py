"""Host-side ATen ops per decode step of the tiered SGLang backend (CPU, no GPU needed).

The backend's decode is launch-bound on the GPU (bench/results/sglang-run5: 98.9 ms a step at
30K x 8 against 6.6 ms for plain SGLang); this counts what it issues per step, by function, on
the CPU test harness (tests/adapters/sglang_adapter), with the decode kernel stubbed out so only
the host work around it is counted. Run in the SGLang venv (docs/sglang.md):

    python bench/backend_host_ops.py --layers 4 --batch 4

Counts, not times: on the GPU each launching op costs ~5-10 us of host time. The last two
tables are decode steps under CUDA graphs (the host work before a replay, and the flush after
it): one that rebuilds its index lists and a steady one.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
WRAP = [  # (module path, object, attribute)
    ("tiered_radix.engine.store", "TierStore", "observe_attn"),
    ("tiered_radix.engine.store", "TierStore", "append_tokens"),
    ("tiered_radix.adapters.sglang.trizone", None, "build"),
    ("tiered_radix.adapters.sglang.trizone", None, "window_attn"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "set_kv_buffer"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "prepare_write"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "sync_view"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_route_due"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_decode_kernel"),
    ("tiered_radix.engine.store", "TierStore", "route"),
    ("tiered_radix.engine.store", "TierStore", "apply"),
    ("tiered_radix.engine.planner", None, "plan_routes"),
    ("tiered_radix.engine.planner", None, "_budgets"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "route_many"),
    ("tiered_radix.adapters.sglang.stats", "BackendStats", "routed"),
    ("tiered_radix.engine.store", "TierStore", "plan"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "route"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "move"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "init_forward_metadata"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend",
     "init_forward_metadata_out_graph"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "flush"),
    ("tiered_radix.adapters.sglang.trizone", None, "lists"),
    ("tiered_radix.adapters.sglang.graph", "GraphDecode", "load"),
    ("tiered_radix.adapters.sglang.graph", "GraphDecode", "advance"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "graph_write"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_gather"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "read"),
]  # fmt: skip


def _wrap(owner, name: str, label: str | None = None) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        with record_function(label or f"X:{name}"):
            return f(*a, **k)

    setattr(owner, name, g)


# ops that wait for the device on CUDA (a host sync); tolist is marked by a wrapper
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
         "aten::masked_select", "aten::unique_consecutive", "SYNC:tolist"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=400, help="prompt tokens per request")
    ap.add_argument("--gather", choices=("live", "all"), default="live", help="--kv-gather")
    a = ap.parse_args()
    os.environ.update(TRITON_INTERPRET="1")
    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))
    import importlib

    from test_backend import KERNEL_POLICY, Harness

    from tiered_radix.adapters.sglang import backend
    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    for mod, obj, name in WRAP:
        m = importlib.import_module(mod)
        _wrap(getattr(m, obj) if obj else m, name, f"X:{obj + '.' if obj else ''}{name}")
    _wrap(torch.Tensor, "tolist", "SYNC:tolist")
    backend.decode.run = lambda q, layout, plan, **kw: torch.zeros_like(q)  # host work only
    pages = a.batch * (a.prompt // 16 + 4) + 8
    h = Harness(policy=KERNEL_POLICY, head_dim=64, pages=pages, blocks=PoolBlocks(20000, 20000),
                layers=a.layers, context=a.prompt + 64)  # fmt: skip
    reqs = [
        h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(a.prompt)]) for i in range(a.batch)
    ]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        h.step(reqs, [r.origin_input_ids for r in reqs], extend=True)
    report(prof.events(), f"layers={a.layers} batch={a.batch}, the prefill (routes after it)")
    for t in range(2):
        h.step(reqs, [[80 + t]] * a.batch, extend=False)
    # KERNEL_POLICY routes every 3 decode steps: step 2 routes, step 3 does not
    for label, tok in (("with routing", 90), ("without routing", 91)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            h.step(reqs, [[tok]] * a.batch, extend=False)
        report(prof.events(), f"layers={a.layers} batch={a.batch}, a decode step {label}")
    graph_steps(a, Harness, KERNEL_POLICY, PoolBlocks)
    chunked_prefill(a, Harness, KERNEL_POLICY, PoolBlocks)


def graph_steps(a, Harness, policy: str, PoolBlocks) -> None:
    """Decode replays as SGLang's CUDA graph runner drives them (metadata before the replay,
    the forward recorded): a step that rebuilds its lists (after a routing or into a new window)
    and a steady one that appends its rows on the device."""
    pages = a.batch * (a.prompt // 16 + 4) + 8
    h = Harness(policy=policy, head_dim=64, pages=pages, blocks=PoolBlocks(20000, 20000),
                layers=a.layers, context=a.prompt + 64)  # fmt: skip
    h.backend.init_cuda_graph_state(a.batch, a.batch)
    h.capture(a.batch)
    reqs = [
        h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(a.prompt)]) for i in range(a.batch)
    ]
    h.step(reqs, [r.origin_input_ids for r in reqs], extend=True)
    seen = set()
    for t in range(8):
        before = h.backend.timer.host_s["steady_steps"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            h.replay(reqs, [[60 + t]] * a.batch, a.batch)
            h.backend.flush()
        kind = (
            "steady" if h.backend.timer.host_s["steady_steps"] > before else "rebuilding its lists"
        )
        if kind not in seen:
            seen.add(kind)
            report(prof.events(), f"layers={a.layers} batch={a.batch}, a graph replay {kind}")


def chunked_prefill(a, Harness, policy: str, PoolBlocks, chunks: int = 4) -> None:
    """A prompt prefilled in ``chunks`` chunks, routing after each (``after_prefill``): the
    second chunk, whose gathers read the first one's routed windows."""
    pages = a.batch * (a.prompt // 16 + 4) + 8
    from tiered_radix.adapters.sglang.options import KVOptions

    h = Harness(policy=policy, head_dim=64, pages=pages, blocks=PoolBlocks(20000, 20000),
                layers=a.layers, context=a.prompt + 64,
                options=KVOptions(gather=a.gather))  # fmt: skip
    reqs = [
        h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(a.prompt)]) for i in range(a.batch)
    ]
    c = a.prompt // chunks
    h.step(reqs, [r.origin_input_ids[:c] for r in reqs], extend=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        h.step(reqs, [r.origin_input_ids[c : 2 * c] for r in reqs], extend=True)
    report(prof.events(), f"layers={a.layers} batch={a.batch}, prefill chunk 2 of {chunks} "
           f"(gather={a.gather})")  # fmt: skip


# ops that only make views or metadata: no kernel launch on the GPU
VIEWS = {
    "aten::view", "aten::select", "aten::slice", "aten::as_strided", "aten::transpose",
    "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::permute", "aten::alias",
    "aten::detach", "aten::unbind", "aten::split", "aten::t", "aten::_reshape_alias",
    "aten::reshape", "aten::flatten", "aten::empty", "aten::empty_strided", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::unflatten", "aten::expand_as",
    "aten::view_as", "aten::to", "aten::_to_copy_noop", "aten::result_type", "aten::item",
    "aten::_local_scalar_dense", "aten::is_nonzero", "aten::set_", "aten::numel",
}  # fmt: skip


def report(events, title: str) -> None:
    """Per wrapped function: calls, top-level ATen ops (children of another op not counted),
    those that launch work (not views), host syncs (on CUDA: ops whose output size or value the
    host waits for, and ``tolist``), and CPU milliseconds (profiler overhead included)."""
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    sync = [e for e in events if e.name in SYNCS]
    print(f"{title}: {len(top)} top-level aten ops (the harness's own K/V and q included)")
    rows: dict[str, list[float]] = {}
    for x in (e for e in events if e.name.startswith("X:")):
        s, t = x.time_range.start, x.time_range.end
        inside = [e for e in top if s <= e.time_range.start and e.time_range.end <= t]
        work = sum(1 for e in inside if e.name not in VIEWS)
        syncs = sum(1 for e in sync if s <= e.time_range.start and e.time_range.end <= t)
        r = rows.setdefault(x.name[2:], [0, 0, 0, 0, 0.0])
        r[0] += 1
        r[1] += len(inside)
        r[2] += work
        r[3] += syncs
        r[4] += (t - s) / 1e3
    head = f"  {'function':34s} {'calls':>5s} {'ops':>6s} {'work':>6s} {'syncs':>5s} {'cpu ms':>7s}"
    print(head)
    for name, (calls, n, work, syncs, ms) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"  {name:34s} {calls:5d} {n:6d} {work:6d} {syncs:5d} {ms:7.1f}")


if __name__ == "__main__":
    main()
