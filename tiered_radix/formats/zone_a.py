"""Zone A of one request's layer: a decoupled (RDKV) routing's result as TriZone pages.

Every kept token of the channel set (its V width ``vb`` in 2/4/8/16) goes to the pages of its
head and V width, in position order, ``P`` tokens a page (the last page padded with the width's
last token, an edge value: it changes neither min nor max). K channels are permuted per head
so equal widths are contiguous (:func:`~.layout.pack_pages`; dropped channels last, never
stored). These are the groups the engine's :class:`~tiered_radix.engine.decoupled.ChannelK`
quantizes K over (``group = P``), so a packed page holds the engine's codes bit for bit.

Pages are ordered head-major, then by V width in :data:`~.layout.V_BITS` order: the decode
kernel's list ``(h, vb)`` is a contiguous run of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import K_BITS, V_BITS, k_sections, pack_pages, unpack_pages, v_sections

_ORDER = {2: 0, 4: 1, 8: 2, 16: 3, 0: 4}  # K widths in page order, dropped channels last


@dataclass(frozen=True)
class ZoneA:
    """One request's layer in pages.

    img: uint8 ``[nbytes]``, the pages back to back (each a multiple of 16 bytes);
    page_off: int64 ``[n_pages]`` byte offset of each page in ``img``;
    page_tok: int64 ``[n_pages, P]`` token position of each page row, -1 for padding;
    pages: int64 ``[H, 4]`` pages per (head, V width in ``V_BITS`` order);
    k_table: int32 ``[H * 4, 12]`` the kernel's K sections per (head, V width) list;
    perm: int64 ``[H, d]`` original channel at each permuted position;
    k_counts: per head, channels per width of ``K_BITS``.
    """

    img: Tensor
    page_off: Tensor
    page_tok: Tensor
    pages: Tensor
    k_table: Tensor
    perm: Tensor
    k_counts: list[list[int]]

    @property
    def nbytes(self) -> int:
        return self.img.numel()


def _perm(kb: Tensor) -> tuple[Tensor, list[int]]:
    key = torch.tensor([_ORDER[int(b)] for b in kb.tolist()])
    return torch.sort(key, stable=True).indices, [int((kb == b).sum()) for b in K_BITS]


def pack(
    k: Tensor,
    v: Tensor,
    v_bits: Tensor,
    k_bits: Tensor,
    in_set: Tensor,
    *,
    page_size: int,
    v_group: int,
    raw_dtype: torch.dtype,
) -> ZoneA:
    """Pages of the tokens ``in_set`` (bool ``[H, T]``) of K/V ``[H, T, d]`` (any float dtype)
    at V widths ``v_bits [H, T]`` and K channel widths ``k_bits [H, d]`` (both in
    0/2/4/8/16); 16-bit sections hold ``raw_dtype``."""
    H, T, d = k.shape
    dev, P = k.device, page_size
    imgs, offs, toks, table, perms, counts = [], [], [], [], [], []
    pages = torch.zeros(H, len(V_BITS), dtype=torch.long)
    off = 0
    vb_cpu, set_cpu = v_bits.cpu(), in_set.cpu()
    for h in range(H):
        perm, n = _perm(k_bits[h].cpu())
        perms.append(perm)
        counts.append(n)
        kh = k[h][:, perm.to(dev)]
        for i, vb in enumerate(V_BITS):
            table.append(n + k_sections(n, P) + [0])
            tp = ((vb_cpu[h] == vb) & set_cpu[h]).nonzero().squeeze(1)
            npg = -(-tp.numel() // P)
            if not npg:
                continue
            idx = torch.cat([tp, tp[-1:].expand(npg * P - tp.numel())])
            xk = kh[idx.to(dev)].reshape(npg, P, d)
            xv = v[h][idx.to(dev)].reshape(npg, P, d)
            img = pack_pages(xk, xv, n, vb, v_group, raw_dtype)
            imgs.append(img.reshape(-1))
            offs += [off + j * img.shape[1] for j in range(npg)]
            off += img.numel()
            pt = torch.full((npg * P,), -1, dtype=torch.long)
            pt[: tp.numel()] = tp
            toks.append(pt.view(npg, P))
            pages[h, i] = npg
    return ZoneA(
        img=torch.cat(imgs) if imgs else torch.zeros(0, dtype=torch.uint8, device=dev),
        page_off=torch.tensor(offs, dtype=torch.long),
        page_tok=torch.cat(toks) if toks else torch.zeros(0, P, dtype=torch.long),
        pages=pages,
        k_table=torch.tensor(table, dtype=torch.int32),
        perm=torch.stack(perms),
        k_counts=counts,
    )


def unpack(
    zone: ZoneA,
    img: Tensor,
    n_tokens: int,
    *,
    page_size: int,
    v_group: int,
    raw_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """What the pages hold (``img``: ``zone``'s bytes, wherever they now live): float32
    ``k, v [H, n_tokens, d]`` (dropped K channels 0, tokens in no page NaN) and ``listed`` bool
    ``[H, n_tokens]``, the tokens some page holds."""
    H, d = zone.perm.shape
    dev = img.device
    k = torch.full((H, n_tokens, d), torch.nan, device=dev)
    v = torch.full_like(k, torch.nan)
    listed = torch.zeros(H, n_tokens, dtype=torch.bool, device=dev)
    first = 0
    flat = zone.pages.flatten().tolist()
    for j, npg in enumerate(flat):
        if not npg:
            continue
        h, vb = divmod(j, len(V_BITS))
        vb = V_BITS[vb]
        at = zone.page_off[first : first + npg]
        n = zone.k_counts[h]
        size = k_sections(n, page_size)[6] + v_sections(vb, page_size, d, v_group)[3]
        rows = img[(at[:, None] + torch.arange(size)).to(dev)]
        kp, vp = unpack_pages(rows, n, vb, page_size, d, v_group, raw_dtype)
        tok = zone.page_tok[first : first + npg].flatten()
        ok = (tok >= 0).to(dev)
        t = tok.to(dev)[ok]
        kk = torch.zeros_like(kp).flatten(0, 1)
        kk[:, zone.perm[h].to(dev)] = kp.flatten(0, 1)
        k[h, t], v[h, t] = kk[ok], vp.flatten(0, 1)[ok]
        listed[h, t] = True
        first += npg
    return k, v, listed
