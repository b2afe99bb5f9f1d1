"""Wall time of a decoupled (RDKV) routing's Zone A pack: the per-(layer, head, V width) loop
(``_pack_ref`` of ``tests/formats/test_zone_a.py``, the pack before task zonepack) vs
``zone_a.pack_layers`` (all layers at once, in groups of ``--group-bytes`` of float32 K/V as
``pool.repack`` does), on random inputs at a model's KV shapes; the two images are compared.

    python3 -P bench/zone_pack.py --device cuda --out bench/results/zone-pack
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "formats"))

from test_zone_a import _pack_ref  # noqa: E402

from tiered_radix.formats import zone_a  # noqa: E402

SHAPES = {"qwen0.5b": (24, 2, 64), "llama8b": (32, 8, 128)}  # layers, KV heads, head dim


def inputs(L, H, T, d, keep, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    k = [torch.randn(H, T, d, generator=g, device=dev) for _ in range(L)]
    v = [torch.randn(H, T, d, generator=g, device=dev) for _ in range(L)]
    vb = torch.tensor([2, 4, 8, 16])[torch.randint(4, (L, H, T))]
    kb = torch.tensor([0, 2, 4, 8, 16])[torch.randint(5, (L, H, d))]
    in_set = torch.rand(L, H, T) < keep
    return k, v, vb, kb, in_set  # decisions on the host, as pool.repack passes them


def timed(f, dev, reps):
    f()
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        out = f()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3, out


def batched(k, v, vb, kb, s, group, kw):
    out = []
    for a in range(0, len(k), group):
        b = slice(a, a + group)
        out += zone_a.pack_layers(k[b], v[b], vb[b], kb[b], s[b], **kw)
    return out


def looped(k, v, vb, kb, s, kw):
    return [_pack_ref(k[i], v[i], vb[i], kb[i], s[i], **kw) for i in range(len(k))]


def measure(model, T, args, kw) -> dict:
    L, H, d = SHAPES[model]
    x = inputs(L, H, T, d, args.keep, args.device)
    group = max(1, args.group_bytes // (8 * H * T * d))  # as pool.repack
    t_new, z_new = timed(lambda: batched(*x, group, kw), args.device, args.reps)
    t_ref, z_ref = timed(lambda: looped(*x, kw), args.device, max(1, args.reps // 3))
    same = all(torch.equal(a.img, b.img) and torch.equal(a.page_off, b.page_off)
               for a, b in zip(z_new, z_ref, strict=True))  # fmt: skip
    return dict(model=model, tokens=T, layers=L, heads=H, head_dim=d, keep=args.keep,
                group=group, loop_ms=round(t_ref, 2), batched_ms=round(t_new, 2),
                speedup=round(t_ref / t_new, 2), bytes_equal=same,
                image_mb=round(sum(z.nbytes for z in z_new) / 2**20, 1))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--keep", type=float, default=0.3, help="share of tokens in the set")
    ap.add_argument("--group-bytes", type=int, default=1 << 30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for zone_pack.json")
    args = ap.parse_args()
    kw = dict(page_size=32, v_group=32, raw_dtype=torch.bfloat16)
    rows = []
    for model in args.model:
        for T in args.tokens:
            row = measure(model, T, args, kw)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        res = {"args": vars(args), "torch": torch.__version__, "rows": rows}
        (Path(args.out) / "zone_pack.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
