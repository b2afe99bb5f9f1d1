"""Dequantisation of sub-byte codes in the TriZone decode kernels without conversions
(``decode.plan(dequant="magic")``): x = code * scale + lo in float32, two ways.

- convert (the kernels' own lines, unchanged): float(code) by an int -> float conversion (PTX
  ``cvt.rn.f32.u32``, SASS ``I2FP``), then one FMA.  The CUDA guide gives conversions 16
  results a clock an SM, an eighth of the FMA rate (which sm_90 pipe runs ``I2FP`` is not
  documented): at 2 bits a d128 page's 4096 K and 4096 V codes would be 512 clocks an SM.
- magic (here): 1 + code / 2**BITS, built from the code's bits (shifted under the exponent of
  1.0, 0x3F800000: exactly that float for any code < 2**BITS), then one FMA with the group's
  scale and offset rescaled once a group: (1 + c / 2**B) * (s * 2**B) + (lo - s * 2**B) =
  c * s + lo.  No conversion: a shift and an or on the integer pipes (the shift merges with the
  unpacking's; the or with the unpacking's mask when 1.0's bits are in a register:
  :func:`_magic_one`).  The product is exact (s * 2**B is the fp16 scale times a power of two)
  and the FMA rounds once, as convert's does; the one extra rounding, of lo - s * 2**B in
  float32, is 2**-24 of |lo| plus the group's range, far below the bf16/fp16 rounding the value
  gets before ``tl.dot``.
"""

from __future__ import annotations

import triton
import triton.language as tl

ONE_BITS = tl.constexpr(0x3F800000)  # float32 1.0: sign 0, exponent 127, mantissa 0


@triton.jit
def _magic_one(small):
    """The bits of float32 1.0 from a run-time int ``small`` < 2**30 (e.g. the group size), so
    that no compiler folds them into an immediate: ptxas then keeps them in a register and
    issues ``(code & mask) | one`` as one LOP3 (SASS LOP3 takes a single immediate: with 1.0 as
    a constant it issued an AND and an OR a code; qevict's d128 page loop: 731 instructions
    against 693, bench/decode_notes.md)."""
    return (small >> 30) | ONE_BITS


@triton.jit
def _magic_codes(code, BITS: tl.constexpr, one):
    """int32 codes (< 2**BITS) as the float32 1 + code / 2**BITS, from their bits: the code
    shifted under the exponent of 1.0 (``one``: its bits from :func:`_magic_one`)."""
    return ((code << (23 - BITS)) | one).to(tl.float32, bitcast=True)


@triton.jit
def _magic_consts(scale, lo, BITS: tl.constexpr):
    """(mul, add) float32 of the groups' scale and lo such that
    ``_magic_codes(code) * mul + add == code * scale + lo``: computed once a group, not a
    code."""
    mul = scale.to(tl.float32) * (1 << BITS)
    return mul, lo.to(tl.float32) - mul
