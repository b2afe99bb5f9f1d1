"""Peak host memory of one routing step over a server's requests (CPU, no GPU needed).

GPU run 33's soak lost streaming's server to CUDA out-of-memory inside a routing
(``allocate_rank._fill``, 330 MiB asked) while its neighbour, h2o's server, had grown to
48 GiB: a step that routes many requests stacks them (:func:`tiered_radix.engine.planner.
plan_routes`) into ``[B * L, H, U]`` tables padded to the longest request, and token units make
``U`` the token count. This measures what one plan of ``--batch`` requests allocates at its
peak, on tensors in host memory with the GPU's shapes, two ways:

- ``one-pass``: every request in one stack (the build of run 33);
- ``passes``: stores of like lengths in passes of at most ``planner._RANK_TABLE_BYTES`` of
  allocator tables (the build served now).

``--step land`` measures the step after the plan instead: the moves of the planned tiers
(:meth:`~tiered_radix.engine.store.TierStore.begin_routes` then ``land``: masks and counts over
every unit slot of the stores moving together), ``one-pass`` as one
:class:`~tiered_radix.engine.stacked.StackedMoves`, ``passes`` in parts of at most
``pending._MOVE_SLOTS`` unit slots. Both ways' tiers after the move are compared.

The stores are Qwen2.5-0.5B's attention shape (24 layers, 2 KV heads, head dim 64) under the
named shipped policy at its default budget, rows held elsewhere (as the SGLang pool's),
``--batch`` requests of ``--min``-``--max`` tokens with random prefill signals. Each way runs in
a fresh process; the peak is the process's peak resident memory less its resident memory
before the plan (the stores already built). Both ways' plans are compared (equal tiers).

    python bench/routing_memory.py --policy h2o --batch 32 --out bench/results/routing-memory
    python bench/routing_memory.py --step land --policy h2o --batch 32 \
        --out bench/results/routing-memory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import host_peak
import torch

WAYS = ("one-pass", "passes")
L, H, D = 24, 2, 64


def stores(policy_name: str, lengths: list[int]) -> list:
    """One store a request, its prompt counted and observed (every signal a prefill gives)."""
    from tiered_radix import load_policy
    from tiered_radix.engine.signals import Signals
    from tiered_radix.engine.store import TierStore

    policy = load_policy(policy_name)
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        s = TierStore(policy, n_layers=L, n_heads=H, head_dim=D, dtype=torch.bfloat16,
                      reader=lambda li: None)  # fmt: skip
        s.append_tokens(None, n)
        attn = torch.rand(L, H, n, generator=g) + 1e-3
        s.observe_layers(Signals(
            attn=attn / attn.sum(-1, keepdim=True),
            colmass=torch.rand(L, H, n, generator=g) * 4 + 0.01,
            obs_attn=torch.rand(L, H, n, generator=g) + 0.01,
            qnorm=torch.rand(L, H, D, generator=g) + 0.1,
        ))  # fmt: skip
        out.append(s)
    return out


def one(way: str, policy: str, lengths: list[int], step: str = "plan") -> dict:
    """One plan (or move: ``step``) of every store the ``way`` says, in this process: its peak
    bytes over the resident ones before it, its wall seconds, the passes and a digest of the
    tiers."""
    from tiered_radix.engine import pending, planner
    from tiered_radix.engine.store import TierStore

    ss = stores(policy, lengths)
    if way == "one-pass":
        planner._RANK_TABLE_BYTES = 1 << 62
        pending._MOVE_SLOTS = 1 << 62
    if step == "plan":
        passes = len(planner._rank_passes(ss))
        before, t0 = host_peak.rss_bytes(), time.perf_counter()
        tiers = [p.tiers for p in planner.plan_routes(ss)]
    else:
        passes = len(pending.move_parts([s.stack for s in ss]))
        before, t0 = host_peak.rss_bytes(), time.perf_counter()
        TierStore.begin_routes(ss, ["bench"] * len(ss)).land()
        tiers = [s.stack.tier for s in ss]
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256()
    for t in tiers:
        digest.update(t.numpy().tobytes())
    return {"way": way, "peak_over_resident_bytes": max(host_peak.peak_bytes() - before, 0),
            "seconds": seconds, "passes": passes, "units": L * H * sum(lengths),
            "stacked_units": L * H * len(lengths) * max(lengths),
            "tiers_sha256": digest.hexdigest()[:16]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    host_peak.batch_args(p, WAYS, batch=32)
    p.add_argument("--policy", default="h2o")
    p.add_argument(
        "--step",
        choices=("plan", "land"),
        default="plan",
        help="plan: the routing's plan; land: the moves of the planned tiers",
    )
    args = p.parse_args()
    lengths = host_peak.lengths(args)
    if args.one:
        print(json.dumps(one(args.one, args.policy, lengths, args.step)))
        return
    argv = ["--policy", args.policy, "--batch", str(args.batch), "--min", str(args.min),
            "--max", str(args.max), "--step", args.step]  # fmt: skip
    rows = host_peak.run_ways(__file__, WAYS, argv)
    for r in rows:
        print(
            f"{r['way']:9s} peak {r['peak_over_resident_bytes'] / 2**30:6.2f} GiB  "
            f"{r['seconds']:6.2f} s  {r['passes']:2d} pass(es)  tiers {r['tiers_sha256']}"
        )
    same = len({r["tiers_sha256"] for r in rows}) == 1
    print("plans equal" if same else "PLANS DIFFER")
    result = {"step": args.step, "shape": {"layers": L, "kv_heads": H, "head_dim": D},
              "policy": args.policy,
              "batch": args.batch, "tokens": [args.min, args.max], "torch": torch.__version__,
              "plans_equal": same, "rows": rows}  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        step = "" if args.step == "plan" else f"-{args.step}"
        name = f"routing-memory{step}-{args.policy}-b{args.batch}.json"
        (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
