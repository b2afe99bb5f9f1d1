"""Benchmark: Triton quantize/pack and column mass vs their plain-PyTorch twins.

    python bench/quant_pack.py [--out bench/results] [--quick]
    python bench/quant_pack.py --device cpu --tiny      # interpreter smoke test

Codec (Llama-3.1-8B-like, fp16 input): K windows ``[4096 windows * 8 heads, 128, 32]`` grouped
along tokens and V rows ``[131072 tokens * 8 heads, 128]`` grouped along d, at 2/4/8 bits:
``quantize_pack`` / ``dequantize_unpack`` vs ``formats.codecs.quantize`` / ``dequantize`` (the
target is >= 10x). Column mass: causal prefill of 8K-32K tokens, 32 query / 8 KV heads, d 128,
``column_mass`` vs the chunked ``kernels.colmass_ref.column_mass_ref``. Every case also checks
that the two agree (codes bit for bit; column mass to 1e-3 relative). Writes OUT/quant_pack.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUANT = [("K", (4096 * 8, 128, 32), 32), ("V", (131072 * 8, 128), 32)]
QUANT_TINY = [("K", (8, 64, 32), 32), ("V", (64, 128), 32)]
COLMASS = [8192, 16384, 32768]  # prompt tokens (Tq = Tk)
COLMASS_TINY = [64]
HEADS = (32, 8, 128)  # Hq, Hkv, d
HEADS_TINY = (4, 1, 64)


def _import_kernels():
    try:
        import tiered_radix.kernels  # noqa: F401
    except ImportError:  # an uninstalled checkout: map kernels/ as pyproject.toml does
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "tiered_radix.kernels",
            ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")],
        )
        sys.modules["tiered_radix.kernels"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["tiered_radix.kernels"])
    from tiered_radix.kernels import colmass, quant

    return quant, colmass


def timeit(fn, dev: str, reps: int = 2) -> list[float]:
    """All timed milliseconds: triton do_bench on CUDA, a few wall-clock runs on CPU."""
    if dev == "cuda":
        import triton

        return [
            float(t) for t in triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="all")
        ]
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def _entry(name: str, times: list[float], **extra) -> dict:
    return {"name": name, "median_ms": statistics.median(times), "times_ms": times, **extra}


def bench_codec(quant, kind, shape, group, bits, dev, gen) -> list[dict]:
    from tiered_radix.formats import codecs

    x = torch.randn(shape, generator=gen).to(dev, torch.float16)
    ours_q, ref_q = quant.quantize_pack(x, bits=bits, group=group), codecs.quantize(x, bits, group)
    exact = all(
        torch.equal(getattr(ours_q, f), getattr(ref_q, f)) for f in ("codes", "scale", "lo")
    )
    moved = x.numel() * (2 + bits / 8 + 4 / group)  # bytes read + written by the fused kernel
    tag = {"tensor": kind, "shape": list(shape), "group": group, "bits": bits, "bit_exact": exact}
    t_ours = timeit(lambda: quant.quantize_pack(x, bits=bits, group=group), dev)
    t_ref = timeit(lambda: codecs.quantize(x, bits, group), dev)
    t_ours_d = timeit(lambda: quant.dequantize_unpack(ref_q, dtype=torch.float16), dev)
    t_ref_d = timeit(lambda: codecs.dequantize(ref_q, torch.float16), dev)
    rows = []
    for op, ours, ref in (("quantize", t_ours, t_ref), ("dequantize", t_ours_d, t_ref_d)):
        med = statistics.median(ours)
        rows.append(
            {
                **tag,
                "op": op,
                "triton": _entry("triton", ours, gb_per_s=moved / med / 1e6),
                "torch": _entry("torch", ref),
                "speedup": statistics.median(ref) / med,
            }
        )
    return rows


def bench_colmass(colmass, tokens, heads, dev, gen) -> dict:
    from tiered_radix.kernels.colmass_ref import column_mass_ref

    hq, hkv, d = heads
    q = torch.randn(tokens, hq, d, generator=gen).to(dev, torch.float16)
    k = torch.randn(tokens, hkv, d, generator=gen).to(dev, torch.float16)
    chunk = 1 << 26 if dev == "cuda" else 1 << 20
    ours = colmass.column_mass(q, k, scale=d**-0.5)
    ref = column_mass_ref(q, k, scale=d**-0.5, chunk_elems=chunk)
    err = ((ours - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
    t_ours = timeit(lambda: colmass.column_mass(q, k, scale=d**-0.5), dev)
    t_ref = timeit(lambda: column_mass_ref(q, k, scale=d**-0.5, chunk_elems=chunk), dev)
    flops = 2 * 2 * hq * d * tokens * (tokens + 1) / 2  # two causal QK^T passes
    med = statistics.median(t_ours)
    return {
        "tokens": tokens,
        "heads": list(heads),
        "max_rel_err": err,
        "agrees": err < 1e-3,
        "triton": _entry("triton", t_ours, tflop_per_s=flops / med / 1e9),
        "torch_chunked": _entry("torch_chunked", t_ref, chunk_elems=chunk),
        "speedup": statistics.median(t_ref) / med,
    }


def versions(dev: str) -> dict:
    import triton

    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="interpreter-sized smoke test")
    ap.add_argument("--quick", action="store_true", help="4 bits only, 8K/32K column mass")
    args = ap.parse_args(argv)
    if args.device != "cuda":  # must precede the first @triton.jit import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    quant, colmass = _import_kernels()
    gen = torch.Generator().manual_seed(0)
    quant_cases, tokens, heads = (
        (QUANT_TINY, COLMASS_TINY, HEADS_TINY) if args.tiny else (QUANT, COLMASS, HEADS)
    )
    codec_rows, colmass_rows = [], []
    for kind, shape, group in quant_cases:
        for bits in (4,) if args.quick else (2, 4, 8):
            codec_rows += bench_codec(quant, kind, shape, group, bits, args.device, gen)
            for r in codec_rows[-2:]:
                print(f"{r['op']:10s} {kind} {bits}b  triton {r['triton']['median_ms']:.3f} ms "
                      f"torch {r['torch']['median_ms']:.3f} ms  x{r['speedup']:.1f} "
                      f"exact={r['bit_exact']}")  # fmt: skip
            if args.device == "cuda":
                torch.cuda.empty_cache()
    for t in [tokens[0], tokens[-1]] if args.quick and not args.tiny else tokens:
        row = bench_colmass(colmass, t, heads, args.device, gen)
        colmass_rows.append(row)
        print(f"column_mass {t:6d} tok  triton {row['triton']['median_ms']:.2f} ms "
              f"torch {row['torch_chunked']['median_ms']:.2f} ms  x{row['speedup']:.1f} "
              f"err={row['max_rel_err']:.1e}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**versions(args.device), "codec": codec_rows, "column_mass": colmass_rows}
    (out / "quant_pack.json").write_text(json.dumps(result, indent=1))
    print("wrote", out / "quant_pack.json")


if __name__ == "__main__":
    main()
