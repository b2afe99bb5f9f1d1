"""The decode batch's TriZone lists over a decoupled (RDKV) pool, every layer at once.

A decoupled request reads, per (layer, head):

- zone A: its Zone A pages (:mod:`.zones`) after its routing, listed per V width with the
  request's K sections (``k_table``) and channel permutation (``perm``): the kernel's general
  page path (pages of one V width, K channels grouped by width);
- zone B: the rows of its windows (the pool's row blocks, as :mod:`.trizone` lists them) for
  every token in no page: all of them before its routing, the tokens written since (and kept
  tokens outside the channel set) after it;
- zone C stays empty.

Units for the side output are ``h * T + t`` (head ``h``, token ``t``, ``T`` the batch's longest
request): ``mass [B, H * T]`` is the attention mass per (head, token), the decode ``attn``
signal of token units.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tiered_radix.formats.layout import TriZoneLayout
from tiered_radix.kernels import decode

from .reps import FULL
from .trizone import DecodeBatch, _indptr

BITS = (2, 4, 8, 16)


def _rows(pool, views, placed, seqs: list[int], T: int):
    """Zone B of every layer: ``full_ptr`` (global offsets, list ``(l, b, h)``), ``slots`` and
    ``units``."""
    L, H, W, dev = pool.layer_num, pool.head_num, pool.layout.window, pool.device
    B, N = len(views), -(-T // W)
    win = torch.zeros(B, N, dtype=torch.long, device=dev)
    for b, v in enumerate(views):
        win[b, : v.windows.numel()] = v.windows
    blk = pool.block_all[:, FULL][:, :, win].permute(0, 2, 1, 3).long()  # [L, B, H, N]
    t = torch.arange(T, device=dev)
    slot = blk[..., t // W] * W + t % W  # [L, B, H, T]
    read = (t < torch.tensor(seqs, device=dev)[:, None])[None, :, None].expand(L, B, H, T).clone()
    for b, per_layer in enumerate(placed):
        if per_layer is not None:  # routed: tokens in pages (and evicted ones) are not rows
            m = per_layer[0].n_tokens
            read[:, b, :, :m] = torch.stack([p.lists.rows for p in per_layer])
    unit = (torch.arange(H, device=dev)[:, None] * T + t).expand(L, B, H, T)
    return _indptr(read.sum(-1).flatten()), slot[read].to(torch.int32), unit[read].to(torch.int32)


def _pages(pool, li: int, placed, T: int) -> dict[str, Tensor]:
    """Zone A of layer ``li``: the placed requests' pages, lists ``(b, h, V width)``."""
    H, d, dev = pool.head_num, pool.head_dim, pool.device
    P = pool.layout.window
    off, ntok, tok, counts, table, perm = [], [], [], [], [], []
    for per_layer in placed:
        if per_layer is None:  # not routed: no pages, every list empty
            counts.append(torch.zeros(H * 4, dtype=torch.long, device=dev))
            table.append(torch.zeros(H * 4, 12, dtype=torch.int32, device=dev))
            perm.append(torch.arange(d, dtype=torch.int32, device=dev).expand(H, d))
            continue
        ls = per_layer[li].lists
        off.append(ls.off)
        ntok.append(ls.ntok)
        head = torch.repeat_interleave(torch.arange(H, device=dev), ls.counts.view(H, 4).sum(1),
                                       output_size=ls.off.numel())  # fmt: skip
        tok.append(torch.where(ls.tok >= 0, head[:, None] * T + ls.tok, -1))
        counts.append(ls.counts)
        table.append(ls.k_table)
        perm.append(ls.perm)
    n = sum(x.numel() for x in off)
    units = torch.cat(tok).to(torch.int32) if tok else torch.zeros(0, P, dtype=torch.int32,
                                                                    device=dev)  # fmt: skip
    valid = units >= 0
    lo = torch.where(valid, units, torch.iinfo(torch.int32).max).amin(1)
    hi = torch.where(valid, units, -1).amax(1)
    return dict(
        page_off=torch.cat(off) if off else torch.zeros(0, dtype=torch.long, device=dev),
        page_ntok=torch.cat(ntok) if ntok else torch.zeros(0, dtype=torch.int32, device=dev),
        page_units=units, page_unit=torch.where(lo == hi, lo, -1).to(torch.int32),
        page_indptr=_indptr(torch.cat(counts)),
        page_ids=torch.arange(n, dtype=torch.int32, device=dev),
        k_table=torch.cat(table), perm=torch.cat(perm).contiguous(),
    )


def build(pool, rids: list[str], views, seqs: list[int], num_q_heads: int,
          side_output: bool = True, splits: int | None = None) -> DecodeBatch:  # fmt: skip
    """Index lists of every layer for decoupled requests ``rids`` with ``views`` and lengths
    ``seqs``; ``num_q_heads`` query heads. ``side_output``: the kernel accumulates each
    token's attention mass (``mass``, units ``h * T + t``; read with window 1)."""
    L, H, W, d, dev = pool.layer_num, pool.head_num, pool.layout.window, pool.head_dim, pool.device
    B, T = len(views), max(seqs)
    placed = [pool.zones.placed.get(r) for r in rids]
    full_ptr, slots, units = _rows(pool, views, placed, seqs, T)
    layouts = []
    for li in range(L):
        rk, rv = pool.rows_k[li], pool.rows_v[li]
        shape, stride = (rk.shape[0] * W, H, d), (d, 0, 1)
        pages = _pages(pool, li, placed, T)
        present = tuple(BITS) if pages["page_off"].numel() else ()
        layouts.append(TriZoneLayout(
            k_pool=rk.as_strided(shape, stride), v_pool=rv.as_strided(shape, stride),
            full_indptr=full_ptr[li * B * H : (li + 1) * B * H + 1], full_slots=slots,
            full_units=units, fresh_indptr=torch.zeros(B + 1, dtype=torch.int32, device=dev),
            fresh_slots=torch.zeros(0, dtype=torch.int32, device=dev),
            fresh_units=torch.zeros(0, dtype=torch.int32, device=dev),
            arena=pool.zones.bytes_all[li], batch=B, num_kv_heads=H, head_dim=d, page_size=W,
            v_group=pool.v_group, max_units=H * T, v_bits_present=present,
            k_bits_present=present, k_uniform=False, bytes_kv=0, bytes_side=0, **pages,
        ))  # fmt: skip
    most = max(layouts, key=lambda lay: lay.page_ntok.numel())  # the side output's rows
    plan = decode.plan(
        most, num_q_heads=num_q_heads, side_output=side_output, v_bits=BITS,
        k_bits=BITS, max_rows=T, num_splits=splits, uniform_pages=False,
    )  # fmt: skip
    mass = torch.zeros(L, B, H * T, dtype=torch.float32, device=dev) if side_output else None
    return DecodeBatch(layouts, plan, mass, [T] * B, T)
