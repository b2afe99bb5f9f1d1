"""Codec contract tests: analytic error bound, a numpy reference, exact packing, byte accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tiered_radix.formats.codecs import (
    CodecError,
    dequantize,
    pack,
    quantize,
    quantized_nbytes,
    unit_nbytes,
    unpack,
)

EPS32 = float(np.finfo(np.float32).eps)


def sample(dist: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if dist == "heavy":  # Cauchy, kept inside the fp16 range
        u = torch.rand(shape, generator=g)
        x = torch.tan(torch.pi * (u - 0.5)).clamp(-6e4, 6e4)
    elif dist == "outliers":
        mask = torch.rand(shape, generator=g) < 0.02
        x = torch.where(mask, x * 300.0, x)
    elif dist == "offset":  # large common offset: lo16 rounding dominates
        x = 1000.0 + 0.01 * x
    return x


def error_bound(x: torch.Tensor, q) -> torch.Tensor:
    """Per-element bound on |x - x_hat| from float64 group statistics of the sanitised input.

    scale16/2 (rounding) + |lo - lo16| (offset rounding) + qmax * max(0, scale - scale16)
    (top-of-range clamp when scale rounded down) + a few float32 ulps of the arithmetic.
    """
    qmax = 2**q.bits - 1
    xs = torch.nan_to_num(x.double(), nan=0.0, posinf=65504.0, neginf=-65504.0)
    xg = xs.reshape(*x.shape[:-1], -1, q.group)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    s16, lo16 = q.scale.double().unsqueeze(-1), q.lo.double().unsqueeze(-1)
    bound = s16 / 2 + (lo - lo16).abs() + qmax * ((hi - lo) / qmax - s16).clamp(min=0)
    bound = bound + 4 * EPS32 * (xg.abs() + lo16.abs() + qmax * s16)
    return bound.reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dist", ["normal", "heavy", "outliers", "offset"])
@pytest.mark.parametrize(
    "shape,group", [((64,), 32), ((3, 5, 128), 64), ((7, 48), 16), ((2, 8), 8)]
)
def test_roundtrip_within_analytic_bound(bits, dist, shape, group):
    x = sample(dist, shape, seed=bits * 100 + len(shape) + group)
    q = quantize(x, bits, group)
    x_hat = dequantize(q)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    err = (x.double() - x_hat.double()).abs()
    assert torch.all(err <= error_bound(x, q)), float((err - error_bound(x, q)).max())
    # The bound is not vacuous: the error is a fraction of the group range.
    assert err.max() > 0


def reference_codes(x: np.ndarray, bits: int, group: int):
    """Per-group loop in numpy float32, written from the contract text."""
    qmax = 2**bits - 1
    rows = np.nan_to_num(x.astype(np.float32), nan=0.0, posinf=65504.0, neginf=-65504.0)
    rows = rows.reshape(-1, x.shape[-1])
    codes = np.zeros(rows.shape, np.uint8)
    scales, los = [], []
    for r, row in enumerate(rows):
        for g0 in range(0, row.size, group):
            xg = row[g0 : g0 + group]
            lo, hi = xg.min(), xg.max()
            s16 = np.float16(np.float32(hi - lo) / np.float32(qmax))
            if s16 == 0 or not np.isfinite(s16):
                s16 = np.float16(1.0)
            lo16 = np.float16(lo)
            t = (xg - np.float32(lo16)) / np.float32(s16)
            codes[r, g0 : g0 + group] = np.clip(np.round(t), 0, qmax).astype(np.uint8)
            scales.append(s16)
            los.append(lo16)
    return codes.reshape(x.shape), np.array(scales), np.array(los)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dist", ["normal", "outliers", "offset"])
def test_codes_and_metadata_match_numpy_reference(bits, dist):
    x = sample(dist, (4, 96), seed=bits)
    x[0, :32] = 3.0  # constant group
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    q = quantize(x, bits, 32)
    codes, scales, los = reference_codes(x.numpy(), bits, 32)
    assert np.array_equal(unpack(q.codes, bits, 96).numpy(), codes)
    assert np.array_equal(q.scale.numpy().ravel(), scales)
    assert np.array_equal(q.lo.numpy().ravel(), los)


def test_pack_layout_by_hand():
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 3, 3]], dtype=torch.uint8)
    # first code in the lowest bits: 1 | 2<<2 | 3<<4 | 0<<6 = 57; 3 | 3<<2 | 3<<4 | 3<<6 = 255
    assert pack(codes, 2).tolist() == [[57, 255]]
    assert pack(torch.tensor([[0xA, 0x5]], dtype=torch.uint8), 4).tolist() == [[0x5A]]
    assert unpack(torch.tensor([[0x5A]], dtype=torch.uint8), 4, 2).tolist() == [[0xA, 0x5]]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_exact_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 4, 64), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 4, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits, 64), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_nbytes_accounting(bits):
    x = sample("normal", (4, 128), seed=1)
    q = quantize(x, bits, 32)
    codes_bytes, meta_bytes = 4 * 128 * bits // 8, 4 * (128 // 32) * 2 * 2
    assert q.codes.numel() == codes_bytes
    assert q.scale.shape == q.lo.shape == (4, 4)
    assert q.scale.dtype == q.lo.dtype == torch.float16
    assert q.nbytes == codes_bytes + meta_bytes == quantized_nbytes(512, bits, 32)
    assert unit_nbytes(512, bits, 32) == q.nbytes
    assert unit_nbytes(512, 16, 32) == 1024 and unit_nbytes(512, 0, 32) == 0


def test_degenerate_groups():
    x = torch.tensor(
        [
            [0.0] * 8 + [2.5] * 8,  # all-zero group, constant group (exact in fp16)
            [float("nan")] + [1.0] * 7 + [float("inf"), -float("inf")] + [0.5] * 6,
            [-float("inf")] * 8 + [float("nan")] * 8,
        ]
    )
    for bits in (2, 4, 8):
        q = quantize(x, bits, 8)
        x_hat = dequantize(q)
        assert not torch.isnan(x_hat).any()
        assert torch.equal(x_hat[0], x[0])  # constant groups reconstruct exactly
        assert not torch.isnan(q.scale).any() and torch.all(q.scale > 0)
        assert torch.all(x_hat[2, 8:] == 0)  # nan -> 0, a constant group
        finite = torch.isfinite(x[1])
        err = (x_hat[1] - torch.nan_to_num(x[1], nan=0.0)).abs()[finite]
        assert torch.all(err <= error_bound(x, q)[1][finite])


def test_low_precision_inputs_and_output_dtype():
    x = sample("normal", (2, 64), seed=3)
    for dt in (torch.float16, torch.bfloat16):
        q = quantize(x.to(dt), 4, 32)
        assert torch.equal(q.codes, quantize(x.to(dt).float(), 4, 32).codes)
        assert dequantize(q, dt).dtype == dt


@pytest.mark.parametrize(
    "bits,shape,group", [(3, (8,), 8), (4, (12,), 8), (2, (6,), 6), (8, (8,), 0)]
)
def test_invalid_arguments_raise(bits, shape, group):
    with pytest.raises(CodecError):
        quantize(torch.ones(shape), bits, group)


def test_unpack_rejects_wrong_length():
    with pytest.raises(CodecError, match="packed must be uint8"):
        unpack(torch.zeros(3, dtype=torch.uint8), 2, 8)


@settings(max_examples=60, deadline=None)
@given(
    x=arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([8, 16, 32]))),
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([4, 8]),
)
def test_property_no_nan_and_bound_inside_fp16_range(x, bits, group):
    xt = torch.from_numpy(x)
    q = quantize(xt, bits, group)
    x_hat = dequantize(q)
    assert x_hat.shape == xt.shape and not torch.isnan(x_hat).any()
    assert torch.all(unpack(q.codes, bits, xt.shape[-1]).int() < 2**bits)
    # The error bound holds wherever the group's sanitised values lie in the fp16 range.
    xs = torch.nan_to_num(xt, nan=0.0, posinf=65504.0, neginf=-65504.0)
    in_range = (xs.abs() <= 65504).reshape(*xs.shape[:-1], -1, group).all(-1, keepdim=True)
    in_range = in_range.expand(*in_range.shape[:-1], group).reshape(xs.shape)
    err = (xs.double() - x_hat.double()).abs()
    assert torch.all((err <= error_bound(xt, q)) | ~in_range)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gpu_matches_cpu(bits):
    x = sample("outliers", (16, 256), seed=bits)
    q_cpu, q_gpu = quantize(x, bits, 64), quantize(x.cuda(), bits, 64)
    assert torch.equal(q_gpu.codes.cpu(), q_cpu.codes)
    assert torch.equal(q_gpu.scale.cpu(), q_cpu.scale) and torch.equal(q_gpu.lo.cpu(), q_cpu.lo)
    assert torch.allclose(dequantize(q_gpu).cpu(), dequantize(q_cpu), rtol=0, atol=1e-5)
