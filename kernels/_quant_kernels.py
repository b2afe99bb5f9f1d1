"""Triton code of the group-wise quantize/pack and unpack/dequantize kernels.

Launchers and the contract live in ``quant.py``. Each program owns a tile of
``[BLOCK_R rows, GPB groups, GP lanes]`` of a row-major ``[M, N]`` view, where ``GP`` is the group
length rounded up to a power of two (lanes ``>= GROUP`` are masked off).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(pid_r, pid_g, M, NG, BLOCK_R: tl.constexpr, GPB: tl.constexpr, GP: tl.constexpr,
          GROUP: tl.constexpr):  # fmt: skip
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    groups = pid_g * GPB + tl.arange(0, GPB)
    lanes = tl.arange(0, GP)
    row_ok = rows < M
    group_ok = groups < NG
    mask = row_ok[:, None, None] & group_ok[None, :, None] & (lanes < GROUP)[None, None, :]
    return rows, groups, lanes, row_ok[:, None] & group_ok[None, :], mask


@triton.jit
def _round_half_even(y):
    # torch.round semantics without libdevice; y - floor(y) is exact in fp32 for y >= 0 and the
    # negative side is clamped to code 0 by the caller anyway.
    f = tl.floor(y)
    r = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (r > 0.5) | ((r == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit(do_not_specialize=("M",))
def _quantize_pack_kernel(
    x_ptr, codes_ptr, scale_ptr, lo_ptr, M, N, NG,
    BITS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, GPB: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows, groups, lanes, meta_mask, mask = _tile(
        tl.program_id(0), tl.program_id(1), M, NG, BLOCK_R, GPB, GP, GROUP
    )
    offs = rows[:, None, None] * N + (groups * GROUP)[None, :, None] + lanes[None, None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # torch.nan_to_num(nan=0, posinf=65504, neginf=-65504)
    x = tl.where(x != x, 0.0, x)
    x = tl.where(x == float("inf"), 65504.0, x)
    x = tl.where(x == float("-inf"), -65504.0, x)

    LEVELS: tl.constexpr = (1 << BITS) - 1
    # Groups past the end see no lanes; zero them so they carry no inf - inf.
    lo = tl.where(meta_mask, tl.min(tl.where(mask, x, float("inf")), axis=2), 0.0)
    hi = tl.where(meta_mask, tl.max(tl.where(mask, x, float("-inf")), axis=2), 0.0)
    scale = tl.math.div_rn(hi - lo, tl.full(hi.shape, LEVELS, tl.float32))
    scale = scale.to(tl.float16).to(tl.float32)
    bad = (scale == 0.0) | (scale != scale) | (tl.abs(scale) == float("inf"))
    scale = tl.where(bad, 1.0, scale)
    lo = lo.to(tl.float16).to(tl.float32)

    y = tl.math.div_rn(x - lo[:, :, None], tl.broadcast_to(scale[:, :, None], x.shape))
    code = tl.minimum(tl.maximum(_round_half_even(y), 0.0), LEVELS * 1.0).to(tl.int32)

    meta_offs = rows[:, None] * NG + groups[None, :]
    tl.store(scale_ptr + meta_offs, scale.to(tl.float16), mask=meta_mask)
    tl.store(lo_ptr + meta_offs, lo.to(tl.float16), mask=meta_mask)

    PER: tl.constexpr = 8 // BITS  # codes per byte, first code in the lowest bits
    if PER == 1:
        packed = code
        bytes_mask = mask
        byte_offs = offs
    else:
        code4 = tl.reshape(code, (BLOCK_R, GPB, GP // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(code4 << shifts[None, None, None, :], axis=3)
        nbytes = tl.arange(0, GP // PER)
        bytes_mask = (meta_mask[:, :, None]) & (nbytes < GROUP // PER)[None, None, :]
        byte_offs = (
            rows[:, None, None] * (N // PER)
            + (groups * (GROUP // PER))[None, :, None]
            + nbytes[None, None, :]
        )
    tl.store(codes_ptr + byte_offs, packed.to(tl.uint8), mask=bytes_mask)


@triton.jit(do_not_specialize=("M",))
def _dequantize_unpack_kernel(
    codes_ptr, scale_ptr, lo_ptr, out_ptr, M, N, NG,
    BITS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, GPB: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows, groups, lanes, meta_mask, mask = _tile(
        tl.program_id(0), tl.program_id(1), M, NG, BLOCK_R, GPB, GP, GROUP
    )
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    # A byte is loaded by each of its PER lanes; the repeats hit L1, which is cheaper than a
    # reshape/interleave of the unpacked codes.
    byte_offs = (
        rows[:, None, None] * (N // PER)
        + (groups * (GROUP // PER))[None, :, None]
        + (lanes // PER)[None, None, :]
    )
    byte = tl.load(codes_ptr + byte_offs, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((lanes % PER) * BITS)[None, None, :]) & LEVELS

    meta_offs = rows[:, None] * NG + groups[None, :]
    scale = tl.load(scale_ptr + meta_offs, mask=meta_mask, other=1.0).to(tl.float32)
    lo = tl.load(lo_ptr + meta_offs, mask=meta_mask, other=0.0).to(tl.float32)
    x_hat = code.to(tl.float32) * scale[:, :, None] + lo[:, :, None]

    offs = rows[:, None, None] * N + (groups * GROUP)[None, :, None] + lanes[None, None, :]
    tl.store(out_ptr + offs, x_hat.to(out_ptr.dtype.element_ty), mask=mask)
