"""The pool's ledger pages through the fused quantize kernel equal the PyTorch codec's pages
byte for byte (``adapters.sglang.pages.pack_pages`` against ``formats.layout.
pack_uniform_pages``), NaN rows included. On CPU under ``TRITON_INTERPRET=1``, on CUDA at
larger sizes."""

from __future__ import annotations

import pytest
import torch
from triton_guard import CUDA, require_triton  # noqa: E402

require_triton()

from tiered_radix.adapters.sglang.pages import pack_pages  # noqa: E402
from tiered_radix.formats.layout import pack_uniform_pages, unpack_uniform_pages  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("p", "d", "v_group"), [(32, 64, 32), (16, 128, 64)])
def test_fused_pages_equal_the_codec_pages(bits: int, p: int, d: int, v_group: int):
    g = torch.Generator().manual_seed(bits * p + d)
    n = 300 if CUDA else 5
    scale = torch.exp(2 * torch.randn(n, 1, 1, generator=g))
    k = (torch.randn(n, p, d, generator=g) * scale).bfloat16().float().to(DEVICE)
    v = (torch.randn(n, p, d, generator=g) * scale + 1).bfloat16().float().to(DEVICE)
    k[0, 3, 5] = torch.nan  # a poisoned row reads as NaN: codes of 0, as the codec does
    v[-1] = torch.nan
    want = pack_uniform_pages(k, v, bits, v_group)
    got = pack_pages(k, v, bits, v_group, fused=True)
    assert got.shape == want.shape and torch.equal(got, want)
    kk, vv = unpack_uniform_pages(got, bits, p, d, v_group)
    assert kk.shape == (n, p, d) and torch.isfinite(kk).all() and torch.isfinite(vv).all()
