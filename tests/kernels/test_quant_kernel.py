"""Triton quantize_pack / dequantize_unpack against the engine codec (the plain-PyTorch twin).

Codes, scales and lows must be bit-identical to ``tiered_radix.formats.codecs.quantize``;
dequantized values may differ by the rounding of a fused multiply-add (tolerances below).
On CPU the kernels run under ``TRITON_INTERPRET=1`` at small sizes; on CUDA at larger ones.
"""

from __future__ import annotations

import pytest
import torch
from triton_guard import CUDA, require_triton  # noqa: E402

require_triton()

from tiered_radix.kernels.quant import dequantize_unpack, quantize_pack  # noqa: E402

from tiered_radix.formats import codecs  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# (shape, group): K windows [n_windows * heads, d, window] grouped along tokens; V rows
# [tokens, d] grouped along d; a group count that is not a power of two; a non-power-of-two group.
LAYOUTS = (
    [((4096, 128, 32), 32), ((8192, 128), 32), ((1000, 96), 32), ((777, 3, 48), 24)]
    if CUDA
    else [((6, 64, 32), 32), ((40, 128), 32), ((9, 96), 32), ((5, 3, 48), 24)]
)
# Dequantization: the kernel may fuse code * scale + lo into one FMA, one rounding fewer than
# the engine; allow 2 ulp of the output dtype relative to the larger operand.
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows with very different spreads and offsets (never all zeros)."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp(2 * torch.randn(*shape[:-1], 1, generator=gen))
    offset = 3 * torch.randn(*shape[:-1], 1, generator=gen)
    x = torch.randn(*shape, generator=gen) * spread + offset
    return x.to(dtype).to(DEVICE)


def _poisoned(like: codecs.QuantizedTensor) -> codecs.QuantizedTensor:
    """An output whose every byte differs from the expected one, and NaN metadata."""
    return codecs.QuantizedTensor(
        codes=like.codes ^ 0xFF,
        scale=torch.full_like(like.scale, float("nan")),
        lo=torch.full_like(like.lo, float("nan")),
        bits=like.bits,
        group=like.group,
        n=like.n,
    )


def _assert_same_codes(got: codecs.QuantizedTensor, want: codecs.QuantizedTensor) -> None:
    assert (got.bits, got.group, got.n) == (want.bits, want.group, want.n)
    assert got.codes.dtype == torch.uint8 and got.codes.shape == want.codes.shape
    mismatches = (got.codes != want.codes).sum().item()
    assert mismatches == 0, f"{mismatches} packed bytes differ"
    assert torch.equal(got.scale.view(torch.int16), want.scale.view(torch.int16))
    assert torch.equal(got.lo.view(torch.int16), want.lo.view(torch.int16))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay[0]}g{lay[1]}")
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_quantize_pack_is_bit_exact(layout, dtype, bits):
    shape, group = layout
    x = _data(shape, dtype, seed=sum(shape) * 10 + bits + FLOATS.index(dtype))
    want = codecs.quantize(x, bits, group)
    _assert_same_codes(quantize_pack(x, bits=bits, group=group), want)
    _assert_same_codes(quantize_pack(x, bits=bits, group=group, out=_poisoned(want)), want)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_special_values_match_engine(dtype, bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 64, generator=gen)
    x[0, 3], x[0, 40], x[0, 41] = float("nan"), float("inf"), float("-inf")
    x[1, :32] = 3.5  # constant group: scale 0 -> 1.0
    x[1, 32:] = 1000 + 1e-4 * x[1, 32:]  # lo16 rounds far from lo: codes saturate
    x[2, :32] = 1e6 + x[2, :32]  # beyond fp16: lo16 = +inf (bf16/fp32), inf -> 65504 (fp16)
    x[2, 32:] = -1e6 + x[2, 32:]
    x[3] *= 1e-6  # subnormal or zero fp16 scale
    x[4] = -7.25  # whole row constant and negative
    x[5, ::2] = float("inf")
    x = x.to(dtype).to(DEVICE)
    want = codecs.quantize(x, bits, 32)
    _assert_same_codes(quantize_pack(x, bits=bits, group=32, out=_poisoned(want)), want)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda lay: f"{lay[0]}g{lay[1]}")
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_dequantize_unpack_matches_engine(layout, out_dtype, bits):
    shape, group = layout
    x = _data(shape, torch.float32, seed=bits * 7 + len(shape))
    q = codecs.quantize(x, bits, group)
    want = codecs.dequantize(q, out_dtype)
    poison = torch.full(want.shape, float("nan"), dtype=out_dtype, device=DEVICE)
    got = dequantize_unpack(q, dtype=out_dtype, out=poison)
    assert got.data_ptr() == poison.data_ptr()
    operands = q.lo.float().abs() + q.scale.float() * (2**bits - 1)
    atol = 2 * ULP[out_dtype] * operands.max().item()
    torch.testing.assert_close(got, want, rtol=2 * ULP[out_dtype], atol=atol)
    torch.testing.assert_close(dequantize_unpack(q, dtype=out_dtype), want, rtol=0, atol=atol)


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_round_trip_error_is_half_a_step(bits):
    x = _data(LAYOUTS[0][0], torch.float32, seed=100 + bits)
    q = quantize_pack(x, bits=bits, group=32)
    err = (dequantize_unpack(q, dtype=torch.float32) - x).unflatten(-1, (-1, 32)).abs()
    # |x - x_hat| <= scale / 2 plus the fp16 rounding of lo (half an fp16 ulp of |lo|).
    bound = q.scale.float() / 2 + q.lo.float().abs() * 2.0**-11 + 1e-6
    assert (err.amax(-1) <= bound).all()


def test_empty_rows_and_nbytes():
    x = _data((0, 64), torch.float16, seed=1)
    q = quantize_pack(x, bits=4, group=32)
    assert q.codes.shape == (0, 32) and q.scale.shape == (0, 2)
    assert dequantize_unpack(q, dtype=torch.float16).shape == (0, 64)
    x = _data((3, 64), torch.float16, seed=2)
    assert quantize_pack(x, bits=2, group=32).nbytes == codecs.quantized_nbytes(192, 2, 32)


def test_launcher_rejects_bad_input():
    x = _data((4, 64), torch.float16, seed=3)
    with pytest.raises(codecs.CodecError, match="bits"):
        quantize_pack(x, bits=3, group=32)
    with pytest.raises(codecs.CodecError, match="multiple of group"):
        quantize_pack(x, bits=4, group=48)
    with pytest.raises(codecs.CodecError, match="straddles"):
        quantize_pack(x[:, :62].contiguous(), bits=2, group=2)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_pack(x.t(), bits=4, group=4)
    with pytest.raises(TypeError, match="float16"):
        quantize_pack(x.to(torch.int32), bits=4, group=32)
    with pytest.raises(TypeError):
        quantize_pack(x, 4, 32)  # options are keyword-only
    q = quantize_pack(x, bits=4, group=32)
    with pytest.raises(ValueError, match="out.codes"):
        quantize_pack(x, bits=4, group=32, out=quantize_pack(x[:2], bits=4, group=32))
    with pytest.raises(ValueError, match="out is"):
        dequantize_unpack(q, dtype=torch.float16, out=torch.empty(4, 64, device=DEVICE))


def test_any_row_count_launches_one_compiled_variant():
    """A routing quantizes a different number of windows each time; the row count is not part
    of the compiled key (tests/kernels/jit_variants.py), in either direction."""
    from jit_variants import JitVariants

    with JitVariants() as v:
        for m in (1, 2, 3, 16, 17, 40):
            q = quantize_pack(_data((m, 64, 32), torch.bfloat16, m), bits=2, group=32)
            dequantize_unpack(q, dtype=torch.bfloat16)
    for name in ("_quantize_pack_kernel", "_dequantize_unpack_kernel"):
        assert len(v.specs[name]) == 6
        assert len(v.keys[name]) == 1, v.varying(name)
