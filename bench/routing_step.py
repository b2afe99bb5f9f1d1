"""Time one routing step of the tier engine (issue target: 32 layers x 8 KV heads x 128K tokens,
32-token windows, < 5 ms on an H200).

Measured separately after ``--warmup`` untimed plans, each the median over ``--repeats`` steps
(default 20; fresh random attention each step, so scores and tiers change):

- ``plan_ms``: scores -> tiers for every layer (``TierStore.plan``) plus the transition masks
  (which units change, and how): the allocation/bookkeeping part of ``route()``.
- ``apply_ms``: moving data (quantizing demoted units into the ledger, restoring promoted rows,
  poisoning freed rows) and recording the step.

CUDA events on ``--device cuda``, wall clock with synchronisation otherwise. ``--tiny`` runs a
small configuration on CPU in seconds (a smoke run for this script).

    python bench/routing_step.py --device cuda --out bench/results
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
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t) * 1e3


def build(args, device: torch.device) -> TierStore:
    pol = load_policy(args.policy)
    store = TierStore(
        pol,
        n_layers=args.layers,
        n_heads=args.heads,
        head_dim=args.head_dim,
        dtype=torch.bfloat16,
        device=device,
        max_tokens=args.tokens,
        budget_override=Budget("fraction", args.budget),
    )
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.heads, args.tokens, args.head_dim)
    for li in range(args.layers):
        k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        store.append(li, k, v)
    return store


def observe(store: TierStore, args, device: torch.device, seed: int) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    for li in range(args.layers):
        a = torch.rand(args.heads, args.tokens, generator=g, device=device) ** 8
        store.observe(li, Signals(attn=a / a.sum(1, keepdim=True)))


def transition_masks(store: TierStore, plan) -> int:
    """What ``route()`` derives from the plan before moving data: the changed units."""
    n = []
    for li, new in enumerate(plan.v):
        old = store.layers[li].v.tier[:, : new.shape[1]]
        n.append((new != old).sum())
    return int(torch.stack(n).sum())  # the one host sync at the end


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
    ap.add_argument("--warmup", type=int, default=3, help="untimed plans before timing")
    ap.add_argument("--tiny", action="store_true", help="2 layers x 2 heads x 2048 tokens, CPU")
    ap.add_argument("--out", default=None, help="folder for routing_step.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.heads, args.tokens, args.head_dim, args.repeats = 2, 2, 2048, 64, 3
        args.warmup = 1
    device = torch.device(args.device)
    store = build(args, device)
    observe(store, args, device, 1)
    with Timer(device) as first:
        store.route("after_prefill")  # quantizes most of the cache once
    for _ in range(args.warmup):  # plan() does not change the store
        transition_masks(store, store.plan())
    plan_ms, moved, apply_ms = [], [], []
    for r in range(args.repeats):
        observe(store, args, device, 2 + r)
        with Timer(device) as t:
            plan = store.plan()
            moved.append(transition_masks(store, plan))
        plan_ms.append(t.ms)
        with Timer(device) as t:
            store.apply(plan, f"bench {r}")
        apply_ms.append(t.ms)
    units = sum(store.tiers(li).numel() for li in range(args.layers))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": versions(),
        "timer": "cuda events" if device.type == "cuda" else "wall clock",
        "warmup": args.warmup,
        "policy": args.policy,
        "layers": args.layers,
        "kv_heads": args.heads,
        "tokens": args.tokens,
        "head_dim": args.head_dim,
        "budget": args.budget,
        "units": units,
        "repeats": args.repeats,
        "plan_ms_median": statistics.median(plan_ms),
        "plan_ms": plan_ms,
        "apply_ms_median": statistics.median(apply_ms),
        "apply_ms": apply_ms,
        "first_route_ms": first.ms,
        "units_moved": moved,
        "occupancy": store.occupancy(),
        "bytes_used": store.bytes_used(),
        "budget_bytes": store.budget_bytes(),
        "target_ms": 5.0,
        "meets_target": statistics.median(plan_ms) < 5.0,
    }
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    if args.out:
        out = Path(args.out) / "routing_step.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
