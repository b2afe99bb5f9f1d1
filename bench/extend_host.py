"""CPU time of an extend batch that resumes cached prompts (one new token a request), through the
tiered SGLang backend's gathered attention (the first token of a chat's next turn).

Runs on the CPU test harness (tests/adapters/sglang_adapter) in the SGLang venv
(docs/sglang.md): 24 layers, a qevict-shaped policy (windows of 32, INT2, 10%), ``--batch``
prompts of ``--prompt`` tokens prefilled and routed, then three timed extends of one token each.

    python bench/extend_host.py --batch 4 --prompt 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "sglang_adapter"))
    from test_backend import KERNEL_POLICY, Harness

    from tiered_radix.adapters.sglang.sizing import PoolBlocks

    policy = (
        KERNEL_POLICY.replace("window(size=16)", "window(size=32)")
        .replace("group=16", "group=32")
        .replace("recent: 16", "recent: 64")
        .replace("40%", "10%")
    )
    n = a.batch * (a.prompt // 32 + 4) + 8
    from tiered_radix.adapters.sglang.options import KVOptions

    h = Harness(policy=policy, layers=a.layers, head_dim=64, pages=n,
                blocks=PoolBlocks(2 * n, 2 * n), context=a.prompt + 64,
                options=KVOptions(extend="sdpa"))  # fmt: skip
    reqs = [
        h.start(f"r{i}", [(i * 7 + t * 3) % 97 + 1 for t in range(a.prompt)])
        for i in range(a.batch)
    ]
    for r in reqs:
        h.step([r], [r.origin_input_ids], extend=True)
    st = h.sim.cache.states("r0", 0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; request r0 layer 0: "
          f"{int((st != 3).any(0).sum())} of {st.shape[1]} windows read by some head")  # fmt: skip
    for rep in range(3):
        h.backend.timer.host_s.clear()
        t0 = time.perf_counter()
        h.step(reqs, [[5 + rep]] * a.batch, extend=True)
        dt = time.perf_counter() - t0
        print(f"extend of 1 token x {a.batch} over {a.prompt}: {dt:.3f} s "
              f"(attention {h.backend.timer.host_s['extend_attend']:.3f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
