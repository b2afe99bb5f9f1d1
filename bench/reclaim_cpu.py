"""Multi-turn chat on a row-starved tiered pool: what new prompts take from the radix cache.

Run 19's serving benchmark (`results/sglang-run19/`) found the qevict pool's row blocks (where
a prompt is prefilled at full precision before routing demotes it) the binding limit: new
prompts evicted whole cached conversations for their rows, and the next turns re-prefilled
them (hit rate 0.11). The pool now first demotes the cached windows' rows to their ledger
copies (the prefix stays cached, quantized) and evicts only what the ledger cannot take.

This drives the CPU harness of ``tests/adapters/sglang_adapter`` (the real pool, radix cache and
attention backend; the decode kernel stubbed, prefill through the CPU path) with ``--convs``
conversations of ``--history`` tokens, ``--turns`` turns each taken round-robin (every turn
sends the whole conversation so far, a ``--question``-token question, ``--answer`` decoded
tokens), over a pool whose row blocks hold ``--row-prompts`` histories at full precision and
whose ledger has room for every conversation's copies, with the pool's reclaim as shipped
(``demote``) and with demotion turned off (``evict``, the behaviour run 19 measured). Reported
per mode: hit rate (matched prefix tokens / prompt tokens of turns after the first), re-prefilled
tokens, windows demoted and tokens evicted for rows, wall seconds.

    python bench/reclaim_cpu.py --out bench/results/reclaim-cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))

# qevict's shape at CPU size: windows of 8, INT2, 10% of the bytes, routed after each prefill
POLICY = """
policy: reclaim-bench
budget: 10%
units: window(size=8)
protect: {sinks: 4, recent: 16}
scores:
  score: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=8)
  evicted: evict
allocate: {method: rank, by: score, shares: {full: 50%, int2: 50%}}
schedule: after_prefill
ledger: write_once
"""


def run(mode: str, args) -> dict:
    """One mode's conversations (see the module docstring): its row of the results."""
    from tiered_radix.adapters.sglang import backend

    args = argparse.Namespace(**vars(args), mode=mode)
    gen = torch.Generator().manual_seed(0)

    def stub(q, layout, plan, mass=None, **kw):  # cache behaviour only: random mass, zeros out
        if mass is not None:
            mass.copy_(torch.rand(mass.shape, generator=gen) ** 8)
        return torch.zeros_like(q)

    kernel, backend.decode.run = backend.decode.run, stub
    try:
        return _chat(args)
    finally:
        backend.decode.run = kernel


def _chat(args) -> dict:
    from test_backend import Harness

    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    W, H = 8, args.heads
    longest = args.history + args.turns * (args.question + args.answer)
    pages = args.convs * (longest // W + 2) + 8  # slots: every conversation stays cached
    rows = int(args.row_prompts * (args.history // W) * H)  # full precision for that many histories
    h = Harness(policy=POLICY, layers=args.layers, heads=H, head_dim=args.head_dim, pages=pages,
                blocks=PoolBlocks(rows, pages * H), context=longest + 64)  # fmt: skip
    if args.mode == "evict":  # the reclaim before demotion: cached prefixes are evicted for rows
        h.sim.pool._demote_cached = lambda tree, need, layers: None
    rng = torch.Generator().manual_seed(1)
    convs = [torch.randint(1, 100, (args.history,), generator=rng).tolist()
             for _ in range(args.convs)]  # fmt: skip
    prompt_tokens = matched = 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for c, conv in enumerate(convs):
            conv += torch.randint(1, 100, (args.question,), generator=rng).tolist()
            req = h.start(f"c{c}t{turn}", conv)
            if turn:
                prompt_tokens += len(conv)
                matched += req.prefix_len
            h.step([req], [conv[req.prefix_len :]], extend=True)
            for _ in range(args.answer):
                tok = int(torch.randint(1, 100, (), generator=rng))
                h.step([req], [[tok]], extend=False)
            conv[:] = list(req.tokens)
            h.finish(req)
    took = h.sim.pool.reclaimed
    return {
        "mode": args.mode,
        "hit_rate": round(matched / prompt_tokens, 4),
        "reprefilled_tokens": prompt_tokens - matched,
        "later_turn_prompt_tokens": prompt_tokens,
        **took,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--convs", type=int, default=10)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--history", type=int, default=320)
    p.add_argument("--question", type=int, default=16)
    p.add_argument("--answer", type=int, default=8)
    p.add_argument("--row-prompts", type=float, default=1.3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = [run(mode, args) for mode in ("demote", "evict")]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        run_args = vars(args) | {"out": str(args.out)}
        out = {"command": sys.argv, "torch": torch.__version__, "args": run_args, "rows": rows}
        (args.out / "reclaim.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
