"""Host cost of a whole prefill under a shipped policy (CPU harness, no GPU needed): the time to
first token's share that is the tiered backend's own work.

Drives the CPU harness of ``tests/adapters/sglang_adapter`` at Qwen2.5-0.5B's attention shapes
(``--layers`` layers, 2 KV heads, head dim 64) with a policy file (default
``policies/qevict.yaml``): ``--batch`` prompts of ``--prompt`` tokens, prefilled in extend batches
of at most ``--chunk`` tokens the way SGLang's chunked prefill packs them (one request's chunk
after another, several requests in a batch when they fit), then one decode step (the first
token: a deferred routing runs at the prompt's end). The extend attends through the CPU gather
path (``--kv-extend sdpa``): its time is not the GPU kernel's, the other phases' host work is
the same Python and dispatcher calls as on the GPU.

Reported: wall seconds of the whole prefill, the backend's host seconds per phase
(``StepTimer``), and with ``--ops`` the launching ATen ops per phase from ``torch.profiler``
(on the GPU each costs the host ~5-15 us). Comparing two builds' numbers says which phase a
TTFT change comes from before a GPU profile does.

    python bench/prefill_host.py --batch 8 --prompt 8192 --chunk 8192 --ops
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def batches(prompt: int, n: int, chunk: int) -> list[list[tuple[int, int, int]]]:
    """SGLang's chunked prefill order: extend batches of ``(request, start, tokens)`` holding at
    most ``chunk`` tokens, requests taken in order, the last one of a batch cut to fit."""
    out, cur, room = [], [], chunk
    for r in range(n):
        start = 0
        while start < prompt:
            take = min(prompt - start, room)
            cur.append((r, start, take))
            start, room = start + take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], chunk
    if cur:
        out.append(cur)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default=str(ROOT / "policies" / "qevict.yaml"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--extend", default="sdpa", help="--kv-extend: sdpa, or kernel (on the "
                    "CPU under TRITON_INTERPRET=1: the GPU's phases, slowly)")  # fmt: skip
    ap.add_argument("--ops", action="store_true", help="count launching ops per phase")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))
    from test_backend import Harness

    from tiered_radix.adapters.sglang.options import KVOptions
    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    policy = Path(a.policy).read_text()
    n = a.batch * (a.prompt // 32 + 8) + 8
    h = Harness(policy=policy, layers=a.layers, heads=2, head_dim=64, pages=n,
                blocks=PoolBlocks(2 * n, 2 * n), context=a.prompt + 64,
                requests=a.batch + 2, options=KVOptions(extend=a.extend))  # fmt: skip
    reqs = [
        h.start(f"r{i}", [(i * 7 + t * 3) % 97 + 1 for t in range(a.prompt)])
        for i in range(a.batch)
    ]
    plan = batches(a.prompt, a.batch, a.chunk)
    ops: Counter = Counter()
    t0 = time.perf_counter()
    for b in plan:
        step = lambda b=b: h.step(  # noqa: E731
            [reqs[r] for r, _, _ in b],
            [reqs[r].origin_input_ids[s : s + k] for r, s, k in b], extend=True)  # fmt: skip
        if a.ops:
            ops += profiled(step)
        else:
            step()
    t_extend = time.perf_counter() - t0
    t1 = time.perf_counter()
    step = lambda: h.step(reqs, [[5]] * a.batch, extend=False)  # noqa: E731
    if a.ops:
        ops += profiled(step)
    else:
        step()
    t_first = time.perf_counter() - t1
    host = {k: round(v, 4) for k, v in sorted(h.backend.timer.host_s.items())}
    out = {"policy": Path(a.policy).stem, "batch": a.batch, "prompt": a.prompt,
           "chunk": a.chunk, "layers": a.layers, "extend_batches": len(plan),
           "extend_s": round(t_extend, 3), "first_decode_s": round(t_first, 3),
           "host_s": host, "torch": torch.__version__,
           "threads": torch.get_num_threads()}  # fmt: skip
    if a.ops:
        out["ops_by_phase"] = dict(ops.most_common())
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


def profiled(fn) -> Counter:
    """Run ``fn`` under ``torch.profiler``; the top-level ATen ops below each ``tr:`` phase."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: Counter = Counter()

    def walk(ev, phase: str) -> None:
        for c in ev.cpu_children:
            if c.name.startswith("tr:"):
                walk(c, c.name)
            elif c.name.startswith("aten::"):
                counts[phase] += 1
            else:
                walk(c, phase)

    for e in prof.events():
        if e.cpu_parent is None:
            if e.name.startswith("tr:"):
                walk(e, e.name)
            elif e.name.startswith("aten::"):
                counts["outside"] += 1
            else:
                walk(e, "outside")
    return counts


if __name__ == "__main__":
    main()
