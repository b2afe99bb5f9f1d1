"""Host-side ATen ops per decode step of the tiered SGLang backend (CPU, no GPU needed).

The backend's decode is launch-bound on the GPU (bench/results/sglang-run5: 98.9 ms a step at
30K x 8 against 6.6 ms for plain SGLang); this counts what it issues per step, by function, on
the CPU test harness (tests/adapters/sglang_adapter), with the decode kernel stubbed out so only
the host work around it is counted. Run in the SGLang venv (docs/sglang.md):

    python bench/backend_host_ops.py --layers 4 --batch 4

Counts, not times: on the GPU each launching op costs ~5-10 us of host time. The last two
tables are decode steps under CUDA graphs (the host work before a replay, and the flush after
it): one that rebuilds its index lists and a steady one.

``--extend``: instead, one extend batch through the extend kernel's path (the GPU default; the
kernels stubbed out: host work only), split by the backend's phases (``metadata_extend``,
``write_extend``, ``extend_lists``, ``extend_attend``, ``observe_extend``, ``route_extend``), at
each of ``--batches`` requests, for a prompt's first chunk and its second (a view that grows),
with the shipped qevict policy (``--policy``), its routing deferred to after the prompt, and a
``--kv-stats`` file as the benchmark writes one. Per phase: ATen ops, those that launch work,
host syncs, tensors made from host values (``torch.tensor``; a host-to-device copy each on
CUDA), profiled CPU ms, and the unprofiled CPU ms of the same batch (the backend's own timer, a
second harness). ``--out FILE`` writes the rows as JSON:

    python bench/backend_host_ops.py --extend --layers 24 --batches 1 8 32 --prompt 512

``--rdkv``: instead, decode replays under CUDA graphs (as ``bench/sglang_decode.py``'s
``tiered`` kind runs them) of the shipped ``policies/rdkv.yaml`` (at ``--budget``) at each of
``--batches`` requests of ``--prompt`` tokens (the kernels stubbed), by phase as ``--extend``
counts them: the first decode step (the deferred routing: RD plan, Zone A repack), the step
after it (lists rebuilt), a steady step (lists grown in place) and the step that opens a window
(lists rebuilt); then the first step's routing by function. ``--out FILE`` writes the rows:

    python bench/backend_host_ops.py --rdkv --layers 24 --batches 1 8 --prompt 1024 --budget 25

(the prefill signals are random, as ``bench/rdkv_prefill_host.py`` stubs them; at 1,024 tokens the
shipped 10% is mostly its 68 protected tokens: few pages; 25% holds more, as 10% of a 30K prompt
does)
"""

from __future__ import annotations

import argparse
import contextlib
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
    ap.add_argument("--extend", action="store_true", help="extend batches by phase (docstring)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--policy", default=str(ROOT / "policies" / "qevict.yaml"))
    ap.add_argument("--rdkv", action="store_true", help="rdkv graph replays by phase (docstring)")
    ap.add_argument("--budget", type=int, default=10, help="--rdkv: the policy's budget, percent")
    ap.add_argument("--out", help="--extend, --rdkv: the rows as JSON")
    a = ap.parse_args()
    os.environ.update(TRITON_INTERPRET="1")
    if a.extend:
        extend_phases(a)
        return
    if a.rdkv:
        rdkv_graph_phases(a)
        return
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


PHASES = ("metadata_extend", "write_extend", "extend_lists", "extend_attend", "observe_extend",
          "route_extend")  # fmt: skip


def _stub_extend_kernels() -> None:
    """The extend kernels' launches replaced by their outputs' allocations (and the signal
    buffers' zeroing, as :func:`~tiered_radix.kernels.extend.signals` does): host work only."""
    from tiered_radix.kernels import extend

    def run(q, st, ls, p, hkv, **kw):
        return torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)

    def signals(q, lse, st, ls, p, hkv, need, *, into=None, zeroed=False, **kw):
        for x in (into or {}).values() if not zeroed else ():
            x.zero_()
        return into

    extend.run, extend.signals = run, signals


def _phase_ranges(backend) -> None:
    """The backend's phases (its timer) as profiler ranges ``P:name`` too."""
    timed = backend._timed

    @contextlib.contextmanager
    def both(name):
        with record_function(f"P:{name}"), timed(name):
            yield

    backend._timed = both


def _count_tensor_from_host() -> None:
    """``torch.tensor(data, device=...)`` calls as ``H2D:tensor`` ranges: on CUDA a copy from
    pageable host memory, which waits for the stream (tensors made on the host and copied from
    pinned memory are not counted)."""
    make = torch.tensor

    def tensor(*args, **kw):
        if kw.get("device") is None:
            return make(*args, **kw)
        with record_function("H2D:tensor"):
            return make(*args, **kw)

    torch.tensor = tensor


def extend_phases(a) -> None:
    """One extend batch by phase at each of ``a.batches`` (see the module docstring)."""
    import json
    import tempfile

    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))
    from test_backend import Harness

    from tiered_radix.adapters.sglang.options import KVOptions
    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    _stub_extend_kernels()
    _wrap(torch.Tensor, "tolist", "SYNC:tolist")
    _count_tensor_from_host()
    policy = Path(a.policy).read_text()
    stats = Path(tempfile.mkdtemp()) / "stats.json"
    rows = []

    def harness(batch):
        W = 32
        pages = batch * (2 * a.prompt // W + 4) + 8
        h = Harness(
            policy=policy,
            head_dim=64,
            pages=pages,
            layers=a.layers,
            blocks=PoolBlocks(pages * 2 + 64, pages + 64),
            context=2 * a.prompt + 64,
            requests=batch + 1,
            options=KVOptions(extend="kernel", stats=str(stats)),
        )
        _phase_ranges(h.backend)
        reqs = [h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(2 * a.prompt)])
                for i in range(batch)]  # fmt: skip
        return h, reqs

    for batch in a.batches:
        h, reqs = harness(batch)  # profiled
        h2, reqs2 = harness(batch)  # timed
        for chunk in (1, 2):
            sl = slice((chunk - 1) * a.prompt, chunk * a.prompt)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                h.step(reqs, [r.origin_input_ids[sl] for r in reqs], extend=True)
            h2.backend.timer.host_s.clear()
            h2.step(reqs2, [r.origin_input_ids[sl] for r in reqs2], extend=True)
            wall = h2.backend.timer.host_s
            title = (
                f"layers={a.layers} batch={batch}, extend chunk {chunk} of 2 ({a.prompt} tokens)"
            )
            for name, r in phase_rows(prof.events(), title, wall).items():
                rows.append({"batch": batch, "chunk": chunk, "phase": name, **r})
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {"layers": a.layers, "prompt": a.prompt, "policy": a.policy, "rows": rows}, indent=1
            )
        )


ROUTE_FUNCS = [  # the deferred routing's parts (--rdkv)
    ("tiered_radix.engine.store", "TierStore", "begin_routes"),
    ("tiered_radix.engine.pending", "PendingRoutes", "land"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_repack"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "read_request"),
    ("tiered_radix.formats.zone_a", None, "pack_layers"),
    ("tiered_radix.adapters.sglang.zones", "ZoneStore", "put"),
    ("tiered_radix.adapters.sglang.stats", "BackendStats", "routed"),
    # inside begin_routes (the plan) and land
    ("tiered_radix.engine.planner", None, "_weights_layers"),
    ("tiered_radix.engine.planner", None, "rd_choice_rows"),
    ("tiered_radix.engine.store", "TierStore", "_bytes"),
    ("tiered_radix.engine.decoupled", "ChannelK", "apply"),
]


def rdkv_graph_phases(a) -> None:
    """rdkv decode replays by phase at each of ``a.batches`` (see the module docstring)."""
    import importlib
    import json

    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))
    from test_backend import Harness

    from tiered_radix.adapters.sglang.options import KVOptions
    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    sys.path.insert(0, str(ROOT / "bench"))
    from rdkv_prefill_host import _stubs

    _stubs(0)  # the kernels' host work only; random prefill signals, so the routing keeps pages
    _wrap(torch.Tensor, "tolist", "SYNC:tolist")
    _count_tensor_from_host()
    for mod, obj, name in ROUTE_FUNCS:
        m = importlib.import_module(mod)
        _wrap(getattr(m, obj) if obj else m, name, f"X:{obj + '.' if obj else ''}{name}")
    policy = (ROOT / "policies" / "rdkv.yaml").read_text()
    policy = policy.replace("budget: 10%", f"budget: {a.budget}%")
    W, rows = 32, []

    def harness(batch):
        pages = batch * (a.prompt // W + 4) + 8
        zone = batch * a.prompt * 2 * 4 * 64 + (1 << 20)
        opts = KVOptions(extend="kernel", decode="kernel")
        h = Harness(policy=policy, layers=a.layers, head_dim=64, pages=pages,
                    blocks=PoolBlocks(pages * 2 + 16, 0, zone), context=a.prompt + 2 * W,
                    requests=batch + 1, options=opts)  # fmt: skip
        _phase_ranges(h.backend)
        h.backend.init_cuda_graph_state(batch, batch)
        h.capture(batch)
        reqs = [h.start(f"r{i}", [(7 * j + i) % 97 + 1 for j in range(a.prompt)])
                for i in range(batch)]  # fmt: skip
        h.step(reqs, [r.origin_input_ids for r in reqs], extend=True)
        return h, reqs

    def replay(h, reqs, t):
        h.replay(reqs, [[60 + t % 30]] * len(reqs), len(reqs), rids=True)
        h.backend.flush()

    for batch in a.batches:
        h, reqs = harness(batch)  # profiled
        h2, reqs2 = harness(batch)  # timed
        named = {0: "first step (routes)", 1: "the step after", 2: "steady"}
        opens = W - a.prompt % W  # the step whose new token opens a window
        named[opens if opens > 2 else opens + W] = "opens a window"
        for t in range(max(named) + 1):
            if t not in named:
                replay(h, reqs, t)
                replay(h2, reqs2, t)
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                replay(h, reqs, t)
            h2.backend.timer.host_s.clear()
            replay(h2, reqs2, t)
            zone = h.backend.pool.zones.bytes_used()
            title = (f"layers={a.layers} batch={batch} prompt={a.prompt} budget={a.budget}%, rdkv "
                     f"replay: {named[t]} ({zone} Zone A bytes)")  # fmt: skip
            for name, r in phase_rows(prof.events(), title, h2.backend.timer.host_s).items():
                rows.append({"batch": batch, "step": named[t], "phase": name, **r})
            if t == 0:
                report(prof.events(), f"batch={batch}: the first step's routing by function")
    if a.out:
        out = {"layers": a.layers, "prompt": a.prompt, "budget": a.budget, "rows": rows}
        Path(a.out).write_text(json.dumps(out, indent=1))


def _under(e, name: str) -> bool:
    """Whether event ``e`` runs inside an op ``name`` (``_assert_async`` reads its flag on the
    CPU; on CUDA it asserts on the device, no sync)."""
    p = e.cpu_parent
    while p is not None:
        if p.name == name:
            return True
        p = p.cpu_parent
    return False


def phase_rows(events, title: str, wall: dict) -> dict[str, dict]:
    """Per backend phase (``P:`` ranges): top-level ATen ops, those that launch work, host
    syncs, ``torch.tensor`` calls, profiled CPU ms, and the unprofiled ms of ``wall`` (phase ->
    seconds); printed under ``title``."""
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    sync = [e for e in events if e.name in SYNCS and not _under(e, "aten::_assert_async")]
    made = [e for e in events if e.name == "H2D:tensor"]
    out: dict[str, dict] = {}
    for x in (e for e in events if e.name.startswith("P:")):
        s, t = x.time_range.start, x.time_range.end

        def within(evs, s=s, t=t):
            return [e for e in evs if s <= e.time_range.start and e.time_range.end <= t]

        inside = within(top)
        r = out.setdefault(x.name[2:], {"calls": 0, "ops": 0, "work": 0, "syncs": 0, "h2d": 0,
                                         "prof_ms": 0.0})  # fmt: skip
        r["calls"] += 1
        r["ops"] += len(inside)
        r["work"] += sum(1 for e in inside if e.name not in VIEWS)
        r["syncs"] += len(within(sync))
        r["h2d"] += len(within(made))
        r["prof_ms"] = round(r["prof_ms"] + (t - s) / 1e3, 2)
    for name, r in out.items():
        r["cpu_ms"] = round(1e3 * wall.get(name, 0.0), 2)
    print(title)
    print(f"  {'phase':16s} {'calls':>5s} {'ops':>6s} {'work':>6s} {'syncs':>5s} {'h2d':>4s} "
          f"{'prof ms':>8s} {'cpu ms':>7s}")  # fmt: skip
    for name in [p for p in PHASES if p in out] + [p for p in out if p not in PHASES]:
        r = out[name]
        print(f"  {name:16s} {r['calls']:5d} {r['ops']:6d} {r['work']:6d} {r['syncs']:5d} "
              f"{r['h2d']:4d} {r['prof_ms']:8.1f} {r['cpu_ms']:7.1f}")  # fmt: skip
    return out


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
    sync = [e for e in events if e.name in SYNCS and not _under(e, "aten::_assert_async")]
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
