"""Plain-PyTorch twin of the TriZone decode kernel (``tiered_radix.kernels.decode``).

Reads the same layout (``tiered_radix.formats.layout``), dequantizes every page with the engine
codec, and computes decode attention and the attention-mass side output in float32.
"""

from __future__ import annotations

import torch

from tiered_radix.formats import codecs
from tiered_radix.formats.layout import K_BITS, V_BITS, TriZoneLayout, k_sections, v_sections


def _view(arena: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    return arena[start : start + nbytes].view(dtype)


def _page(layout: TriZoneLayout, pid: int, li: int, vb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized (K in permuted channel order, V) of one page, float32 [ntok, d] each."""
    p, d, g, a = layout.page_size, layout.head_dim, layout.v_group, layout.arena
    n = layout.k_table[li, :4].tolist()
    ks = k_sections(n, p)
    base, ntok = int(layout.page_off[pid]), int(layout.page_ntok[pid])
    nq = sum(n[:3])
    scale = _view(a, base + ks[4], 2 * nq, torch.float16).reshape(nq, 1)
    lo = _view(a, base + ks[5], 2 * nq, torch.float16).reshape(nq, 1)
    segs, c0 = [], 0
    for i, (cnt, b) in enumerate(zip(n, K_BITS, strict=True)):
        if cnt and b == 16:
            segs.append(_view(a, base + ks[i], cnt * p * 2, layout.dtype).reshape(cnt, p).float())
        elif cnt:
            codes = a[base + ks[i] : base + ks[i] + cnt * p * b // 8].reshape(cnt, -1)
            qt = codecs.QuantizedTensor(codes, scale[c0 : c0 + cnt], lo[c0 : c0 + cnt], b, p, p)
            segs.append(codecs.dequantize(qt))
            c0 += cnt
    k = torch.cat(segs + [torch.zeros(d - sum(n), p, device=a.device)]).T
    vo, vs = base + ks[6], v_sections(vb, p, d, g)
    if vb == 16:
        v = _view(a, vo, p * d * 2, layout.dtype).reshape(p, d).float()
    else:
        codes = a[vo : vo + p * d * vb // 8].reshape(p, -1)
        sc = _view(a, vo + vs[1], 2 * p * d // g, torch.float16).reshape(p, -1)
        lo_v = _view(a, vo + vs[2], 2 * p * d // g, torch.float16).reshape(p, -1)
        v = codecs.dequantize(codecs.QuantizedTensor(codes, sc, lo_v, vb, g, d))
    return k[:ntok], v[:ntok]


def gather_head(layout: TriZoneLayout, r: int, h: int):
    """All rows attended by (request r, KV head h): K, V float32 [n, d] (natural channel order)
    and their side-output units int64 [n]."""
    hkv = layout.num_kv_heads
    rh = r * hkv + h
    ks, vs, us = [], [], []
    perm = layout.perm[rh].long()
    for vi, vb in enumerate(V_BITS):
        li = rh * 4 + vi
        for i in range(int(layout.page_indptr[li]), int(layout.page_indptr[li + 1])):
            pid = int(layout.page_ids[i])
            kp, vp = _page(layout, pid, li, vb)
            knat = torch.empty_like(kp)
            knat[:, perm] = kp
            ks.append(knat)
            vs.append(vp)
            us.append(layout.page_units[pid, : kp.shape[0]].long())
    for start, end, slots, units in (
        (layout.full_indptr[rh], layout.full_ends[rh], layout.full_slots, layout.full_units),
        (layout.fresh_indptr[r], layout.fresh_indptr[r + 1], layout.fresh_slots,
         layout.fresh_units),
    ):  # fmt: skip
        sl = slots[int(start) : int(end)].long()
        ks.append(layout.k_pool[sl, h].float())
        vs.append(layout.v_pool[sl, h].float())
        us.append(units[int(start) : int(end)].long())
    return torch.cat(ks), torch.cat(vs), torch.cat(us)


def decode_attention_ref(
    q: torch.Tensor, layout: TriZoneLayout, *, sm_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q ``[B, H_q, d]`` over the layout, in float32.

    Returns (out float32 ``[B, H_q, d]``, mass float32 ``[B, max_units]``: each unit's attention
    probability summed over the query heads of its KV group and over the KV heads).
    """
    bsz, hq, d = q.shape
    hkv = layout.num_kv_heads
    grp = hq // hkv
    scale = sm_scale if sm_scale is not None else d**-0.5
    out = torch.zeros(bsz, hq, d, device=q.device)
    mass = torch.zeros(bsz, layout.max_units, device=q.device)
    for r in range(bsz):
        for h in range(hkv):
            k, v, u = gather_head(layout, r, h)
            qg = q[r, h * grp : (h + 1) * grp].float()
            p = torch.softmax(qg @ k.T * scale, dim=-1)
            out[r, h * grp : (h + 1) * grp] = p @ v
            mass[r].index_add_(0, u, p.sum(0))
    return out, mass
