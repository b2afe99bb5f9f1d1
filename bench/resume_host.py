"""Host cost of the extend batch that resumes cached prompts (CPU harness, no GPU needed).

What ``bench/sglang_decode.py`` times at the start of each call: its prompts are in the radix
cache, so the call's first forward is one extend batch of every request with its whole prompt
matched (a view borrowing every window, a new engine seeded at the states the tree holds) and
one new token. GPU run 17 put ``metadata_extend`` at 19.9 ms of host time for that batch at
batch 8 (3.5 ms at batch 1). On the CPU test harness at Qwen2.5-0.5B's attention shapes (24
layers, 2 KV heads, d 64) with a qevict-shaped policy: ``--batch`` prompts prefilled, routed and
finished (cached), then the same prompts resumed with one new token each, that batch's
``init_forward_metadata`` under ``torch.profiler``: launching ATen ops, host syncs and
host-to-device copies from host values (``torch.tensor``), per function.

    python bench/resume_host.py --batch 1 8 --out bench/results/resume-host-cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))

FUNCS = [  # (module, class, attribute): functions whose ops are listed
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "init_forward_metadata"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_admit"),
    ("tiered_radix.adapters.sglang.backend", "TieredAttnBackend", "_open"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "open_view"),
    ("tiered_radix.adapters.sglang.radix", "TieredRadixCache", "sync_view"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "acquire"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "prepare_write"),
    ("tiered_radix.adapters.sglang.pool", "TieredKVPool", "end_step"),
    ("tiered_radix.engine.store", "TierStore", "__init__"),
    ("tiered_radix.engine.store", "TierStore", "append_tokens"),
    ("tiered_radix.engine.store", "TierStore", "seed_states"),
    ("tiered_radix.adapters.sglang.stats", "BackendStats", "borrowed"),
]


def run(batch: int, args) -> dict:
    import importlib

    from backend_host_ops import SYNCS, VIEWS
    from route_host import POLICY, _wrap, report
    from test_backend import Harness

    from tiered_radix.adapters.sglang import backend
    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    def stub(q, layout, plan, mass=None, **kw):  # host work only
        if mass is not None:
            mass.copy_(torch.rand(mass.shape, generator=gen) ** 8)
        return torch.zeros_like(q)

    gen = torch.Generator().manual_seed(batch)
    backend.decode.run = stub
    policy = POLICY.replace("EVERY", "16").replace("BUDGET", "40")
    pages = 2 * batch * (args.prompt // 32 + 4) + 8
    h = Harness(policy=policy, layers=args.layers, heads=2, head_dim=64, pages=pages,
                blocks=PoolBlocks(pages * 2 + 16, pages * 2 + 16), context=args.prompt + 64,
                requests=max(16, 2 * batch))  # fmt: skip
    for mod, obj, name in FUNCS:
        _wrap(getattr(importlib.import_module(mod), obj), name, f"X:{obj}.{name}")
    _wrap(torch.Tensor, "tolist", "SYNC:tolist")
    _wrap(torch.Tensor, "item", "SYNC:item")
    _wrap(torch, "_assert_async", "ASSERT")  # a host sync on CPU only: not counted
    made = []
    tensor = torch.tensor

    def counted(*a, **k):  # a host-to-device copy on CUDA where a device is given
        made.append(1)
        return tensor(*a, **k)

    prompts = [[(7 * j + i) % 97 + 1 for j in range(args.prompt)] for i in range(batch)]
    reqs = [h.start(f"a{i}", p) for i, p in enumerate(prompts)]
    h.step(reqs, prompts, extend=True)
    h.step(reqs, [[5]] * batch, extend=False)  # the routing deferred after the prompt
    for r in reqs:
        h.finish(r)
    again = [h.start(f"b{i}", p + [5]) for i, p in enumerate(prompts)]
    new = [(p + [5])[r.prefix_len :] + [9] for p, r in zip(prompts, again, strict=True)]
    torch.tensor = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            h.step(again, new, extend=True)
    finally:
        torch.tensor = tensor
    rows = report(prof.events(), SYNCS, VIEWS)
    return {"batch": batch, "prefix": again[0].prefix_len, "torch_tensor_calls": len(made),
            "ops": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--out", default=None, help="folder for resume_host.json")
    from route_host import run_batches

    run_batches(run, ap.parse_args(), "resume_host.json")


if __name__ == "__main__":
    main()
