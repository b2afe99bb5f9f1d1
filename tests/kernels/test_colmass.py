"""column_mass (Triton) and its torch twin against a dense float64 softmax; channel norms.

On CPU the kernels run under ``TRITON_INTERPRET=1`` at small sizes; on CUDA at larger ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_guard import CUDA, require_triton  # noqa: E402

require_triton()

from tiered_radix.kernels.colmass import column_mass  # noqa: E402
from tiered_radix.kernels.colmass_ref import (  # noqa: E402
    channel_norms,
    channel_weights,
    column_mass_ref,
)

DEVICE = "cuda" if CUDA else "cpu"
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_T = 1500 if CUDA else 64  # keys per case; the dense reference holds Hq * Tq * Tk doubles
# Relative to the total mass Tq * Hq: fp32 accumulation of scores and exp2 sums.
RTOL, ATOL_PER_ROW = 2e-3, 1e-6


def dense_column_mass(q, k, scale, causal, q_offset):
    """The definition, in float64 with a full [Hq, Tq, Tk] softmax."""
    q, k = q.double(), k.double()
    (tq, hq, _), (tk, hkv, _) = q.shape, k.shape
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(hq // hkv, dim=1)) * scale
    if causal:
        pos = q_offset + torch.arange(tq, device=q.device)
        s = s.masked_fill(torch.arange(tk, device=q.device)[None] > pos[:, None], -math.inf)
    return s.softmax(-1).sum(1).view(hkv, hq // hkv, tk).sum(1)


def _case(seed, tq, tk, hkv, g, d, dtype, q_gain=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = q_gain * torch.randn(tq, hkv * g, d, generator=gen)
    k = 2 * torch.randn(tk, hkv, d, generator=gen) + 0.5 * torch.randn(1, hkv, d, generator=gen)
    return q.to(dtype).to(DEVICE), k.to(dtype).to(DEVICE)


def _check(got, q, k, scale, causal, q_offset):
    want = dense_column_mass(q, k, scale, causal, q_offset)
    assert got.dtype == torch.float32 and got.shape == want.shape
    total = q.shape[0] * q.shape[1]
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL_PER_ROW * total)
    assert abs(got.double().sum().item() - total) <= 1e-4 * total  # every row sums to one


@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("g", (1, 4, 7))
@pytest.mark.parametrize("d", (64, 128))
def test_column_mass_matches_dense(d, g, dtype, causal):
    seed = d + 10 * g + 100 * FLOATS.index(dtype) + 1000 * causal
    gen = torch.Generator().manual_seed(seed)
    tk = int(torch.randint(MAX_T // 3, MAX_T, (), generator=gen))
    tq = int(torch.randint(1, tk + 1, (), generator=gen))
    hkv = 1 + seed % 2
    q, k = _case(seed, tq, tk, hkv, g, d, dtype, q_gain=1.0 + seed % 3)  # peaky softmax too
    got = column_mass(q, k, scale=d**-0.5, causal=causal)
    _check(got, q, k, d**-0.5, causal, tk - tq)


@pytest.mark.parametrize("q_offset", (0, 17, 60))
def test_explicit_q_offset_and_strided_inputs(q_offset):
    tq, tk, hkv, g, d = 40, 70, 2, 4, 64
    qkv, _ = _case(q_offset, tk, tq, 1, hkv * (g + 2), d, torch.float16)
    q = qkv[:tq, : hkv * g]  # a view into a fused qkv projection: strided rows
    k = qkv[:, hkv * g : hkv * (g + 1)].transpose(0, 1).contiguous().transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous()
    got = column_mass(q, k, scale=0.2, causal=True, q_offset=q_offset)
    _check(got, q, k, 0.2, True, q_offset)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_torch_twin_matches_dense_in_small_chunks(dtype, causal):
    q, k = _case(5, 33, 51, 2, 7, 64, dtype, q_gain=2.0)
    got = column_mass_ref(q, k, scale=0.125, causal=causal, chunk_elems=14 * 51 * 4)
    _check(got, q, k, 0.125, causal, 51 - 33)


def test_default_scale_and_empty_queries():
    q, k = _case(6, 20, 30, 1, 4, 64, torch.float16)
    torch.testing.assert_close(column_mass(q, k), column_mass(q, k, scale=0.125))
    empty = column_mass(q[:0], k, scale=0.125)
    assert empty.shape == (1, 30) and not empty.any()


def test_column_mass_rejects_bad_input():
    q, k = _case(7, 8, 16, 2, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        column_mass(q[:, :3], k, scale=0.1)
    with pytest.raises(ValueError, match="head dims"):
        column_mass(q[..., :32], k, scale=0.1)
    with pytest.raises(TypeError, match="dtype"):
        column_mass(q.float(), k, scale=0.1)
    with pytest.raises(ValueError, match="q_offset"):
        column_mass(q, k, scale=0.1, q_offset=-1)
    with pytest.raises(TypeError):
        column_mass(q, k, 0.1)  # options are keyword-only


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("g", (1, 4, 7))
def test_channel_norms_and_weights(g, dtype):
    q, k = _case(8 + g, 25, 40, 2, g, 128, dtype)
    qn, kn = channel_norms(q, k)
    q64, k64 = q.double().unflatten(1, (2, g)), k.double()
    want_qn = q64.pow(2).sum(dim=(0, 2)).sqrt()
    want_kn = k64.pow(2).sum(dim=0).sqrt()
    assert qn.dtype == kn.dtype == torch.float32 and qn.shape == kn.shape == (2, 128)
    torch.testing.assert_close(qn.double(), want_qn, rtol=1e-5, atol=0)
    torch.testing.assert_close(kn.double(), want_kn, rtol=1e-5, atol=0)
    w = channel_weights(q, k)
    torch.testing.assert_close(w.double(), want_qn * want_kn / math.sqrt(128), rtol=2e-5, atol=0)
