"""Asymmetric group-wise integer codec: the numeric contract every kernel must match.

A tensor ``x[..., n]`` is cut along its LAST axis into groups of ``group`` consecutive elements;
each group stores ``bits``-bit codes plus an fp16 ``scale`` and fp16 ``lo``. The caller picks the
axis (KIVI layout): V per token (``x = V[tokens, d]``), K per channel (``x = K.T[d, tokens]``).

Per group, after ``torch.nan_to_num(x.float(), nan=0, posinf=65504, neginf=-65504)``::

    lo, hi  = min(x_g), max(x_g)                       (float32)
    scale16 = ((hi - lo) / (2**bits - 1)).half()       (0 or non-finite -> 1.0)
    lo16    = lo.half()
    code    = clamp(round_half_even((x - lo16) / scale16), 0, 2**bits - 1)
    x_hat   = code * scale16 + lo16                    (float32, then the requested dtype)

Codes are packed little-end first: ``8 // bits`` codes per byte, code ``i`` of a byte in bits
``[bits*i, bits*(i+1))``. Finite inputs beyond the fp16 range (only reachable from bf16/fp32
data) saturate ``lo16`` to +-inf and decode to +-inf; they never produce NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BITS = (2, 4, 8)
FP16_MAX = 65504.0


class CodecError(ValueError):
    """Raised for a shape, bit width or group size the codec does not support."""


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor quantized group-wise along its last axis.

    codes: uint8 ``[..., n * bits // 8]`` packed codes.
    scale: float16 ``[..., n // group]``; lo: float16 ``[..., n // group]``.
    n: logical length of the last axis.
    """

    codes: Tensor
    scale: Tensor
    lo: Tensor
    bits: int
    group: int
    n: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the tensor that was quantized."""
        return (*self.codes.shape[:-1], self.n)

    @property
    def nbytes(self) -> int:
        """Storage bytes: packed codes plus 2 bytes per scale and 2 bytes per lo."""
        return self.codes.numel() + 2 * self.scale.numel() + 2 * self.lo.numel()


def _check(bits: int, n: int, group: int | None = None) -> None:
    if bits not in BITS:
        raise CodecError(f"bits must be one of {BITS}, got {bits}")
    if n % (8 // bits):
        raise CodecError(f"last-axis length {n} must be a multiple of {8 // bits} for {bits}-bit")
    if group is not None and (group <= 0 or n % group):
        raise CodecError(f"last-axis length {n} must be a positive multiple of group={group}")


def _shifts(bits: int, device: torch.device) -> Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes ``[..., n]`` (each < 2**bits) into uint8 ``[..., n * bits // 8]``."""
    _check(bits, codes.shape[-1])
    if codes.dtype != torch.uint8:
        raise CodecError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.clone()
    per = 8 // bits
    lanes = codes.reshape(*codes.shape[:-1], -1, per) << _shifts(bits, codes.device)
    # The lanes occupy disjoint bit ranges, so their sum is their bitwise or.
    return lanes.sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., n * bits // 8]`` -> uint8 codes ``[..., n]``."""
    _check(bits, n)
    if packed.dtype != torch.uint8 or packed.shape[-1] != n * bits // 8:
        raise CodecError(
            f"packed must be uint8 [..., {n * bits // 8}] for n={n} at {bits}-bit, "
            f"got {packed.dtype} {list(packed.shape)}"
        )
    if bits == 8:
        return packed.clone()
    lanes = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)
    return lanes.reshape(*packed.shape[:-1], n)


def quantize(x: Tensor, bits: int, group: int) -> QuantizedTensor:
    """Quantize ``x[..., n]`` (any float dtype, any device) group-wise along the last axis.

    Raises:
        CodecError: ``bits`` not in {2, 4, 8}, or ``n`` not a multiple of ``group`` / ``8 // bits``.
    """
    n = x.shape[-1]
    _check(bits, n, group)
    qmax = (1 << bits) - 1
    xg = torch.nan_to_num(x.float(), nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
    xg = xg.reshape(*x.shape[:-1], n // group, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which
    # rounds differently from IEEE division (the Triton twin, and the CPU) in rare groups
    scale16 = ((hi - lo) / torch.full_like(hi, qmax)).half()
    scale16 = torch.where((scale16 == 0) | ~scale16.isfinite(), 1.0, scale16)
    lo16 = lo.half()
    code = torch.round((xg - lo16.float().unsqueeze(-1)) / scale16.float().unsqueeze(-1))
    code = code.clamp(0, qmax).to(torch.uint8).reshape(*x.shape[:-1], n)
    return QuantizedTensor(pack(code, bits), scale16, lo16, bits, group, n)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode ``q`` to a ``[..., n]`` tensor of ``dtype`` on ``q.codes.device``."""
    code = unpack(q.codes, q.bits, q.n).reshape(*q.codes.shape[:-1], q.n // q.group, q.group)
    x = code.float() * q.scale.float().unsqueeze(-1) + q.lo.float().unsqueeze(-1)
    return x.reshape(q.shape).to(dtype)


def quantized_nbytes(numel: int, bits: int, group: int) -> int:
    """Bytes :class:`QuantizedTensor` uses for ``numel`` elements at ``bits`` with ``group``."""
    _check(bits, numel, group)
    return numel * bits // 8 + 4 * (numel // group)


def unit_nbytes(numel: int, bits: int, group: int) -> int:
    """Bytes for ``numel`` elements at any tier width: 0 (evicted), 2/4/8 (quantized), 16 (fp16)."""
    if bits == 0:
        return 0
    if bits == 16:
        return 2 * numel
    return quantized_nbytes(numel, bits, group)
