"""Decode time per output token and peak KV bytes at ~30K context: plain SGLang vs a tiered policy.

Runs on the GPU machine (``bash bench/run_sglang_gpu.sh``), one ``sglang.Engine`` at a time:

- ``plain``: SGLang 0.5.17 with its Triton attention backend, bf16 KV, CUDA graphs on;
- ``tiered``: ``kv_policy=POLICY`` (default qevict at its 10% budget), decode CUDA graphs on,
  the launch's defaults (SGLang's overlap scheduler on since GPU run 17; through run 17
  ``tiered`` ran without it, as ``tiered_serial`` does now);
  ``--chunk N`` sets SGLang's ``chunked_prefill_size`` for every kind (plain too, so both
  prefill in the same chunks); without it each kind keeps SGLang's default (GPU run 15 and
  earlier ran the tiered kinds at 2,048 and plain at SGLang's default);
- ``tiered_serial``: ``tiered`` without the overlap scheduler (``kv_overlap=False``);
- ``tiered_pg``: ``tiered`` with SGLang's prefill CUDA graphs (``kv_prefill_graphs=True``: its
  breakable graphs hold the layers between attention calls, up to its largest captured
  bucket; plain captures them by default);
- ``tiered_overlap``: ``tiered`` with ``kv_overlap=True`` said (the default now; runs 12-17
  compared it with the serial ``tiered``);
- ``plain_serial``: ``plain`` without the overlap scheduler (``disable_overlap_schedule``);
- ``tiered_eager``: the same with CUDA graphs off (what every run before GPU run 8 measured);
- ``tiered_step``: ``tiered`` observing each replayed step's attention on the host
  (``kv_observe="step"``, every run before GPU run 9) instead of summing it on the
  device between routings.
- ``tiered_server_clock``: ``tiered`` with ``kv_route_clock="server"`` (every running request
  routes together on the server's step count instead of each on its own).

Tiered runs time each graph replay on the device (``kv_device_times=True``: two CUDA
events a step), reported per step as ``replay_device`` beside the host phases.

Every kind captures decode graphs up to batch ``--graph-max-bs`` (startup time on a shared
device; the measured batches are below it).

Per batch size: prompts of ``--context`` random tokens (distinct per request) are prefilled once
(one new token) and stay in the radix cache; then the same prompts are generated again with
``ignore_eos``, ``--short`` and ``--long`` new tokens. Both calls match the cached prompt (the
tiered run reads it at the tiers its first request left), so they are decode only, and the decode
time per output token is (t_long - t_short) / (long - short), each the faster of two calls;
``decode_ms_per_token_ex`` is (t_long - t_extend) / (long - 1) with ``t_extend`` a call of one new
token (the extend over the cached prompt alone), a check on the extend's spread between calls.
Peak KV bytes of the tiered run come from the backend's stats (SGLang's ``/server_info``: most
pool bytes held after a forward, over the whole run); the bf16 baseline holds
``2 * 2 * L * H_kv * d`` bytes for each token the allocator held then (running requests and
prompts cached in the radix tree, as plain SGLang's pool would). Writes
``sglang_decode.json`` under ``--out``.

``--prefill``: time to first token instead (issue 19). Per kind (default ``plain tiered``, one
engine each, same run; ``tiered_gather``: the extend path before the kernel,
``--kv-extend sdpa``) and case of ``--prefill-cases`` (``PROMPTSxTOKENS``, default 1x4096,
1x30000, 8x30000, 32x8192): fresh random prompts (no radix hit), one new token each, the
faster of two calls (after an untimed call of the same shape that compiles the kernels);
writes ``prefill-summary.json`` under ``--out``: ``{"gpu", "commit", "model", "rows":
[{"system" (plain or the policy), "kind", "budget", "prompts", "tokens_each", "ttft_s"}]}``,
rewritten after every case, and the tiered rows' host
milliseconds per extend batch (``extend_attend``, ``route_extend``, ...) in
``prefill-detail.json`` (the backend's stats from ``/server_info``, read before and after the
timed calls; every kind flushes the radix cache around them). The stats are read when asked, not
written after every routing (``--kv-stats FILE``), so the timed runs are the launch a user makes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import time
from pathlib import Path


def timed(engine, prompts: list[list[int]], n: int, digest: list | None = None) -> float:
    """Seconds of one greedy call of ``n`` new tokens per prompt; with ``digest``, a sha256 of
    the generated tokens is appended to it (kinds that decide the same tiers must agree)."""
    params = {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0}
    t0 = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    got = [o["meta_info"]["completion_tokens"] for o in out]
    assert all(g == n for g in got), got
    if digest is not None:
        toks = [o.get("output_ids") or o.get("text") for o in out]
        digest.append(hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:16])
    return dt


def _stats(engine) -> dict:
    """The tiered backend's stats as SGLang's ``/server_info`` gives them
    (``internal_states[0]["tiered_radix"]``, computed when asked: no per-routing file and its
    host syncs, which ``--kv-stats FILE`` would add to every routing); {} for plain SGLang."""
    states = engine.get_server_info().get("internal_states") or [{}]
    return states[0].get("tiered_radix", {})


def _host_s(engine) -> dict:
    """The backend's host seconds per phase so far, with the device seconds of graph replays as
    ``replay_device`` (``kv_device_times=True``; counted by ``replays_steps``)."""
    st = _stats(engine)
    dev = st.get("device_s", {})
    extra = {"replay_device": dev["replay"], "replays_steps": dev["replays"]} if dev else {}
    return st.get("host_s", {}) | extra


def _per_step(before: dict, after: dict) -> dict:
    """Host milliseconds of each phase between two reads of the stats: decode phases per
    decode step, ``*_extend`` phases and ``extend_attend`` per extend batch (the long call's
    first token is an extend of every request); the counts (``*_steps``, ``*_batches``: decode
    steps, graph replays, steady replays, extend batches) as they are."""
    counts = [k for k in after if k.endswith(("_steps", "_batches"))]  # graph/steady steps too
    n = {k: after.get(k, 0) - before.get(k, 0) for k in counts}
    n.setdefault("decode_steps", 0)
    n.setdefault("extend_batches", 0)
    out = {}
    for k, v in after.items():
        if k in n:
            continue
        per = (
            n["extend_batches"]
            if k.endswith("_extend") or k.startswith("extend")
            else n["decode_steps"]
        )
        if per > 0:
            out[k] = round(1e3 * (v - before.get(k, 0.0)) / per, 3)
    return out | n


def run(kind: str, a, vocab: int = 30000) -> dict:
    import sglang

    kw = _engine_kwargs(kind, a, a.context)
    if kind.startswith("tiered"):
        kw.update(kv_device_times=True)  # two CUDA events a replay, read with the stats
        # tiered_step: graphs, each replayed step's attention observed on the host (before run 9)
        kw["kv_observe"] = "step" if kind == "tiered_step" else "fold"
        if a.profile:  # a window of decode steps (.profile)
            kw["kv_profile"] = a.profile
    if kind == "tiered_server_clock":
        kw["kv_route_clock"] = "server"
    if kind == "tiered_eager":
        kw["disable_cuda_graph"] = True
    if kind == "plain_serial":
        kw["disable_overlap_schedule"] = True
    t0 = time.perf_counter()
    engine = sglang.Engine(**kw)
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    rows, tiered_stats = [], {}
    try:
        # compile every kernel variant first: pages (quantized windows) appear only past the
        # protected tokens, and the first routing of a long prompt has them
        warm = [[rng.randrange(100, vocab) for _ in range(4000)]]
        timed(engine, warm, 1)
        timed(engine, warm, 40)
        for bs in a.batch:
            prompts = [[rng.randrange(100, vocab) for _ in range(a.context)] for _ in range(bs)]
            t_prefill = timed(engine, prompts, 1)  # prefill; the prompts stay cached
            # untimed: kernel variants that depend on the context length (split counts) compile
            # here, not inside t_short (GPU run 6's batch 1 had t_short > t_long)
            timed(engine, prompts, a.short)
            # the fastest of two calls each: both start with an extend over the cached prompt
            # (hundreds of ms at batch 8) whose spread would otherwise land in the difference
            shorts = [timed(engine, prompts, a.short) for _ in range(2)]
            # one new token: the extend over the cached prompt alone, no decode step
            ext = min(timed(engine, prompts, 1) for _ in range(2))
            before = _host_s(engine)
            digest: list[str] = []
            longs = [timed(engine, prompts, a.long, digest) for _ in range(2)]
            short, long = min(shorts), min(longs)
            per_tok = (long - short) / (a.long - a.short)
            rows.append({"batch": bs, "t_prefill_s": t_prefill, "t_short_s": short,
                         "t_long_s": long, "decode_ms_per_token": 1e3 * per_tok,
                         "t_extend_s": ext, "calls_short_s": shorts, "calls_long_s": longs,
                         # the same with the extend timed apart instead of cancelled
                         "decode_ms_per_token_ex": 1e3 * (long - ext) / (a.long - 1),
                         "long_outputs_sha256": digest})  # fmt: skip
            if kind.startswith("tiered"):
                rows[-1]["host_ms_per_step"] = _per_step(before, _host_s(engine))
            print(kind, rows[-1], flush=True)
        tiered_stats = _stats(engine)
    finally:
        engine.shutdown()
    out = {"kind": kind, "startup_s": startup, "rows": rows, "engine_kwargs": kw}
    if tiered_stats:
        out["tiered_stats"] = tiered_stats
    return out


PREFILL_CASES = ("1x4096", "1x30000", "8x30000", "32x8192")


def _engine_kwargs(kind: str, a, context: int) -> dict:
    kw = dict(model_path=a.model, mem_fraction_static=0.6, context_length=context + 512,
              attention_backend="triton", log_level="error",
              cuda_graph_max_bs_decode=a.graph_max_bs)  # fmt: skip
    if a.chunk:
        kw["chunked_prefill_size"] = a.chunk
    if a.load_format != "auto":  # "dummy": random weights of the model's shapes (timing only)
        kw.update(load_format=a.load_format, skip_tokenizer_init=True)
    if kind.startswith("tiered"):
        kw.update(kv_policy=a.policy, kv_overlap=kind != "tiered_serial")
        if kind == "tiered_pg":
            kw["kv_prefill_graphs"] = True
        kw.pop("attention_backend")
        if a.graph_tokens:  # decode graphs' capacity (default: sized by free memory)
            kw["kv_graph_tokens"] = a.graph_tokens
        if a.budget:
            kw["kv_budget"] = a.budget
    return kw


def _budget(a) -> str:
    """The tiered run's budget: ``--budget``, else the shipped policy file's."""
    if a.budget:
        return a.budget
    path = Path(__file__).resolve().parents[1] / "policies" / f"{a.policy}.yaml"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith("budget:"):
            return line.split(":", 1)[1].split("#")[0].strip()
    return "policy default"


def prefill(kind: str, a, save, vocab: int = 30000) -> tuple[list[dict], dict]:
    """TTFT rows of one kind over ``a.prefill_cases`` (see the module docstring), and the
    tiered kind's host ms per extend batch per case; ``save(rows, detail)`` after each case, so
    a call cut short by its timeout keeps the cases it finished."""
    import sglang

    cases = [tuple(int(x) for x in c.split("x")) for c in a.prefill_cases]
    kw = _engine_kwargs(kind, a, max(t for _, t in cases))
    if kind.startswith("tiered"):
        # tiered_gather: the gather path (SDPA per request and layer), before the extend kernel
        kw["kv_extend"] = "sdpa" if kind == "tiered_gather" else "kernel"
        if a.profile:  # a window of extend batches (DIR:START:STEPS:extend, .profile)
            kw["kv_profile"] = a.profile
    engine = sglang.Engine(**kw)
    rng = random.Random(1)
    rows, detail = [], {}
    try:
        for n, tokens in cases:
            fresh = [[[rng.randrange(100, vocab) for _ in range(tokens)] for _ in range(n)]
                     for _ in range(3)]  # fmt: skip
            timed(engine, fresh[0], 1)  # compiles this shape's kernels
            engine.flush_cache()
            before = _host_s(engine)
            best = min(timed(engine, f, 1) for f in fresh[1:])
            engine.flush_cache()
            tiered = kind.startswith("tiered")
            rows.append({"system": Path(a.policy).stem if tiered else "plain", "kind": kind,
                         "budget": _budget(a) if tiered else "100%", "prompts": n,
                         "tokens_each": tokens, "ttft_s": round(best, 4)})  # fmt: skip
            if kind.startswith("tiered"):
                detail[f"{n}x{tokens}"] = _per_step(before, _host_s(engine))
            if n <= 8:  # greedy tokens after the prompt: kinds that prefill alike agree
                digest: list[str] = []
                engine.flush_cache()  # a whole prefill again, not a radix hit
                timed(engine, fresh[1], a.prefill_tokens, digest)
                detail[f"{n}x{tokens}_sha256"] = digest[0]
            print("prefill", kind, rows[-1], flush=True)
            save(rows, detail)
            engine.flush_cache()  # the timed prompts leave the radix tree
    finally:
        engine.shutdown()
    return rows, detail


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except Exception:  # noqa: BLE001 - a copy of the tree without .git
        return os.environ.get("TR_COMMIT", "unknown")


def main_prefill(a) -> None:
    import torch

    out = {"gpu": torch.cuda.get_device_name(0), "commit": _commit(), "model": a.model,
           "rows": []}  # fmt: skip
    detail = {"command": "python bench/sglang_decode.py " + " ".join(os.sys.argv[1:])}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    done: list[dict] = []

    def save(rows: list[dict], det: dict, kind: str | None = None) -> None:
        out["rows"] = done + rows
        if kind is not None:
            detail[kind] = det
        Path(a.out, "prefill-summary.json").write_text(json.dumps(out, indent=1))
        Path(a.out, "prefill-detail.json").write_text(json.dumps(detail, indent=1))

    for kind in a.kinds:
        try:
            rows, det = prefill(kind, a, lambda r, d, k=kind: save(r, d, k))
            done += rows
            save([], det, kind)
        except Exception as e:  # record the failure, keep the other kind's numbers
            detail[kind] = {"error": repr(e)[:2000]}
            save([], detail[kind])
            print(kind, "FAILED", repr(e)[:2000], flush=True)
    plain = {(r["prompts"], r["tokens_each"]): r["ttft_s"] for r in out["rows"]
             if r["system"] == "plain"}  # fmt: skip
    shas = {k: {c: v for c, v in d.items() if c.endswith("_sha256")} for k, d in detail.items()
            if isinstance(d, dict)}  # fmt: skip
    print("greedy tokens (sha256 per case):", json.dumps(shas), flush=True)
    for r in out["rows"]:
        base = plain.get((r["prompts"], r["tokens_each"]))
        if r["system"] != "plain" and base:
            print(f"{r['prompts']} x {r['tokens_each']}: tiered {r['ttft_s']:.3f} s, plain "
                  f"{base:.3f} s, ratio {r['ttft_s'] / base:.2f}", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/tmp/models/qwen2.5-0.5b")
    p.add_argument("--policy", default="qevict")
    p.add_argument("--budget", default=None)
    p.add_argument("--context", type=int, default=30000)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=136)
    p.add_argument("--chunk", type=int, default=None, help="chunked_prefill_size, every kind")
    p.add_argument("--kinds", nargs="+", default=["plain", "tiered", "tiered_step"])
    p.add_argument("--graph-max-bs", type=int, default=16)
    p.add_argument(
        "--graph-tokens",
        type=int,
        default=None,
        help="tiered kinds: --kv-graph-tokens (default: every captured request at full context)",
    )
    p.add_argument("--profile", default=None, help="DIR:START:STEPS, tiered kinds: decode steps "
                   "under torch.profiler (step 400 is in batch 8's first long call); with "
                   "--prefill DIR:START:STEPS:extend, extend batches")  # fmt: skip
    p.add_argument("--load-format", default="auto", help="'dummy': random weights from the "
                   "model folder's config.json (times only: no weights to stage)")  # fmt: skip
    p.add_argument("--out", default="bench/results")
    p.add_argument("--prefill", action="store_true", help="time to first token (see above)")
    p.add_argument("--prefill-cases", nargs="+", default=list(PREFILL_CASES))
    p.add_argument("--prefill-tokens", type=int, default=16, help="greedy tokens whose "
                   "sha256 --prefill records per case of <= 8 prompts")  # fmt: skip
    a = p.parse_args()
    if a.prefill:
        if a.kinds == p.get_default("kinds"):
            a.kinds = ["plain", "tiered"]
        return main_prefill(a)
    import torch

    res = {
        "command": "python bench/sglang_decode.py " + " ".join(os.sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "python": platform.python_version(), "args": vars(a), "runs": [],
    }  # fmt: skip
    import sglang

    res["sglang"] = sglang.__version__
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for kind in a.kinds:
        try:
            res["runs"].append(run(kind, a))
        except Exception as e:  # record the failure, keep the other kind's numbers
            res["runs"].append({"kind": kind, "error": repr(e)[:2000]})
            print(kind, "FAILED", repr(e)[:2000], flush=True)
        Path(a.out, "sglang_decode.json").write_text(json.dumps(res, indent=1))
    by = {r["kind"]: r for r in res["runs"] if "rows" in r}
    tiered_kinds = ("tiered", "tiered_serial", "tiered_overlap", "tiered_step", "tiered_eager",
                    "tiered_server_clock")  # fmt: skip
    for kind in tiered_kinds:
        if {"plain", kind} <= by.keys():
            for pr, tr in zip(by["plain"]["rows"], by[kind]["rows"], strict=False):
                tr["ratio_vs_plain"] = tr["decode_ms_per_token"] / pr["decode_ms_per_token"]
    tiered = by.get("tiered") or by.get("tiered_eager")
    if tiered is not None:
        st = tiered.get("tiered_stats", {})
        if st.get("peak_tokens"):
            bf16 = st["peak_tokens"] * st["bf16_bytes_per_token"]
            res["peak_kv_fraction_of_bf16"] = st["peak_bytes"] / bf16
    Path(a.out, "sglang_decode.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
