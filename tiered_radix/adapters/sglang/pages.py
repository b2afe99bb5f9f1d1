"""Ledger pages of the pool written in one batched quantize: the fused Triton ``quantize_pack``
(two launches for every window a routing demotes, K and V) laid out as the TriZone uniform page
that :func:`~tiered_radix.formats.layout.pack_uniform_pages` builds with the PyTorch codec, byte
for byte (the kernel's codes, scales and lows equal the codec's)."""

from __future__ import annotations

import torch
from torch import Tensor

from tiered_radix.formats.layout import K_BITS, k_sections, pack_uniform_pages, v_sections


def pack_pages(k: Tensor, v: Tensor, bits: int, v_group: int, *, fused: bool | None = None):
    """uint8 ``[n, page_bytes]``: K/V ``[n, P, d]`` (float) as TriZone pages at ``bits``, equal
    to ``pack_uniform_pages(k, v, bits, v_group)``. ``fused`` (default: on CUDA) quantizes
    through ``kernels.quant.quantize_pack`` (``TRITON_INTERPRET=1`` runs it on CPU tensors)."""
    n, p, d = k.shape
    if fused is None:
        fused = k.device.type == "cuda"
    if not fused or p % (8 // bits) or v_group % (8 // bits):
        return pack_uniform_pages(k, v, bits, v_group)
    from tiered_radix.kernels.quant import quantize_pack

    ks = k_sections([d if b == bits else 0 for b in K_BITS], p)
    vs = v_sections(bits, p, d, v_group)
    out = torch.zeros(n, ks[6] + vs[3], dtype=torch.uint8, device=k.device)
    kq = quantize_pack(k.transpose(1, 2).contiguous(), bits=bits, group=p)  # per channel
    vq = quantize_pack(v.contiguous(), bits=bits, group=v_group)  # per token
    vo = ks[6]
    parts = ((ks[K_BITS.index(bits)], kq.codes), (ks[4], kq.scale), (ks[5], kq.lo),
             (vo + vs[0], vq.codes), (vo + vs[1], vq.scale), (vo + vs[2], vq.lo))  # fmt: skip
    for o, t in parts:
        raw = t.reshape(n, -1).view(torch.uint8)
        out[:, o : o + raw.shape[1]] = raw
    return out
