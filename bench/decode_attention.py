"""Benchmark: TriZone decode attention vs FlashInfer (bf16, fp8) and SGLang's Triton decode.

    PYTHONPATH=/tmp/site python bench/decode_attention.py [--quick] [--out bench/results]
    TRITON_INTERPRET=1 python bench/decode_attention.py --device cpu --tiny   # smoke test

Measures the device-to-device copy bandwidth first, then per (shape family, context, batch):
every peer (errors recorded, never fatal) and ours at tier mixes: ``full`` (100%: all rows full
precision), ``qevict@B`` (32-token windows; half the byte budget B on full windows, the rest on
INT2 windows, others evicted) and ``rdkv@B`` (V per token at 2/4/8/16 bits, K channels at mixed
bits). Ours is timed as a CUDA-graph replay (ms; eager launch in ms_eager), peers eagerly.
Rows ``ours_*`` run the kernel (uniform QEvict pages take its uniform-page path; result files
before the first kernel generation was deleted also hold ``ours_*_v1`` rows),
``ours_qevict@10%_general`` its general page path, ``_ppi2`` / ``_ppi2w8`` the uniform path with
2 pages an iteration (4 / 8 warps) (Llama 32K x1 and 128K x8 only).
``--splits 16,32,64,128`` instead times only ``qevict@10%+mass`` (the SGLang backend's decode:
side output on) of the Qwen shapes at 32K x 1 and x 8 at each split count, with each kernel's
device time: the SGLang graph plan sizes splits for the context (128 at 30K), not for the rows
a budget lists.
``--targets`` (one ~4-minute GPU call) times only the issue targets' configs (Llama 128K x 8,
Qwen 32K x 1 / 8 / 64) for ``full``, ``qevict@10%`` and ``rdkv@10%``, each plan variant of
:data:`TARGET_VARIANTS` beside the default (``--variants``: only those suffixes; CUDA-graph
replay only), and FlashInfer bf16;
it writes its file after every configuration and starts none past ``--deadline-s``.
Bytes are those the kernel loads (layout.bytes_kv + q + partials); fraction = bytes /
time / copy bandwidth. Writes OUT/decode_attention.json and OUT/decode_attention.png.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
try:  # an uninstalled checkout: map kernels/ to tiered_radix.kernels as pyproject.toml does
    import tiered_radix.kernels  # noqa: F401
except ImportError:
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "tiered_radix.kernels",
        ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")],
    )
    sys.modules["tiered_radix.kernels"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["tiered_radix.kernels"])

FAMILIES = {"llama3-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}
FULL = [(4096, 1), (4096, 32), (32768, 1), (32768, 8), (32768, 64), (131072, 1), (131072, 8)]
QUICK = [(32768, 1), (131072, 8)]
TINY = [(96, 2)]
BUDGETS = (0.05, 0.10, 0.20)
TUNE_CONFIGS = {("llama3-8b", 32768, 1), ("llama3-8b", 131072, 8), ("llama3-8b", 96, 2)}
V_DIST = {16: 0.1, 8: 0.2, 4: 0.3, 2: 0.4}  # rdkv: share of kept tokens / K channels per width
# the grid's rows plan each mix as the SGLang adapter does: rdkv's Zone A pages on the blocks
# path with 128 registers (zone_decode.plan; runs 22-23 timed the plan's default "sections"
# path here instead, 3.2x slower at Llama 128K x 8, which the server never runs)
SERVED_PLAN = {"rdkv": {"k_path": "blocks", "max_regs": 128}}
TARGETS = [("llama3-8b", 131072, 8), ("qwen2.5-0.5b", 32768, 64), ("qwen2.5-0.5b", 32768, 8),
           ("qwen2.5-0.5b", 32768, 1)]  # fmt: skip
# --targets: decode.plan options timed beside the default (first) per mix, with their sm_90
# registers / page blocks in flight in bench/decode_notes.md; "g_pad": "min" (accepted) is the
# query group padded to the next power of two instead of 16
TARGET_VARIANTS = {  # mix -> [(suffix, plan options, head_dims timed)]
    "full": [("", {}, (64, 128))],
    "qevict": [
        ("", {}, (64, 128)),
        # plan(dequant="magic"): codes to float32 from their bits, no int -> float conversions
        # (bench/decode_notes.md, "Dequantisation without conversions"); each "_magic" row is
        # also compared with the row without the suffix (vs_convert, max_abs_diff_vs_convert)
        ("_magic", {"dequant": "magic"}, (64, 128)),
        ("_r128", {"max_regs": 128}, (64, 128)),
        ("_r128_magic", {"max_regs": 128, "dequant": "magic"}, (64, 128)),
        # 96 registers: 5 programs of 4 warps an SM instead of 4 (spills under Triton 3.6:
        # none at d64 without the side output, 52/44 B with it, 96/96 B at d128)
        ("_r96_magic", {"max_regs": 96, "dequant": "magic"}, (64, 128)),
        ("_pipe8", {"prefetch": "pipeliner", "num_stages": 8}, (128,)),  # d64: = _pipe8_r128
        ("_pipe8_r128", {"prefetch": "pipeliner", "num_stages": 8, "max_regs": 128}, (64, 128)),
        # d64: the scale/lo pairs of one page are 2 bytes a thread (synchronous); two pages, 4
        ("_pipe8_ppi2_r128", {"prefetch": "pipeliner", "num_stages": 8, "pages_per_iter": 2,
                              "max_regs": 128}, (64,)),
        ("_pipe11", {"prefetch": "pipeliner", "num_stages": 11}, (128,)),
    ],
    "rdkv": [  # GPU run 16: gather 1.36x / 1.12x the default, the other gather rows slower
        ("", {}, (64, 128)),
        # Zone A's uniform path (k_path="blocks", blocks of 32 channels unless said);
        # _blocks_r128 is the SGLang adapter's plan. GPU run 17: blocks of 16 with interleave
        # unpacking were wrong (max |diff| 0.075; plan() refuses them on CUDA since), the
        # 32-channel row the fastest (1.080 ms at Llama 128K x 8)
        ("_blocks_r128", {"k_path": "blocks", "max_regs": 128}, (64, 128)),
        ("_blocks_r128_magic", {"k_path": "blocks", "max_regs": 128, "dequant": "magic"},
         (64, 128)),
        # tighter caps: 5 / 6 programs an SM instead of 4 (run 31: resident warps x latency
        # binds these pages), spilling 48-124 / 148-280 B a thread under Triton 3.6
        ("_blocks_r96_magic", {"k_path": "blocks", "max_regs": 96, "dequant": "magic"},
         (64, 128)),
        ("_blocks_r80_magic", {"k_path": "blocks", "max_regs": 80, "dequant": "magic"},
         (64, 128)),
        ("_gather", {"k_path": "gather"}, (64, 128)),
        ("_blocks", {"k_path": "blocks"}, (64, 128)),
        ("_blocks_nopf_r128", {"k_path": "blocks", "page_prefetch": "none", "max_regs": 128},
         (64, 128)),
        ("_blocks_l2_r128", {"k_path": "blocks", "page_prefetch": "l2", "max_regs": 128},
         (64, 128)),
        ("_blocks_shift_r128", {"k_path": "blocks", "unpack": "shift", "max_regs": 128},
         (64, 128)),
        # blocks of 16 channels: shift unpacking on CUDA (run 17: 1.216 ms)
        ("_blocks16_r128", {"k_path": "blocks", "k_block": 16, "max_regs": 128}, (64, 128)),
        # num_stages 1: Triton's pipeliner off for the per-width block loops
        ("_blocks_st1_r128", {"k_path": "blocks", "num_stages": 1, "max_regs": 128}, (64, 128)),
    ],
}  # fmt: skip


def timeit(fn, dev, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds (triton do_bench on CUDA, warmup/rep in ms; a few wall-clock runs on
    CPU)."""
    if dev == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def kernel_us(fn, reps: int = 20) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches (torch.profiler over eager
    calls; CUDA only): which of split, merge and mass the time goes to."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            out[e.key[:60]] = round(t / reps, 2)
    return out


def copy_bandwidth(dev) -> float:
    n = (1 << 30) if dev == "cuda" else (1 << 20)
    a, b = (
        torch.empty(n, dtype=torch.uint8, device=dev),
        torch.empty(n, dtype=torch.uint8, device=dev),
    )
    ms = timeit(lambda: b.copy_(a), dev)
    return 2 * n / (ms * 1e-3)


def tier_plan(kind, budget, ctx, batch, hkv, d, gen):
    from tiered_radix.formats.layout import TierPlan

    fresh = [16] * batch
    if kind == "full":
        return TierPlan([torch.full((hkv, ctx), 16)] * batch, None, fresh)
    if kind == "qevict":
        w = ctx // 32
        int2_cost = (2 * d * 32 * 2 // 8 + 4 * d + 4 * 32 * d // 32) / (4 * d * 32)
        n_full, n_int2 = int(0.5 * budget * w), int(0.5 * budget * w / int2_cost)
        bits = []
        for _ in range(batch):
            rank = torch.rand(hkv, w, generator=gen).argsort(1).argsort(1)
            win = torch.where(rank < n_full, 16, torch.where(rank < n_full + n_int2, 2, 0))
            bits.append(win.repeat_interleave(32, 1))
        return TierPlan(bits, None, fresh)
    widths, probs = torch.tensor(list(V_DIST)), torch.tensor(list(V_DIST.values()))
    mean_bits = float((widths * probs).sum())
    per_tok = (2 * d * mean_bits / 8 + 8 * d / 32) / (4 * d)  # K + V codes and metadata
    keep = min(1.0, budget / per_tok)
    vb, kb = [], []
    for _ in range(batch):
        w = widths[torch.multinomial(probs, hkv * ctx, True, generator=gen)].reshape(hkv, ctx)
        vb.append(torch.where(torch.rand(hkv, ctx, generator=gen) < keep, w, 0))
        kb.append(widths[torch.multinomial(probs, hkv * d, True, generator=gen)].reshape(hkv, d))
    return TierPlan(vb, kb, fresh)


def ours(q, k, v, kind, budget, dev, side, gen, cache, breakdown=False, fast=False, **plan_kw):
    """Time decode.run on the (cached) layout of this tier mix; plan_kw go to decode.plan;
    ``breakdown``: also each kernel's device time (``kernels_us``, CUDA); ``fast``: the graph
    replay only, shorter do_bench (--targets)."""
    from tiered_radix.kernels import decode

    from tiered_radix.formats.layout import build_trizone

    batch, hq, d = q.shape
    hkv = k[0].shape[1]
    if (kind, budget) not in cache:
        tp = tier_plan(kind, budget, k[0].shape[0], batch, hkv, d, gen)
        cache[kind, budget] = build_trizone(k, v, tp, page_size=32, v_group=32, unit_tokens=32)
    lay = cache[kind, budget]
    if plan_kw.get("g_pad") == "min":
        plan_kw = {**plan_kw, "g_pad": max(1, 1 << (hq // hkv - 1).bit_length())}
    p = decode.plan(lay, num_q_heads=hq, side_output=side, **plan_kw)
    mass = torch.zeros(batch, lay.max_units, device=dev) if side else None
    out = torch.empty_like(q)
    wr = dict(warmup=10, rep=40) if fast else {}
    if fast and dev == "cuda":
        decode.run(q, lay, p, out=out, mass=mass)  # compile outside the capture
        eager = None
    else:
        eager = timeit(lambda: decode.run(q, lay, p, out=out, mass=mass), dev)
    ms = eager
    if dev == "cuda":  # run() is graph-safe: time a replay, as SGLang's decode runs it
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode.run(q, lay, p, out=out, mass=mass)
        ms = timeit(graph.replay, dev, **wr)
    cache["out"] = out
    extra = q.numel() * 4 + p.part_acc.numel() * 8 + p.part_ml.numel() * 8
    if side:  # units read twice; one value per (tile, head) written and read (windows)
        tiles = lay.page_ntok.numel() + (lay.full_slots.numel() + lay.fresh_slots.numel()) // 32
        extra += 2 * lay.bytes_side + 8 * p.group * tiles
    full_bytes = sum(x.numel() for x in k) * 4
    info = {
        "splits": p.num_splits,
        "budget_actual": lay.bytes_kv / full_bytes,
        "ms_eager": eager,
        "pages_per_iter": p.pages_per_iter,
        "num_warps": p.num_warps,
        "num_stages": p.num_stages,
        "g_pad": p.g_pad,
        "k_path": p.k_path,
        "prefetch": p.prefetch,
        "dequant": p.dequant,
        "plan_kw": {k: v for k, v in plan_kw.items()},
    }
    if breakdown and dev == "cuda":
        info["kernels_us"] = kernel_us(lambda: decode.run(q, lay, p, out=out, mass=mass))
    return ms, lay.bytes_kv + extra, info


def flashinfer_peer(q, kf, vf, fp8, dev):
    import flashinfer

    batch, hq, d = q.shape
    ctx, hkv = kf.shape[1], kf.shape[2]
    page = 16
    npg = ctx // page
    kc = kf.reshape(batch * npg, page, hkv, d)
    vc = vf.reshape(batch * npg, page, hkv, d)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    indptr = torch.arange(batch + 1, device=dev, dtype=torch.int32) * npg
    indices = torch.arange(batch * npg, device=dev, dtype=torch.int32)
    last = torch.full((batch,), page, device=dev, dtype=torch.int32)
    tc = hq // hkv not in (1, 2, 4, 8)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=q.dtype, kv_data_type=kc.dtype)
    ms = timeit(lambda: w.run(q, (kc, vc)), dev)
    return ms, kc.numel() * kc.element_size() * 2, {"use_tensor_cores": tc}


def sglang_peer(q, kf, vf, splits, dev):
    try:  # SGLang 0.5.17 moved its Triton ops out of layers/
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    except ImportError:
        from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd

    batch, hq, d = q.shape
    ctx, hkv = kf.shape[1], kf.shape[2]
    kb, vb = kf.reshape(batch * ctx, hkv, d), vf.reshape(batch * ctx, hkv, d)
    o = torch.empty_like(q)
    args = dict(
        q=q, k_buffer=kb, v_buffer=vb, o=o,
        kv_indptr=torch.arange(batch + 1, device=dev, dtype=torch.int32) * ctx,
        kv_indices=torch.arange(batch * ctx, device=dev, dtype=torch.int32),
        attn_logits=torch.empty(batch, hq, splits, d, device=dev),
        attn_lse=torch.empty(batch, hq, splits, device=dev),
        num_kv_splits=torch.full((batch,), splits, device=dev, dtype=torch.int32),
        max_kv_splits=splits, sm_scale=d**-0.5, k_scale=1.0, v_scale=1.0,
    )  # fmt: skip
    names = inspect.signature(decode_attention_fwd).parameters
    kw = {k: a for k, a in args.items() if k in names}
    ms = timeit(lambda: decode_attention_fwd(**kw), dev)
    return ms, kb.numel() * 4, {"splits": splits}


def run_config(fam, ctx, batch, dev, bw, quick, gen):
    hq, hkv, d = FAMILIES[fam]
    dt = torch.bfloat16
    q = torch.randn(batch, hq, d, device=dev, dtype=dt)
    kf = torch.randn(batch, ctx, hkv, d, device=dev, dtype=dt)
    vf = torch.randn(batch, ctx, hkv, d, device=dev, dtype=dt)
    rows = []

    def record(name, fn):
        try:
            ms, nbytes, info = fn()
            rows.append(dict(family=fam, ctx=ctx, batch=batch, impl=name, ms=ms, bytes=nbytes,
                             frac_copy_bw=nbytes / (ms * 1e-3) / bw, **info))  # fmt: skip
        except Exception as e:  # a missing or failing peer is recorded, not fatal
            rows.append(dict(family=fam, ctx=ctx, batch=batch, impl=name, error=repr(e)[:300]))
        if dev == "cuda":
            torch.cuda.empty_cache()

    if dev == "cuda":
        record("flashinfer_bf16", lambda: flashinfer_peer(q, kf, vf, False, dev))
        record("flashinfer_fp8", lambda: flashinfer_peer(q, kf, vf, True, dev))
        for s in (16, 64):
            record(f"sglang_triton_s{s}", lambda s=s: sglang_peer(q, kf, vf, s, dev))
    k, v = list(kf.unbind(0)), list(vf.unbind(0))
    mixes = [("full", 1.0)] + [(kd, b) for kd in ("qevict", "rdkv") for b in BUDGETS]
    if quick:
        mixes = [("full", 1.0), ("qevict", 0.10), ("rdkv", 0.10)]
    cache = {}
    key = [("full", 1.0, False), ("qevict", 0.1, False), ("rdkv", 0.1, False),
           ("full", 1.0, True), ("qevict", 0.1, True)]  # fmt: skip
    variants = [("", {})]
    if (fam, ctx, batch) in TUNE_CONFIGS:
        # the default row runs the uniform-page path (qevict pages); "_general" times the
        # general page path on the same layout, "_ppi2*" the uniform path's tuning knobs
        variants += [
            ("_general", {"uniform_pages": False}),
            ("_ppi2", {"pages_per_iter": 2, "uniform_pages": True}),
            ("_ppi2w8", {"pages_per_iter": 2, "num_warps": 8, "uniform_pages": True}),
        ]
    for kind, b, side in [(kd, b, False) for kd, b in mixes] + key[3:]:
        name = (kind if kind == "full" else f"{kind}@{int(b * 100)}%") + ("+mass" if side else "")
        for suffix, kw in variants:
            tune = suffix.startswith(("_ppi", "_general"))  # uniform (qevict) pages only
            if suffix and (kind, b, side) not in key or tune and (side or kind != "qevict"):
                continue
            kw = {
                **SERVED_PLAN.get(kind, {}),
                **kw,
                "breakdown": not suffix and (kind, b, side) in key,
            }
            record(f"ours_{name}{suffix}",
                   lambda kind=kind, b=b, side=side, kw=kw: ours(q, k, v, kind, b, dev, side, gen,
                                                                 cache, **kw))  # fmt: skip
    cache.clear()
    base = next((r["ms"] for r in rows if r["impl"] == "flashinfer_bf16" and "ms" in r), None)
    for r in rows:
        if base and "ms" in r:
            r["speedup_vs_flashinfer_bf16"] = base / r["ms"]
    return rows


def run_targets(fam, ctx, batch, dev, bw, gen, deadline=float("inf"), keep=None,
                only=None) -> list[dict]:  # fmt: skip
    """--targets: FlashInfer bf16 and ours at full / qevict@10% / rdkv@10%, every
    :data:`TARGET_VARIANTS` entry of each mix (``ours_<mix><suffix>``; the default has none);
    ``vs_default`` = the default's ms / this variant's; ``max_abs_diff_vs_default``: the
    variant's output against the default's on the same q and layout (the default is what
    tests/kernels checks against the torch twin); a ``_magic`` row (plan(dequant="magic")) also
    gets ``vs_convert`` and ``max_abs_diff_vs_convert`` against the row of the same suffix
    without ``_magic`` (timed just before it).  No variant starts after ``deadline``
    (perf_counter seconds); ``keep(rows)`` is called after every row (the file is written
    then: a killed call keeps what it timed); ``only``: the suffixes to time beside each mix's
    default (None: all)."""
    hq, hkv, d = FAMILIES[fam]
    dt = torch.bfloat16
    q = torch.randn(batch, hq, d, device=dev, dtype=dt)
    kf = torch.randn(batch, ctx, hkv, d, device=dev, dtype=dt)
    vf = torch.randn(batch, ctx, hkv, d, device=dev, dtype=dt)
    rows = []

    def record(name, fn, **tags):
        t0 = time.perf_counter()
        try:
            ms, nbytes, info = fn()
            rows.append(dict(family=fam, ctx=ctx, batch=batch, impl=name, ms=ms, bytes=nbytes,
                             frac_copy_bw=nbytes / (ms * 1e-3) / bw, **info, **tags))  # fmt: skip
        except Exception as e:  # a failing variant is recorded, not fatal
            rows.append(dict(family=fam, ctx=ctx, batch=batch, impl=name, error=repr(e)[:300],
                             **tags))  # fmt: skip
        rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"  {name}: {rows[-1].get('ms', rows[-1].get('error'))}", flush=True)
        if keep:
            keep(rows)

    if dev == "cuda":
        record("flashinfer_bf16", lambda: flashinfer_peer(q, kf, vf, False, dev))
    k, v = list(kf.unbind(0)), list(vf.unbind(0))
    cache = {}
    for kind, b in (("full", 1.0), ("qevict", 0.10), ("rdkv", 0.10)):
        name = kind if kind == "full" else f"{kind}@{int(b * 100)}%"
        ref, by_suffix = None, {}
        for suffix, kw, dims in TARGET_VARIANTS[kind]:
            if d not in dims or (suffix and only is not None and suffix not in only):
                continue
            if time.perf_counter() > deadline:
                rows.append(dict(family=fam, ctx=ctx, batch=batch, impl=f"ours_{name}{suffix}",
                                 error="skipped: past --deadline-s", mix=name))  # fmt: skip
                continue
            cache.pop("out", None)
            record(f"ours_{name}{suffix}",
                   lambda kind=kind, b=b, kw=kw: ours(q, k, v, kind, b, dev, False, gen, cache,
                                                      fast=True, **kw),
                   mix=name, variant=suffix or "default")  # fmt: skip
            got = cache.get("out")
            if got is not None and "ms" in rows[-1]:
                ref = got.float().clone() if ref is None else ref
                rows[-1]["max_abs_diff_vs_default"] = float((got.float() - ref).abs().max())
                by_suffix[suffix] = (rows[-1]["ms"], got.float().clone())
                twin = by_suffix.get(suffix.removesuffix("_magic"))
                if suffix.endswith("_magic") and twin is not None:
                    rows[-1]["vs_convert"] = twin[0] / rows[-1]["ms"]
                    diff = (got.float() - twin[1]).abs().max()
                    rows[-1]["max_abs_diff_vs_convert"] = float(diff)
        cache.pop((kind, b), None)
        if dev == "cuda":
            torch.cuda.empty_cache()
    base = next((r["ms"] for r in rows if r["impl"] == "flashinfer_bf16" and "ms" in r), None)
    for r in rows:
        if base and "ms" in r:
            r["speedup_vs_flashinfer_bf16"] = base / r["ms"]
        default = next((x["ms"] for x in rows if x.get("mix") == r.get("mix") and "ms" in x
                        and x.get("variant") == "default"), None)  # fmt: skip
        if default and "ms" in r and "mix" in r:
            r["vs_default"] = default / r["ms"]
    return rows


def sweep_splits(splits: list[int], dev, bw, gen) -> list[dict]:
    """``ours_qevict@10%+mass_s{n}`` rows (and the plan's own choice) of Qwen 32K x 1 and x 8."""
    hq, hkv, d = FAMILIES["qwen2.5-0.5b"]
    ctx, rows = 32768 if dev == "cuda" else 256, []  # the interpreter: a smoke test
    for batch in (1, 8):
        q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
        kv = [torch.randn(ctx, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2 * batch)]
        cache = {}
        for n in [None, *splits]:
            name = "ours_qevict@10%+mass" + ("" if n is None else f"_s{n}")
            kw = {} if n is None else {"num_splits": n}
            k, v, cuda = kv[:batch], kv[batch:], dev == "cuda"
            ms, nbytes, info = ours(q, k, v, "qevict", 0.1, dev, True, gen, cache, cuda, **kw)
            frac = nbytes / (ms * 1e-3) / bw
            rows.append(dict(family="qwen2.5-0.5b", ctx=ctx, batch=batch, impl=name, ms=ms,
                             bytes=nbytes, frac_copy_bw=frac, **info))  # fmt: skip
        print(f"done splits sweep batch={batch}", flush=True)
    return rows


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "flashinfer", "sglang"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:
            out[mod] = f"unavailable: {e!r}"[:120]
    return out


def save(rows: list[dict], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = sorted({r["family"] for r in rows})
    fig, axes = plt.subplots(1, len(fams), figsize=(8 * len(fams), 5), squeeze=False)
    for ax, fam in zip(axes[0], fams, strict=True):
        sub = [r for r in rows if r["family"] == fam and "ms" in r]
        cfgs = sorted({(r["ctx"], r["batch"]) for r in sub})
        for impl in sorted({r["impl"] for r in sub}):
            ys = [next((r["ms"] for r in sub if r["impl"] == impl and (r["ctx"], r["batch"]) == c),
                       float("nan")) for c in cfgs]  # fmt: skip
            ax.plot(range(len(cfgs)), ys, marker="o", label=impl)
        ax.set_xticks(range(len(cfgs)), [f"{c // 1024}K x{b}" for c, b in cfgs], rotation=30)
        ax.set_yscale("log")
        ax.set_ylabel("ms (median)")
        ax.set_title(fam)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="~1 minute subset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="interpreter-sized smoke test")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--splits", default=None, help="only the split-count sweep, e.g. 16,32,64")
    ap.add_argument(
        "--targets",
        action="store_true",
        help="only the issue targets' configs, every plan variant (~4 min)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no configuration after this many seconds (--targets: 200)",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help="--targets: only these TARGET_VARIANTS suffixes beside each default, e.g. "
        "_magic,_blocks_r128,_blocks_r128_magic",
    )
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu needs TRITON_INTERPRET=1 (set it before starting Python)")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    bw = copy_bandwidth(dev)
    grid = TINY if args.tiny else QUICK if args.quick else FULL
    out = Path(args.out)
    gpu = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    meta = {"command": " ".join(sys.argv), "gpu": gpu, "copy_bw_Bps": bw, "versions": versions()}
    rows = []
    t_start = time.perf_counter()
    if args.targets:
        deadline = args.deadline_s or 200.0
        cfgs = TARGETS if dev == "cuda" else [("llama3-8b", 96, 2), ("qwen2.5-0.5b", 96, 1)]
        for fam, ctx, batch in cfgs:
            if time.perf_counter() - t_start > deadline:
                print(f"skipped {fam} ctx={ctx} batch={batch}: past --deadline-s", flush=True)
                continue
            rows += run_targets(
                fam,
                ctx,
                batch,
                dev,
                bw,
                gen,
                t_start + deadline + 40,
                lambda new, done=list(rows): save(done + new, out, meta),
                None if args.variants is None else set(args.variants.split(",")),
            )
            save(rows, out, meta)
            print(f"done {fam} ctx={ctx} batch={batch} at {time.perf_counter() - t_start:.0f}s",
                  flush=True)  # fmt: skip
        grid = []
    if args.splits:
        rows = sweep_splits([int(x) for x in args.splits.split(",")], dev, bw, gen)
        grid = []
    for fam in args.families.split(","):
        for ctx, batch in grid:
            if args.quick and fam != "llama3-8b" and (ctx, batch) != (32768, 1):
                continue
            rows += run_config(fam, ctx, batch, dev, bw, args.quick or args.tiny, gen)
            save(rows, out, meta)  # after every configuration: a timed-out call keeps its rows
            print(f"done {fam} ctx={ctx} batch={batch}", flush=True)
    save(rows, out, meta)
    if not args.targets:
        plot(rows, out / "decode_attention.png")
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s on {gpu}")
    print(
        f"{'family':13} {'ctx':>7} {'B':>3} {'impl':24} {'ms':>9} {'MB':>9} {'%bw':>6} {'xFI':>6}"
    )
    for r in rows:
        if "ms" not in r:
            print(f"{r['family']:13} {r['ctx']:7} {r['batch']:3} {r['impl']:24} {r['error'][:60]}")
            continue
        print(f"{r['family']:13} {r['ctx']:7} {r['batch']:3} {r['impl']:24} {r['ms']:9.4f} "
              f"{r['bytes'] / 1e6:9.2f} {100 * r['frac_copy_bw']:6.1f} "
              f"{r.get('speedup_vs_flashinfer_bf16', float('nan')):6.2f}"
              + (f" {r['vs_default']:5.2f}x default" if "vs_default" in r else "")
              + (f" diff {r['max_abs_diff_vs_default']:.1e}"
                 if "max_abs_diff_vs_default" in r else "")
              + (f" {r['vs_convert']:5.2f}x convert diff {r['max_abs_diff_vs_convert']:.1e}"
                 if "vs_convert" in r else ""))  # fmt: skip
    for r in rows:  # where the time goes (eager calls; device us per kernel)
        if r.get("kernels_us"):
            print(f"{r['family']} {r['ctx']}x{r['batch']} {r['impl']}: {r['kernels_us']}")


if __name__ == "__main__":
    main()
