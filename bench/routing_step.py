"""Time one routing step of the tier engine (issue target: 32 layers x 8 KV heads x 128K tokens,
32-token windows, < 5 ms on an H200).

After ``--warmup`` untimed routing steps, ``--repeats`` steps (default 20) are timed, each after
``--decode`` new tokens per layer (default 16: a route every 16 decode steps, so the cache grows
and a partial window appears) and one fresh random attention (so scores and tiers change). Per
step, with three CUDA events (wall clock with synchronisation on CPU):

- ``plan_ms``: scores -> tiers for every layer (``TierStore.plan``);
- ``apply_ms``: transition masks, quantizing newly demoted units into the ledger, restoring
  promoted rows, poisoning freed rows, the step's record (``TierStore.apply``);
- ``route_ms``: both, i.e. one ``route()`` (the device is idle when it starts).

``plan()`` never waits for the device, so on CUDA device work it queued may finish inside the
``apply`` interval; ``route_ms`` is exact.

``--stores N`` instead times N requests' stores of one policy (token counts ``--tokens + 37 i``,
so their units differ) routed at the same step, the way the SGLang backend routes a batch: one
``route()`` each (``alone_ms``) against ``TierStore.route_many`` (``together_ms``: one plan over
all of them, :func:`~tiered_radix.engine.planner.plan_routes`), on twin sets of stores that get
the same tokens and attention; ``same_tiers`` checks that both decided alike
(``routing_many.json``).

Medians are reported. ``--count`` adds, from one extra step under ``torch.profiler``: top-level
aten ops per plan/apply (a proxy for kernel launches; on CPU the count does not depend on the
token count) and, on CUDA, kernels launched and synchronising calls
(``torch.cuda.set_sync_debug_mode``). ``--tiny`` runs a small configuration on CPU in seconds.

    python bench/routing_step.py --device cuda --count --out bench/results
    python bench/routing_step.py --tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tiered_radix import load_policy
from tiered_radix.engine.signals import Signals
from tiered_radix.engine.store import TierStore
from tiered_radix.policy.model import Budget


class Timer:
    """Marks on the device's timeline; ``ms()`` gives the gaps between consecutive marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            pairs = zip(self.marks, self.marks[1:], strict=False)
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]


def build(args, device: torch.device, tokens: int | None = None) -> TierStore:
    """A store of ``tokens`` (default ``--tokens``) random K/V rows in every layer."""
    tokens = args.tokens if tokens is None else tokens
    pol = load_policy(args.policy)
    store = TierStore(
        pol,
        n_layers=args.layers,
        n_heads=args.heads,
        head_dim=args.head_dim,
        dtype=torch.bfloat16,
        device=device,
        max_tokens=tokens + args.decode * (args.warmup + args.repeats + 2),
        budget_override=Budget("fraction", args.budget),
    )
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.heads, tokens, args.head_dim)
    for li in range(args.layers):
        k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        store.append(li, k, v)
    return store


def observe(store: TierStore, args, device: torch.device, seed: int) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    for li in range(args.layers):
        a = torch.rand(args.heads, store.n_tokens(li), generator=g, device=device) ** 8
        store.observe(li, Signals(attn=a / a.sum(1, keepdim=True)))


def decode(store: TierStore, args, device: torch.device, seed: int) -> None:
    """Append ``--decode`` tokens to every layer, then observe the newest query's attention."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (args.heads, args.decode, args.head_dim)
    if args.decode:
        for li in range(args.layers):
            k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
            store.append(li, k, torch.randn_like(k))
    observe(store, args, device, seed)


def step(store: TierStore, device: torch.device, r: int) -> tuple[float, float, float, int]:
    """One timed route(): plan, apply and total ms, and the number of units moved."""
    if device.type == "cuda":  # no queued observe() work to hide the launches behind
        torch.cuda.synchronize()
    t = Timer(device)
    t.mark()
    plan = store.plan()
    t.mark()
    moved = store.apply(plan, f"bench {r}")
    t.mark()
    plan_ms, apply_ms = t.ms()
    return plan_ms, apply_ms, plan_ms + apply_ms, len(moved)


def count(store: TierStore, device: torch.device) -> dict:
    """Ops (and on CUDA kernels and synchronising calls) of one plan and one apply."""
    import warnings

    from torch.profiler import DeviceType, ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    plan = None
    for name in ("plan", "apply"):
        with warnings.catch_warnings(record=True) as w, profile(activities=acts) as p:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            plan = store.plan() if name == "plan" else store.apply(plan, "count")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
        ev = p.events()
        top = [
            e
            for e in ev
            if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        ]
        out[f"{name}_ops"] = len(top)
        if device.type == "cuda":
            out[f"{name}_kernels"] = sum(e.device_type == DeviceType.CUDA for e in ev)
            out[f"{name}_syncs"] = sum("synchroniz" in str(x.message) for x in w)
    return out


def many(args, device: torch.device) -> dict:
    """``--stores``: routing N stores one by one vs together (see the module docstring)."""
    twins = []
    for _ in range(2):
        stores = []
        for i in range(args.stores):
            stores.append(build(args, device, args.tokens + 37 * i))
            observe(stores[-1], args, device, 1 + i)
            stores[-1].route("after_prefill")
        twins.append(stores)
    alone_ms, together_ms = [], []
    for r in range(args.warmup + args.repeats):
        for stores in twins:
            for i, s in enumerate(stores):
                decode(s, args, device, 100 * r + i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = Timer(device)
        t.mark()
        for s in twins[0]:
            s.route(f"bench {r}")
        t.mark()
        TierStore.route_many(twins[1], [f"bench {r}"] * args.stores)
        t.mark()
        if r >= args.warmup:
            a, b = t.ms()
            alone_ms.append(a)
            together_ms.append(b)
    same = all(
        torch.equal(a.tiers(li), b.tiers(li))
        for a, b in zip(*twins, strict=True)
        for li in range(args.layers)
    )
    med = statistics.median
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": versions(),
        "timer": "cuda events" if device.type == "cuda" else "wall clock",
        "policy": args.policy, "stores": args.stores, "layers": args.layers,
        "kv_heads": args.heads, "tokens": args.tokens, "head_dim": args.head_dim,
        "decode_tokens_per_step": args.decode, "repeats": args.repeats,
        "alone_ms_median": med(alone_ms), "together_ms_median": med(together_ms),
        "speedup": med(alone_ms) / med(together_ms), "same_tiers": same,
        "alone_ms": alone_ms, "together_ms": together_ms,
    }  # fmt: skip


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["cuda"] = torch.version.cuda
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policy", default="qevict")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128 * 1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed routing steps first")
    ap.add_argument("--decode", type=int, default=16, help="tokens appended per routing step")
    ap.add_argument("--count", action="store_true", help="count ops/kernels/syncs per step")
    ap.add_argument("--tiny", action="store_true", help="2 layers x 2 heads x 2048 tokens, CPU")
    ap.add_argument("--stores", type=int, default=1, help="N stores: alone vs route_many")
    ap.add_argument("--out", default=None, help="folder for routing_step.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.heads, args.tokens, args.head_dim, args.repeats = 2, 2, 2048, 64, 3
        args.warmup = 1
    device = torch.device(args.device)
    if args.stores > 1:
        result = many(args, device)
        print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "routing_many.json").write_text(json.dumps(result, indent=1))
        return result
    store = build(args, device)
    observe(store, args, device, 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = Timer(device)
    t.mark()
    store.route("after_prefill")  # quantizes most of the cache once
    t.mark()
    (first_ms,) = t.ms()
    for r in range(args.warmup):
        decode(store, args, device, 1000 + r)
        store.route(f"warmup {r}")
    plan_ms, apply_ms, route_ms, moved = [], [], [], []
    for r in range(args.repeats):
        decode(store, args, device, 2 + r)
        for col, x in zip(
            (plan_ms, apply_ms, route_ms, moved), step(store, device, r), strict=True
        ):
            col.append(x)
    counts = {}
    if args.count:
        decode(store, args, device, 999)
        counts = count(store, device)
    units = sum(store.tiers(li).numel() for li in range(args.layers))
    med = statistics.median
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": versions(),
        "timer": "cuda events" if device.type == "cuda" else "wall clock",
        "warmup": args.warmup,
        "decode_tokens_per_step": args.decode,
        "policy": args.policy,
        "layers": args.layers,
        "kv_heads": args.heads,
        "tokens": args.tokens,
        "head_dim": args.head_dim,
        "budget": args.budget,
        "units": units,
        "repeats": args.repeats,
        "plan_ms_median": med(plan_ms),
        "apply_ms_median": med(apply_ms),
        "route_ms_median": med(route_ms),
        "plan_ms": plan_ms,
        "apply_ms": apply_ms,
        "route_ms": route_ms,
        "first_route_ms": first_ms,
        "units_moved": moved,
        **counts,
        "occupancy": store.occupancy(),
        "bytes_used": store.bytes_used(),
        "budget_bytes": store.budget_bytes(),
        "target_ms": 5.0,
        "meets_target": med(route_ms) < 5.0,
    }
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    if args.out:
        out = Path(args.out) / "routing_step.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
