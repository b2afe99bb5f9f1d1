"""Peak host memory of one decode step's list rebuild under CUDA graphs (CPU, no GPU needed).

GPU run 32's soak lost snapkv's and streaming's servers to CUDA out-of-memory: a token-unit
step built its decode candidates (:func:`tiered_radix.adapters.sglang.trizone.candidates`)
for every layer at once, spanning the context (``n_max``) per request. This measures what one
rebuild (``GraphDecode.load``) allocates at its peak, on tensors in host memory with the same
shapes as on the GPU, three ways:

- ``context``: every layer at once, each request spanning the context (the build of run 32,
  reproduced by listing a padding request of the context's length, which the kernel skips);
- ``batch``: every layer at once, spanning the batch's longest request;
- ``runs``: a few layers at a time (``trizone.candidate_chunks``, the build served now).

The pool is Qwen2.5-0.5B's attention shape (24 layers, 2 KV heads, head dim 64) with h2o's
layout (token units, rows only); ``--batch`` requests of ``--min``-``--max`` tokens, every
token kept. Each way runs in a fresh process; the peak is the process's peak resident memory
less its resident memory before the rebuild (the pool and buffers already allocated).

    python bench/decode_lists_memory.py --batch 64 --out bench/results/decode-lists-memory
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import host_peak
import torch
from torch.utils._python_dispatch import TorchDispatchMode

WAYS = ("context", "batch", "runs")
L, H, D, W = 24, 2, 64, 1


def pool_and_views(lengths: list[int]):
    """A pool namespace with the fields the list build reads (block tables, owner states, the
    layout), every request's windows its own at full precision."""
    from tiered_radix.adapters.sglang.reps import S_FULL

    total = sum(lengths)
    layout = SimpleNamespace(window=W, quant=None)
    pool = SimpleNamespace(
        layer_num=L, head_num=H, head_dim=D, device="cpu", layout=layout, zones=None,
        page_bytes=0,
        block_all=torch.arange(total, dtype=torch.int32).repeat(L, 1, H, 1),  # [L, K=1, H, n]
        owner_all=torch.full((L, H, total), S_FULL, dtype=torch.int8),
    )  # fmt: skip
    views, at = [], 0
    for n in lengths:
        views.append(SimpleNamespace(
            windows=torch.arange(at, at + n), borrowed=torch.zeros(n, dtype=torch.bool),
            state=torch.zeros(L, H, n, dtype=torch.int8),
        ))  # fmt: skip
        at += n
    return pool, views


class OpCount(TorchDispatchMode):
    """Counts the ATen ops run under it: each is a kernel launch (or more) on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def one(way: str, lengths: list[int], context: int) -> dict:
    """One rebuild the ``way`` says, in this process: its peak bytes over the resident ones
    before it, its wall seconds, the candidate entries it built and the ATen ops of a second
    rebuild (the host's launches a step, whatever the CPU's speed)."""
    from tiered_radix.adapters.sglang import graph, trizone

    if way == "context":  # a padding request of the context's length: every span is n_max
        lengths = [*lengths, context]
    pool, views = pool_and_views(lengths)
    seqs = list(lengths)
    bs = len(lengths)
    g = graph.GraphDecode(pool, bs, sum(seqs) + W * bs, context, side_output=False)
    entries = L * bs * H * max(lengths) * W

    def rebuild() -> None:
        if way == "runs":
            g.load(bs, trizone.candidate_chunks(pool, views, seqs, g.n_max, ahead=True))
        else:
            g.load(bs, trizone.candidates(pool, views, seqs, g.n_max, ahead=True))

    before, t0 = host_peak.rss_bytes(), time.perf_counter()
    rebuild()
    out = {"way": way, "peak_over_resident_bytes": max(host_peak.peak_bytes() - before, 0),
           "seconds": time.perf_counter() - t0, "entries": entries,
           "runs": len(trizone.layer_chunks(pool, lengths)) if way == "runs" else 1}  # fmt: skip
    with OpCount() as count:
        rebuild()
    return out | {"aten_ops": count.ops}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    host_peak.batch_args(p, WAYS, batch=64)
    p.add_argument("--context", type=int, default=32768)
    args = p.parse_args()
    lengths = host_peak.lengths(args)
    if args.one:
        print(json.dumps(one(args.one, lengths, args.context)))
        return
    argv = ["--batch", str(args.batch), "--min", str(args.min), "--max", str(args.max),
            "--context", str(args.context)]  # fmt: skip
    rows = host_peak.run_ways(__file__, WAYS, argv)
    for r in rows:
        print(
            f"{r['way']:8s} peak {r['peak_over_resident_bytes'] / 2**30:6.2f} GiB  "
            f"{r['seconds']:6.2f} s  {r['entries'] / 1e6:7.1f} M entries  {r['runs']} run(s)"
            f"  {r['aten_ops']} ops"
        )
    result = {"shape": {"layers": L, "kv_heads": H, "head_dim": D, "window": W},
              "batch": args.batch, "tokens": [args.min, args.max], "context": args.context,
              "torch": torch.__version__, "rows": rows}  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode-lists-memory.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
