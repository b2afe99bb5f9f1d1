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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import codecs
from .layout import K_BITS, V_BITS, k_sections, unpack_pages, v_sections


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


_VIDX = torch.tensor([-1, -1, 0, -1, 1, -1, -1, -1, 2] + [-1] * 7 + [3])  # V width -> list
_KKEY = torch.tensor([4, -1, 0, -1, 1, -1, -1, -1, 2] + [-1] * 7 + [3])  # K width -> order


def _pad16(x: Tensor) -> Tensor:
    return (x + 15) // 16 * 16


def _k_layout(kb: Tensor, P: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per head (host, ``kb [H, d]``): ``perm [H, d]``, channel counts ``[H, 4]`` per width of
    :data:`K_BITS`, K section offsets ``[H, 7]`` (:func:`~.layout.k_sections`) and each
    permuted channel's rank among the channels of its width ``[H, d]``."""
    key = _KKEY[kb.long()]
    perm = torch.sort(key, dim=1, stable=True).indices
    onehot = key[..., None] == torch.arange(4)  # [H, d, 4]
    n = onehot.sum(1)  # [H, 4]
    sizes = _pad16(n * P * torch.tensor(K_BITS) // 8)
    o = torch.cumsum(sizes, 1)
    nq = _pad16(2 * n[:, :3].sum(1, keepdim=True))
    ks = torch.cat([o - sizes, o[:, 3:], o[:, 3:] + nq, o[:, 3:] + 2 * nq], 1)
    kp = torch.gather(key, 1, perm)  # width key of each permuted channel
    rank = torch.arange(kb.shape[1]) - torch.searchsorted(kp, kp, right=False)
    return perm, n, ks, rank


def _v_sizes(P: int, d: int, v_group: int) -> Tensor:
    """V part bytes per V width of :data:`V_BITS`."""
    return torch.tensor([v_sections(b, P, d, v_group)[3] for b in V_BITS])


_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _scatter(out: Tensor, base: Tensor, rows: Tensor, stride: int = 16) -> None:
    """``out[base[i] + j] = rows[i, j]`` (uint8 ``rows [M, n]``, host ``base [M]``, each a
    multiple of 16 plus a multiple of ``stride``), in the widest words that divide both ``n``
    and ``stride`` (a quarter of the index for 4-byte words)."""
    if not rows.numel():
        return
    w = next(w for w in _WORDS if rows.shape[1] % w == 0 and stride % w == 0)
    o, r = out.view(_WORDS[w]), rows.contiguous().view(_WORDS[w])
    dst = (base // w).to(out.device)[:, None] + torch.arange(r.shape[1], device=out.device)
    o[dst.flatten()] = r.reshape(-1)


def _bytes(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


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
    0/2/4/8/16); 16-bit sections hold ``raw_dtype``. One layer of :func:`pack_layers`."""
    return pack_layers(
        [k], [v], v_bits[None], k_bits[None], in_set[None], page_size=page_size,
        v_group=v_group, raw_dtype=raw_dtype,
    )[0]  # fmt: skip


def pack_layers(
    k: Sequence[Tensor],
    v: Sequence[Tensor],
    v_bits: Tensor,
    k_bits: Tensor,
    in_set: Tensor,
    *,
    page_size: int,
    v_group: int,
    raw_dtype: torch.dtype,
) -> list[ZoneA]:
    """:func:`pack` of ``L`` layers at once: ``k[l], v[l] [H, T, d]``, ``v_bits, in_set
    [L, H, T]``, ``k_bits [L, H, d]``.

    Batched over layers, heads and widths: the page lists are counted on the host in one read
    (``v_bits``, ``k_bits``, ``in_set`` are read there: pass host copies to keep the device
    unsynced); the bytes are gathered (two indexings a layer), quantized per width and
    scattered into one image on ``k``'s device, which the layers' zones view."""
    L, (H, T, d) = len(k), k[0].shape
    G, dev, P = L * H, k[0].device, page_size
    vb, sel = v_bits.cpu().long().reshape(G, T), in_set.cpu().bool().reshape(G, T)
    kb = k_bits.cpu().long().reshape(G, d)
    perm, n, ks, rank = _k_layout(kb, P)
    # tokens of each (row, V width) list, in position order: sort by list, then position
    vi = _VIDX[vb]
    key = torch.where(sel & (vi >= 0), torch.arange(G)[:, None] * 4 + vi, G * 4).flatten()
    order = torch.sort(key, stable=True).indices  # flat g * T + t, listed tokens first
    cnt = torch.bincount(key, minlength=G * 4 + 1)[: G * 4]
    npg = (cnt + P - 1) // P  # pages per list
    psz = (ks[:, 6:7] + _v_sizes(P, d, v_group)).flatten()  # page bytes per list
    per_layer = torch.stack([npg, npg * psz]).reshape(2, L, H * 4).sum(2)
    nums = torch.cat([per_layer.flatten(), n.flatten()]).tolist()  # the one host read
    pages_l, bytes_l, counts = nums[:L], nums[L : 2 * L], nums[2 * L :]
    # per page: its list, row, V width and byte offset; per row: the token (padding: the last)
    N = sum(pages_l)
    plist = torch.repeat_interleave(torch.arange(G * 4), npg)
    pfirst = torch.cumsum(npg, 0) - npg  # first page of each list
    tfirst = torch.cumsum(cnt, 0) - cnt  # first listed token of each list
    r = (torch.arange(N) - pfirst[plist])[:, None] * P + torch.arange(P)  # rank in its list
    c = cnt[plist][:, None]
    flat = order[tfirst[plist][:, None] + torch.minimum(r, c - 1)] if N else order[:0, None]
    page_tok = torch.where(r < c, flat % T, -1).reshape(N, P)
    ph, pv = plist // 4, plist % 4
    sizes = psz[plist]
    page_off = torch.cumsum(sizes, 0) - sizes
    out = torch.zeros(sum(bytes_l), dtype=torch.uint8, device=dev)
    if N:
        fl = (flat % (H * T)).to(dev)  # within its layer
        p0 = [0, *itertools.accumulate(pages_l)]
        spans = [(li, p0[li], p0[li + 1]) for li in range(L) if pages_l[li]]
        xk = torch.cat([k[li].reshape(-1, d)[fl[a:b]] for li, a, b in spans])
        xv = torch.cat([v[li].reshape(-1, d)[fl[a:b]] for li, a, b in spans])
        _fill(out, xk, xv, ph, pv, page_off, perm, kb, ks, rank, v_group, raw_dtype)
    k_table = torch.cat([n, ks, torch.zeros(G, 1, dtype=torch.long)], 1)
    k_table = k_table.repeat_interleave(4, 0).to(torch.int32).reshape(L, H * 4, 12)
    return _split(out, page_off, page_tok, npg.reshape(L, H, 4), k_table,
                  perm.reshape(L, H, d), counts, pages_l, bytes_l)  # fmt: skip


def _split(out, page_off, page_tok, pages, k_table, perm, counts, pages_l, bytes_l):
    """Each layer's zone: views of the layers' pages, offsets from its own first byte."""
    zones, p, b = [], 0, 0
    for li, (np_, nb) in enumerate(zip(pages_l, bytes_l, strict=True)):
        H = pages.shape[1]
        zones.append(ZoneA(
            img=out[b : b + nb], page_off=page_off[p : p + np_] - b,
            page_tok=page_tok[p : p + np_], pages=pages[li], k_table=k_table[li],
            perm=perm[li], k_counts=[counts[4 * (li * H + h) : 4 * (li * H + h) + 4]
                                    for h in range(H)],
        ))  # fmt: skip
        p, b = p + np_, b + nb
    return zones


def _fill(out, xk, xv, ph, pv, page_off, perm, kb, ks, rank, v_group, raw_dtype):
    """The bytes of pages ``xk, xv [N, P, d]`` (K channels in input order) of rows ``ph`` at
    V widths ``pv`` into ``out``: K per (page, channel) width, then V per page width."""
    N, P, d = xk.shape
    dev = xk.device
    pch = perm[ph]  # [N, d] original channel of each permuted one
    kt = torch.gather(xk, 2, pch.to(dev)[:, None, :].expand(N, P, d)).transpose(1, 2)
    kt = kt.reshape(N * d, P)  # rows (page, permuted channel), quantized along tokens
    kbp = torch.gather(kb, 1, perm)[ph].flatten()  # width of each row
    rk = rank[ph].flatten()
    base, hd = page_off.repeat_interleave(d), ph.repeat_interleave(d)  # per row
    n = torch.stack([(kb == b).sum(1) for b in K_BITS[:3]], 1)
    q_before = (torch.cumsum(n, 1) - n)[hd]  # quantized channels before each width's
    for j, b in enumerate(K_BITS):
        rows = (kbp == b).nonzero().squeeze(1)  # host: no device wait
        if not rows.numel():
            continue
        hh = hd[rows]
        at = base[rows] + ks[hh, j] + rk[rows] * (P * b // 8)
        x = kt[rows.to(dev)]
        if b == 16:
            _scatter(out, at, _bytes(x.to(raw_dtype)), P * b // 8)
            continue
        q = codecs.quantize(x, b, P)
        _scatter(out, at, q.codes, P * b // 8)
        pg = base[rows] + 2 * (q_before[rows, j] + rk[rows])
        _scatter(out, pg + ks[hh, 4], _bytes(q.scale), 2)
        _scatter(out, pg + ks[hh, 5], _bytes(q.lo), 2)
    vo = page_off + ks[ph, 6]
    for i, b in enumerate(V_BITS):
        pages = (pv == i).nonzero().squeeze(1)
        if not pages.numel():
            continue
        x = xv[pages.to(dev)]
        at = vo[pages]
        if b == 16:
            _scatter(out, at, _bytes(x.to(raw_dtype)))
            continue
        q = codecs.quantize(x, b, v_group)
        vs = v_sections(b, P, d, v_group)
        for o, t in ((vs[0], q.codes), (vs[1], q.scale), (vs[2], q.lo)):
            _scatter(out, at + o, _bytes(t))


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
