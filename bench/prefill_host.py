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
(``StepTimer``); ``--profile DIR:START:STEPS:extend`` writes the backend's own profile of those
extend batches (``--kv-profile``: the ops per phase and per line; on the GPU each launching op
costs the host ~5-15 us). Comparing two builds' numbers says which phase a TTFT change comes
from before a GPU profile does; ``--extend kernel`` under ``TRITON_INTERPRET=1`` runs the GPU's
phases (the kernel itself slowly):

    TRITON_INTERPRET=1 python bench/prefill_host.py --batch 4 --prompt 256 --chunk 256 \
        --extend kernel --out bench/results/prefill-host-cpu/HEAD.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
    ap.add_argument("--profile", default=None, help="--kv-profile (DIR:START:STEPS:extend: "
                    "extend batches under torch.profiler, the ops per phase; not with the "
                    "interpreted kernel: it records the interpreter's every op, 23 GB for 3 x "
                    "64 tokens)")  # fmt: skip
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))
    from sglang_decode import _commit  # bench/ is this script's folder
    from test_backend import Harness

    from tiered_radix.adapters.sglang.options import KVOptions
    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    policy = Path(a.policy).read_text()
    n = a.batch * (a.prompt // 32 + 8) + 8
    options = KVOptions(extend=a.extend, profile=a.profile)
    h = Harness(policy=policy, layers=a.layers, heads=2, head_dim=64, pages=n,
                blocks=PoolBlocks(2 * n, 2 * n), context=a.prompt + 64,
                requests=a.batch + 2, options=options)  # fmt: skip
    reqs = [
        h.start(f"r{i}", [(i * 7 + t * 3) % 97 + 1 for t in range(a.prompt)])
        for i in range(a.batch)
    ]
    plan = batches(a.prompt, a.batch, a.chunk)
    t0 = time.perf_counter()
    for b in plan:
        h.step([reqs[r] for r, _, _ in b],
               [reqs[r].origin_input_ids[s : s + k] for r, s, k in b], extend=True)  # fmt: skip
    t_extend = time.perf_counter() - t0
    t1 = time.perf_counter()
    h.step(reqs, [[5]] * a.batch, extend=False)  # the first token: a deferred routing runs
    t_first = time.perf_counter() - t1
    host = {k: round(v, 4) for k, v in sorted(h.backend.timer.host_s.items())}
    out = {"policy": Path(a.policy).stem, "batch": a.batch, "prompt": a.prompt,
           "chunk": a.chunk, "layers": a.layers, "extend_batches": len(plan),
           "extend_s": round(t_extend, 3), "first_decode_s": round(t_first, 3),
           "host_s": host, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "commit": _commit()}  # fmt: skip
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
