"""Benchmark: the TriZone extend kernel (one chunk of a long prompt over its tiered prefix) vs the
backend's former PyTorch path and dense bf16 prefill over the whole prefix.

    python bench/extend_attention.py [--quick] [--out bench/results/extend-attention]
    TRITON_INTERPRET=1 python bench/extend_attention.py --device cpu --tiny   # smoke test

Qwen2.5-0.5B's attention shape (14 query heads, 2 KV heads, d 64, 32-token windows), one layer,
a chunk of 2,048 new tokens per request over a prefix of P tokens, per (batch, P):

- ``kernel``: ``extend.run`` (the chunk over its lists: full rows, INT2 pages, evicted windows
  absent), qevict-like mix at 10%: ``--full`` of the prefix windows as rows, ``--quant`` as INT2
  pages, the rest evicted (the chunk's windows are rows); ``kernel w8`` / ``kernel m32 w8`` /
  ``kernel ppi2``: 8 warps, 32-token tiles at 8 warps, 2 pages an iteration;
- ``kernel+attn``: plus ``extend.signals`` for ``attn`` (what qevict reads);
- ``kernel+snap``: plus ``obs_attn`` and ``colmass`` (SnapKV/RDKV-style reads);
- ``rdkv qnorm ops``: what rdkv's prefill launched per layer before (``kernel+snap`` with its
  query rows in one program a key tile, plus ``chunk_qnorm``'s tensor ops); ``rdkv S<n>``: the
  kernel writing the qnorm sums, the signals pass with each request's rows split in runs
  (``extend.signal_splits``, at most ``n``); ``rdkv s1``: the same unsplit. Run it over rows
  only, as rdkv prefills (``--full 1 --quant 0``), at its chunk (``--chunk 4096``);
- ``gather_sdpa``: what ``TieredAttnBackend._gather`` did per request and layer on CUDA: every
  prefix window gathered (rows, pages dequantized) then ``attend_sdpa`` (masked SDPA + the last
  query's ``attend``);
- ``dense_flashinfer`` / ``dense_sdpa``: bf16 causal prefill of the chunk over the whole dense
  prefix (FlashInfer's single/batch prefill when importable; SDPA otherwise): plain SGLang's cost.

Times are CUDA-event medians in ms per layer (x 24 layers for the model). Each row is printed as
it completes; the table goes to OUT/extend_attention.json.
"""

from __future__ import annotations

import argparse
import json
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

from tiered_radix.kernels import extend  # noqa: E402

from tiered_radix.formats.layout import pack_uniform_pages, unpack_uniform_pages  # noqa: E402

HQ, HKV, D, W, BITS, VG = 14, 2, 64, 32, 2, 32
CHUNK = 2048
FULL_CASES = [(1, 0), (1, 28672), (8, 28672), (32, 6144)]  # (batch, prefix): 4K, 30K, 8x30K, 32x8K
QUICK = [(1, 28672), (8, 28672)]
TINY = [(2, 96)]


def build(batch: int, prefix: int, chunk: int, full: float, quant: float, dev, seed=0):
    """Random storage and lists of ``batch`` requests of ``prefix + chunk`` tokens: prefix
    windows rows / pages / evicted with probabilities full / quant / rest per head."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq = prefix + chunk
    n = -(-seq // W)
    first_new = prefix // W
    u = torch.rand(batch, HKV, n, generator=g)
    kind = torch.where(u < full, extend.ROW, torch.where(u < full + quant, extend.PAGE,
                                                         extend.ABSENT))  # fmt: skip
    kind[..., first_new:] = extend.ROW
    ids = torch.arange(batch * HKV * n).view(batch, HKV, n) + 1
    nb = batch * HKV * n + 1
    rows_k = torch.randn(nb, W, D, dtype=torch.bfloat16, device=dev)
    rows_v = torch.randn(nb, W, D, dtype=torch.bfloat16, device=dev)
    npg = int((kind == extend.PAGE).sum())
    pk = torch.randn(max(npg, 1), W, D, device=dev)
    pages = pack_uniform_pages(pk, torch.randn_like(pk), BITS, VG)
    pages = torch.cat([pages[:1] * 0, pages])  # page 0: never listed
    page_blk = torch.zeros_like(ids)
    page_blk[kind == extend.PAGE] = torch.arange(npg) + 1
    ls = extend.window_lists(kind.to(dev), ids.to(dev), page_blk.to(dev))
    st = extend.LayerStore(rows_k, rows_v, pages, BITS, VG)
    p = extend.plan([chunk] * batch, [seq] * batch, HQ // HKV, dev)
    q = torch.randn(batch * chunk, HQ, D, dtype=torch.bfloat16, device=dev)
    return q, st, ls, p, kind


def gather_sdpa(q, st, ls, p, kind, attend_sdpa, scale):
    """The former backend path: per request, all windows gathered (pages dequantized), then
    ``attend_sdpa`` with the kept mask."""
    n = kind.shape[-1]
    q0 = 0
    for b, (tq, seq) in enumerate(zip(p.q_lens, p.seqs, strict=True)):
        base = b * HKV * n
        blk = ls.blk[base : base + HKV * n].view(HKV, n).long()
        win = ls.win[base : base + HKV * n].view(HKV, n).long()
        order = win.argsort(-1)
        blk = blk.gather(-1, order)
        kd = kind[b].to(blk.device)
        k = st.rows_k[torch.where(kd == extend.ROW, blk, 0)].float()
        v = st.rows_v[torch.where(kd == extend.ROW, blk, 0)].float()
        kq, vq = unpack_uniform_pages(st.pages[torch.where(kd == extend.PAGE, blk, 0).flatten()],
                                      BITS, W, D, VG)  # fmt: skip
        isq = (kd == extend.PAGE)[..., None, None]
        k = torch.where(isq, kq.view(HKV, n, W, D), k).reshape(HKV, n * W, D)[:, :seq]
        v = torch.where(isq, vq.view(HKV, n, W, D), v).reshape(HKV, n * W, D)[:, :seq]
        kept = (kd != extend.ABSENT).repeat_interleave(W, 1)[:, :seq]
        qi = q[q0 : q0 + tq].transpose(0, 1)
        attend_sdpa(qi, k, v, kept, scale, need=frozenset(), chunk_elems=1 << 27)
        q0 += tq


def dense(q, batch, prefix, chunk, dev, scale):
    """bf16 causal prefill of each chunk over its whole dense prefix: FlashInfer when importable
    (batch prefill over a ragged KV), else SDPA per request."""
    seq = prefix + chunk
    k = torch.randn(batch * seq, HKV, D, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    try:
        import flashinfer

        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        qo = torch.arange(batch + 1, dtype=torch.int32, device=dev) * chunk
        kv = torch.arange(batch + 1, dtype=torch.int32, device=dev) * seq
        w.plan(qo, kv, HQ, HKV, D, causal=True, sm_scale=scale, q_data_type=torch.bfloat16)
        return "dense_flashinfer", lambda: w.run(q, k, v)
    except Exception as err:  # noqa: BLE001 - any import/plan failure: the SDPA fallback
        print(f"  (flashinfer unavailable: {type(err).__name__}: {str(err)[:120]})", flush=True)
    kk = k.view(batch, seq, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vv = v.view(batch, seq, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    qq = q.view(batch, chunk, HQ, D).transpose(1, 2)
    mask = torch.ones(chunk, seq, dtype=torch.bool, device=dev).tril(seq - chunk)

    def run():
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                                scale=scale)  # fmt: skip

    return "dense_sdpa", run


def timed(fn, dev, reps: int) -> float:
    """Median ms of ``fn`` (CUDA events; wall time on CPU)."""
    fn()
    if dev == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def run_case(batch: int, prefix: int, chunk: int, a, dev, scale: float) -> list[dict]:
    """Every contender at one (batch, prefix); rows printed as they complete."""
    from tiered_radix.engine.attention import attend_sdpa

    q, st, ls, p, kind = build(batch, prefix, chunk, a.full, a.quant, dev)
    runs = {"kernel": lambda: extend.run(q, st, ls, p, HKV, sm_scale=scale)}
    # tile variants (the default: 16 tokens x 8 heads, 4 warps at d 64)
    p32 = extend.plan(list(p.q_lens), list(p.seqs), HQ // HKV, dev, block_m=32)
    runs["kernel w8"] = lambda: extend.run(q, st, ls, p, HKV, sm_scale=scale, num_warps=8)
    runs["kernel m32 w8"] = lambda: extend.run(q, st, ls, p32, HKV, sm_scale=scale, num_warps=8)
    runs["kernel ppi2"] = lambda: extend.run(q, st, ls, p, HKV, sm_scale=scale, ppi=2)
    for name, need in (("kernel+attn", {"attn"}), ("kernel+snap", {"obs_attn", "colmass"})):

        def both(need=frozenset(need)):
            _, lse = extend.run(q, st, ls, p, HKV, sm_scale=scale)
            extend.signals(q, lse, st, ls, p, HKV, need, sm_scale=scale)

        runs[name] = both
    snap = frozenset({"obs_attn", "colmass"})
    splits = extend.signal_splits(p, W, HKV, snap)
    qsq = torch.zeros(p.batch, p.tiles_max, HKV, D, device=dev)

    def rdkv_ops():
        _, lse = extend.run(q, st, ls, p, HKV, sm_scale=scale)
        extend.signals(q, lse, st, ls, p, HKV, snap, sm_scale=scale)
        qsq[:, 0] = extend.chunk_qnorm(q, p, HKV)

    def rdkv(s=splits):
        _, lse = extend.run(q, st, ls, p, HKV, sm_scale=scale, qnorm_sq=qsq)
        extend.signals(q, lse, st, ls, p, HKV, snap, sm_scale=scale, splits=s)

    runs["rdkv qnorm ops"] = rdkv_ops
    runs[f"rdkv S{splits.most}"] = rdkv
    runs["rdkv s1"] = lambda: rdkv(None)
    runs["gather_sdpa"] = lambda: gather_sdpa(q, st, ls, p, kind, attend_sdpa, scale)
    try:
        name, fn = dense(q, batch, prefix, chunk, dev, scale)
        runs[name] = fn
    except Exception as err:  # noqa: BLE001 - out of memory etc.: recorded, not fatal
        print(f"  dense: {type(err).__name__}: {str(err)[:160]}", flush=True)
    rows = []
    for name, fn in runs.items():
        try:
            ms, err = timed(fn, dev, a.reps), None
        except Exception as e:  # noqa: BLE001 - a failing contender is recorded, never fatal
            ms, err = None, f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(dict(batch=batch, prefix=prefix, chunk=chunk, what=name, ms=ms, error=err))
        shown = "error" if ms is None else f"{ms:9.3f} {ms * 24:8.1f}"
        print(f"{batch:>5} {prefix:>7} {name:<18} {shown}", flush=True)
        if err:
            print(f"    {err}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--full", type=float, default=0.05, help="prefix windows kept as rows")
    ap.add_argument("--quant", type=float, default=0.35, help="prefix windows kept as INT2 pages")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=CHUNK, help="new tokens per request")
    ap.add_argument("--cases", nargs="+", default=None, help="BATCHxPREFIX, e.g. 1x0 1x4096")
    ap.add_argument("--out", default="bench/results/extend-attention")
    a = ap.parse_args()
    dev = a.device
    cases = TINY if a.tiny else QUICK if a.quick else FULL_CASES
    if a.cases:
        cases = [tuple(int(x) for x in c.split("x")) for c in a.cases]
    chunk = 40 if a.tiny else a.chunk
    scale = D**-0.5
    rows = []
    gpu = torch.cuda.get_device_name() if dev != "cpu" else "cpu"
    print(f"{gpu}: Qwen2.5-0.5B attention, chunk {chunk}, mix rows {a.full} / int2 {a.quant}")
    print(f"{'batch':>5} {'prefix':>7} {'what':<18} {'ms/layer':>9} {'x24 ms':>8}", flush=True)
    for batch, prefix in cases:
        rows += run_case(batch, prefix, chunk, a, dev, scale)
        if dev != "cpu":
            torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "extend_attention.json").write_text(json.dumps(
        {"gpu": gpu, "command": " ".join(sys.argv), "full": a.full, "quant": a.quant,
         "torch": torch.__version__, "rows": rows}, indent=1))  # fmt: skip
    print(f"wrote {out / 'extend_attention.json'}")


if __name__ == "__main__":
    main()
