"""Fused group-wise quantize+pack and unpack+dequantize (Triton), one launch for all rows.

Bit-exact twin of ``tiered_radix.formats.codecs.quantize`` / ``dequantize`` (the plain-PyTorch
reference): asymmetric integer codes along the last axis, groups of ``group`` consecutive
elements, fp16 ``scale``/``lo`` per group, ``8 // bits`` codes per byte, first code in the
lowest bits. Codes, scales and lows equal the engine's bit for bit; dequantized values equal up
to fp rounding (the kernel may fuse ``code * scale + lo`` into one FMA).

Batched: ``x`` may have any leading shape, e.g. K windows ``[n_windows, d, window]`` (groups
along tokens, KIVI per-channel) or V rows ``[tokens, d]`` (groups along d, per-token).
"""

from __future__ import annotations

import torch
import triton

from tiered_radix.formats.codecs import CodecError, QuantizedTensor

from ._device import triton_runs_on
from ._quant_kernels import _dequantize_unpack_kernel, _quantize_pack_kernel

_BITS = (2, 4, 8)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_TILE_ELEMS = 4096  # elements per program: enough bytes in flight, few registers per thread


def _check_device(t: torch.Tensor, name: str) -> None:
    if not triton_runs_on(t):
        raise ValueError(
            f"{name} is on {t.device}; the Triton kernels need a CUDA tensor. On CPU use "
            "tiered_radix.formats.codecs.quantize/dequantize (same results)."
        )


def _check_layout(bits: int, group: int, n: int) -> None:
    if bits not in _BITS:
        raise CodecError(f"bits={bits!r} is not supported; choose one of {_BITS}")
    if not isinstance(group, int) or group <= 0:
        raise CodecError(f"group={group!r} must be a positive int")
    if n % group:
        raise CodecError(f"last dim {n} is not a multiple of group={group}; pad or pick a divisor")
    if group % (8 // bits):
        raise CodecError(
            f"group={group} must be a multiple of {8 // bits} at bits={bits} so that no packed "
            "byte straddles two groups (use tiered_radix.formats.codecs.quantize for such groups)"
        )


def _grid_and_blocks(m: int, n: int, group: int) -> tuple[tuple[int, int], dict[str, int]]:
    ng = n // group
    gp = triton.next_power_of_2(group)
    gpb = min(triton.next_power_of_2(ng), max(1, _TILE_ELEMS // gp))
    # not shrunk to small m: BLOCK_R is compiled in, and a routing's row count changes every
    # time (one variant per power of two, each compiled in front of that routing's moves)
    block_r = max(1, _TILE_ELEMS // (gpb * gp))
    grid = (triton.cdiv(m, block_r), triton.cdiv(ng, gpb))
    return grid, {"GROUP": group, "GP": gp, "GPB": gpb, "BLOCK_R": block_r}


def _check_out(out: QuantizedTensor, like: QuantizedTensor) -> None:
    for field in ("codes", "scale", "lo"):
        got, want = getattr(out, field), getattr(like, field)
        if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
            raise ValueError(
                f"out.{field} is {tuple(got.shape)} {got.dtype} on {got.device}; expected "
                f"{tuple(want.shape)} {want.dtype} on {want.device}"
            )
        if not got.is_contiguous():
            raise ValueError(f"out.{field} must be contiguous")
    if (out.bits, out.group, out.n) != (like.bits, like.group, like.n):
        raise ValueError(
            f"out has bits/group/n {(out.bits, out.group, out.n)}, expected "
            f"{(like.bits, like.group, like.n)}"
        )


def quantize_pack(
    x: torch.Tensor, *, bits: int, group: int, out: QuantizedTensor | None = None
) -> QuantizedTensor:
    """Quantize and pack ``x[..., n]`` group-wise along its last axis in one kernel launch.

    Args:
        x: ``[..., n]`` float16/bfloat16/float32, contiguous, CUDA. NaN -> 0 and +-inf ->
            +-65504 before the group min/max; finite values beyond the fp16 range saturate
            ``lo`` to +-inf exactly as the engine codec does.
        bits: 2, 4 or 8.
        group: elements per group; ``n % group == 0`` and ``group % (8 // bits) == 0``.
            Layout errors raise ``CodecError`` (a ``ValueError``), like the engine codec.
        out: optional preallocated result (e.g. ledger pool slots) to write into.

    Returns:
        ``QuantizedTensor`` with ``codes: uint8 [..., n*bits//8]``, ``scale, lo: float16
        [..., n//group]``.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() == 0:
        raise TypeError(
            "x must be a float16/bfloat16/float32 tensor with >= 1 dim, got "
            f"{type(x).__name__} {getattr(x, 'dtype', '')}"
        )
    _check_device(x, "x")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call x.contiguous() (e.g. after transposing K)")
    n = x.shape[-1]
    _check_layout(bits, group, n)
    lead = tuple(x.shape[:-1])
    shape = QuantizedTensor(
        codes=x.new_empty((*lead, n * bits // 8), dtype=torch.uint8),
        scale=x.new_empty((*lead, n // group), dtype=torch.float16),
        lo=x.new_empty((*lead, n // group), dtype=torch.float16),
        bits=bits,
        group=group,
        n=n,
    )
    if out is None:
        out = shape
    else:
        _check_out(out, shape)
    m = x.numel() // n
    if m:
        grid, blocks = _grid_and_blocks(m, n, group)
        _quantize_pack_kernel[grid](
            x, out.codes, out.scale, out.lo, m, n, n // group, BITS=bits, **blocks
        )
    return out


def dequantize_unpack(
    q: QuantizedTensor, *, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Unpack and dequantize ``q`` in one launch: ``code * scale + lo`` as ``dtype [..., n]``.

    Args:
        q: a ``QuantizedTensor`` on CUDA with contiguous buffers.
        dtype: float16, bfloat16 or float32.
        out: optional preallocated ``dtype [..., n]`` contiguous tensor to write into.
    """
    if dtype not in _FLOATS:
        raise TypeError(f"dtype must be one of {_FLOATS}, got {dtype}")
    _check_layout(q.bits, q.group, q.n)
    lead = tuple(q.codes.shape[:-1])
    for name, t, last, dt in (
        ("codes", q.codes, q.n * q.bits // 8, torch.uint8),
        ("scale", q.scale, q.n // q.group, torch.float16),
        ("lo", q.lo, q.n // q.group, torch.float16),
    ):
        _check_device(t, f"q.{name}")
        if t.dtype != dt or tuple(t.shape) != (*lead, last) or not t.is_contiguous():
            raise ValueError(
                f"q.{name} is {tuple(t.shape)} {t.dtype}; expected contiguous "
                f"{(*lead, last)} {dt} for bits={q.bits}, group={q.group}, n={q.n}"
            )
    if out is None:
        out = torch.empty((*lead, q.n), dtype=dtype, device=q.codes.device)
    elif (
        out.dtype != dtype
        or tuple(out.shape) != (*lead, q.n)
        or out.device != q.codes.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected contiguous "
            f"{(*lead, q.n)} {dtype} on {q.codes.device}"
        )
    m = q.codes.numel() // max(1, q.codes.shape[-1])
    if m:
        grid, blocks = _grid_and_blocks(m, q.n, q.group)
        _dequantize_unpack_kernel[grid](
            q.codes, q.scale, q.lo, out, m, q.n, q.n // q.group, BITS=q.bits, **blocks
        )
    return out
