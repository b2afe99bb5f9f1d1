"""A standalone test of the ``tl.interleave`` unpacking that gave wrong decode outputs on the H200
at 16-token pages (GPU runs 6-7, bench/decode_notes.md): load packed uint8 rows ``[R, NB]`` and
unpack 2- or 4-bit codes (first code in the lowest bits) with nested ``tl.interleave``, against
numpy. Rows of 4 and 8 bytes are the failing page geometry (2 and 4 bits at 16 tokens); 8 and 16
bytes (32-token pages) passed inside the kernel. A 3-D ``[D, PPI, NB]`` block is tried too (the
uniform path's two pages an iteration).

    python3 bench/interleave_repro.py            # CUDA; TRITON_INTERPRET=1 on a CPU

Prints one line per (bits, shape, bytes per row) with the count of wrong codes, and exits 1 if
any is wrong.
"""

from __future__ import annotations

import sys

import numpy as np
import triton
import triton.language as tl


@triton.jit
def _unpack_il(x, BITS: tl.constexpr):
    x = x.to(tl.int32)
    if BITS == 4:
        x = tl.interleave(x & 15, x >> 4)
    else:
        x = tl.interleave(
            tl.interleave(x & 3, (x >> 4) & 3), tl.interleave((x >> 2) & 3, (x >> 6) & 3)
        )
    return x


@triton.jit
def _rows_kernel(src, dst, R: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr):
    r = tl.arange(0, R)
    b = tl.arange(0, NB)
    byte = tl.load(src + r[:, None] * NB + b[None, :])
    code = _unpack_il(byte, BITS)  # [R, NB * 8 // BITS]
    PER: tl.constexpr = 8 // BITS
    c = tl.arange(0, NB * PER)
    tl.store(dst + r[:, None] * (NB * PER) + c[None, :], code)


@triton.jit
def _pages_kernel(src, dst, D: tl.constexpr, PPI: tl.constexpr, NB: tl.constexpr,
                  BITS: tl.constexpr):  # fmt: skip
    d = tl.arange(0, D)
    k = tl.arange(0, PPI)
    b = tl.arange(0, NB)
    off = (d * PPI * NB)[:, None, None] + (k * NB)[None, :, None] + b[None, None, :]
    code = _unpack_il(tl.load(src + off), BITS)  # [D, PPI, NB * 8 // BITS]
    PER: tl.constexpr = 8 // BITS
    c = tl.arange(0, NB * PER)
    out = (d * PPI * NB * PER)[:, None, None] + (k * NB * PER)[None, :, None] + c[None, None, :]
    tl.store(dst + out, code)


def _expect(raw: np.ndarray, bits: int) -> np.ndarray:
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    codes = (raw[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*raw.shape[:-1], -1).astype(np.int32)


def _device():
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return lambda a: torch.from_numpy(a).to(dev), lambda t: t.cpu().numpy()


def main() -> int:
    to_dev, to_host = _device()
    rng = np.random.default_rng(0)
    bad = 0
    cases = [("rows", bits, (64, nb)) for bits in (2, 4) for nb in (4, 8, 16)]
    cases += [("pages", bits, (64, 2, nb)) for bits in (2, 4) for nb in (4, 8, 16)]
    for kind, bits, shape in cases:
        raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
        want = _expect(raw, bits)
        src, dst = to_dev(raw), to_dev(np.full(want.shape, -1, dtype=np.int32))
        if kind == "rows":
            _rows_kernel[(1,)](src, dst, R=shape[0], NB=shape[1], BITS=bits)
        else:
            _pages_kernel[(1,)](src, dst, D=shape[0], PPI=shape[1], NB=shape[2], BITS=bits)
        got = to_host(dst)
        wrong = int((got != want).sum())
        bad += wrong > 0
        print(f"{kind:5s} bits={bits} shape={shape!s:13s} bytes/row={shape[-1]:2d} "
              f"{'OK' if not wrong else f'WRONG {wrong}/{want.size} codes'}")  # fmt: skip
    print("triton", triton.__version__)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
