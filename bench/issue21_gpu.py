"""Issue 21 on the GPU: every shipped policy starts, and a burst does not crash the scheduler.

Runs on the GPU machine after ``bash bench/gpu_install.sh`` and staging Qwen2.5-0.5B
(``$TR_MODEL_PATH``, default /tmp/models/qwen2.5-0.5b), one ``sglang.Engine`` at a time:

- ``start``: for each shipped policy (``--policies``, default all of ``policies/*.yaml``),
  ``sglang.Engine(model_path, kv_policy=P, mem_fraction_static=0.5, context_length=32768)``, one
  short generation, shutdown. Records startup seconds, ``max_total_num_tokens`` and the
  sizing's byte split (:func:`~tiered_radix.adapters.sglang.sizing.pool_bytes` for the
  engine's slot count; the pool logs the same at startup), or the error.
- ``burst``: qevict with ``shares: {full: 100%, int2: 0%}`` (the issue's policy), 12 prompts of
  ~16K random tokens sent together (``--burst``, ``--prompt``), 32 new tokens each. Records
  whether every request finished, the time, and the backend's stats (``degraded_moves``:
  routings the pool was short of blocks for).

Writes ``issue21.json`` under ``--out``. Expected: every policy ``ok`` with
``max_total_num_tokens`` about what ``tiered-radix policy explain P --shape 24 2 64`` says of
a bf16 pool's: 9.4x (qevict), 5.2-5.7x (h2o, snapkv, streaming), 0.9-1x (full, kivi) and 1.66x
(rdkv: rows for a quarter of the slots beside the Zone A store; 0.79x in run 27, when every
slot kept its rows); the burst ``ok`` with 12
completions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `serving`, also under python -P
from serving.servers import KVGeometry  # noqa: E402

FULL100 = """
policy: qevict-full100
description: qevict with every budget byte for full precision (issue 21's burst).
budget: 10%
units: window(size=32)
protect:
  sinks: 4
  recent: 64
scores:
  score: cumulative(attn, decay=0.99)
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=32)
  evicted: evict
allocate:
  method: rank
  by: score
  shares: {full: 100%, int2: 0%}
  hysteresis: 10%
schedule: after_prefill, every(16)
ledger: write_once
"""


def engine(model: str, policy: str, stats: str | None = None):
    import sglang

    return sglang.Engine(
        model_path=model, kv_policy=policy, mem_fraction_static=0.5, context_length=32768,
        log_level="info", kv_stats=stats,
    )  # fmt: skip


def start(model: str, policy: str) -> dict:
    from tiered_radix.adapters.sglang import sizing
    from tiered_radix.policy import load_policy

    t0 = time.perf_counter()
    try:
        eng = engine(model, policy)
    except Exception as err:  # noqa: BLE001 - the record is the point
        return {"policy": policy, "ok": False, "error": repr(err)[:2000],
                "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    try:
        out = eng.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        info = eng.get_server_info()
        n = int(info.get("max_total_num_tokens") or 0)
        p, g = load_policy(policy), KVGeometry.of_model(model)
        split = (
            sizing.pool_bytes(n, g.kv_heads, g.head_dim, g.layers, 2, p, p.budget) if n else None
        )
        return {
            "policy": policy, "ok": True, "startup_s": round(time.perf_counter() - t0, 1),
            "max_total_num_tokens": n,
            "split_gib": None if split is None else {
                k: round(getattr(split, k) / (1 << 30), 3)
                for k in ("rows", "codes", "tables", "engine", "total")
            },
            "text": out["text"][:80],
        }  # fmt: skip
    finally:
        eng.shutdown()


def burst(model: str, n: int, tokens: int, out: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(FULL100)
    stats = str(out / "issue21-burst-stats.json")
    t0 = time.perf_counter()
    try:
        eng = engine(model, f.name, stats)
    except Exception as err:  # noqa: BLE001
        return {"ok": False, "error": repr(err)[:2000]}
    try:
        rng = random.Random(21)
        prompts = [[rng.randrange(100, 150000) for _ in range(tokens)] for _ in range(n)]
        params = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0.0}
        res = eng.generate(input_ids=prompts, sampling_params=params)
        done = [o["meta_info"]["completion_tokens"] for o in res]
        st = json.loads(Path(stats).read_text()) if Path(stats).exists() else {}
        return {"ok": all(d == 32 for d in done), "completions": done,
                "seconds": round(time.perf_counter() - t0, 1),
                "degraded_moves": st.get("degraded_moves"), "stats": st}  # fmt: skip
    except Exception as err:  # noqa: BLE001 - a scheduler crash surfaces here
        return {"ok": False, "error": repr(err)[:2000], "trace": traceback.format_exc()[-3000:]}
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["start", "burst", "both"])
    ap.add_argument("--model", default=os.environ.get("TR_MODEL_PATH", "/tmp/models/qwen2.5-0.5b"))
    ap.add_argument("--policies", default=None, help="comma list (default: policies/*.yaml)")
    ap.add_argument("--burst", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=16000)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shipped = sorted(p.stem for p in (Path(__file__).parents[1] / "policies").glob("*.yaml"))
    policies = a.policies.split(",") if a.policies else shipped
    rec: dict = {}
    if a.mode in ("start", "both"):
        rec["start"] = []
        for p in policies:
            rec["start"].append(start(a.model, p))
            print(json.dumps(rec["start"][-1])[:600], flush=True)
            (out / "issue21.json").write_text(json.dumps(rec, indent=1))  # kept if cut off
    if a.mode in ("burst", "both"):
        rec["burst"] = burst(a.model, a.burst, a.prompt, out)
        print(json.dumps({k: v for k, v in rec["burst"].items() if k != "stats"})[:1500])
    (out / "issue21.json").write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
