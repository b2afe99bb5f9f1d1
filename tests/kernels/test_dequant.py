"""The decode kernels' dequantisation without conversions (kernels/_dequant.py): the "magic"
float of a code is exactly 1 + code / 2**bits, and it gives code * scale + lo as the kernels'
conversion does, to float32 rounding of the rescaled offset, for every code of each width and
fp16 scales of any size."""

from __future__ import annotations

import pytest
import torch
from triton_guard import CUDA, require_triton  # noqa: E402

require_triton()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from tiered_radix.kernels._dequant import _magic_codes, _magic_consts, _magic_one  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


@triton.jit
def _dequant_kernel(code_ptr, sc_ptr, lo_ptr, f_ptr, x_ptr, small, BITS: tl.constexpr,
                    MAGIC: tl.constexpr, G: tl.constexpr, N: tl.constexpr):  # fmt: skip
    g = tl.arange(0, G)
    n = tl.arange(0, N)
    code = tl.load(code_ptr + n)
    sc = tl.load(sc_ptr + g).to(tl.float32)
    lo = tl.load(lo_ptr + g).to(tl.float32)
    if MAGIC:
        f = _magic_codes(code, BITS, _magic_one(small))
        sc, lo = _magic_consts(sc, lo, BITS)
    else:  # the kernels' convert lines
        f = code.to(tl.float32)
    tl.store(f_ptr + n, f)
    tl.store(x_ptr + g[:, None] * N + n[None, :], f[None, :] * sc[:, None] + lo[:, None])


def _dequant(code, sc, lo, bits, magic):
    g, n = sc.numel(), code.numel()
    f = torch.empty(n, device=DEV)
    x = torch.empty(g, n, device=DEV)
    _dequant_kernel[(1,)](code, sc, lo, f, x, 7, BITS=bits, MAGIC=magic, G=g, N=n)
    return f, x


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_magic_codes_equal_the_conversion(bits):
    """Every code of the width, against scales from 2**-14 to 2**10 and offsets of either sign."""
    code = torch.arange(1 << bits, dtype=torch.int32, device=DEV).repeat(max(1, 16 >> bits))
    gen = torch.Generator().manual_seed(bits)
    sc = torch.exp2(torch.randint(-14, 11, (16,), generator=gen).float())
    sc = (sc * (1 + torch.rand(16, generator=gen))).half().to(DEV)
    lo = (torch.randn(16, generator=gen) * 100).half().to(DEV)
    f_conv, x_conv = _dequant(code, sc, lo, bits, False)
    f_magic, x_magic = _dequant(code, sc, lo, bits, True)
    torch.testing.assert_close(f_conv, code.float(), atol=0, rtol=0)
    torch.testing.assert_close(f_magic, 1 + code.float() / (1 << bits), atol=0, rtol=0)
    exact = code.double()[None, :] * sc.double()[:, None] + lo.double()[:, None]
    # convert: one FMA rounding; magic: that, and the rescaled offset's float32 rounding
    span = (lo.double().abs() + sc.double() * (1 << bits))[:, None]
    assert ((x_conv.double() - exact).abs() <= 2.0**-24 * exact.abs()).all()
    assert ((x_magic.double() - exact).abs() <= 2.0**-24 * (exact.abs() + span)).all()
