"""The decode batch's TriZone lists over a decoupled (RDKV) pool, every layer at once.

A decoupled request reads, per (layer, head):

- zone A: its Zone A pages (:mod:`.zones`) after its routing, listed per V width with the
  request's K sections (``k_table``) and channel permutation (``perm``): the kernel's block
  path for general pages (pages of one V width, K channels grouped by width, read as dense
  blocks of one width);
- zone B: the rows of its windows (the pool's row blocks, as :mod:`.trizone` lists them) for
  every token in no page: all of them before its routing, the tokens written since (and kept
  tokens outside the channel set) after it;
- zone C stays empty.

Units for the side output are ``h * T + t`` (head ``h``, token ``t``, ``T`` the batch's longest
request): ``mass [B, H * T]`` is the attention mass per (head, token), the decode ``attn``
signal of token units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.formats.layout import TriZoneLayout
from tiered_radix.kernels import decode

from .reps import FULL
from .trizone import DecodeBatch, _indptr

BITS = (2, 4, 8, 16)


def _rows(pool, views, placed, ends: list[int], T: int):
    """Zone B of every layer: ``full_ptr`` (global offsets, list ``(l, b, h)``), ``slots`` and
    ``units`` of the rows before ``ends[b]`` in no page, and that mask."""
    L, H, W, dev = pool.layer_num, pool.head_num, pool.layout.window, pool.device
    B = len(views)
    T0, T = T, max(T, max(ends))  # rows listed ahead may pass the longest request
    N = -(-T // W)
    win = torch.zeros(B, N, dtype=torch.long, device=dev)
    for b, v in enumerate(views):
        win[b, : v.windows.numel()] = v.windows
    blk = pool.block_all[:, FULL][:, :, win].permute(0, 2, 1, 3).long()  # [L, B, H, N]
    t = torch.arange(T, device=dev)
    slot = blk[..., t // W] * W + t % W  # [L, B, H, T]
    read = (t < torch.tensor(ends, device=dev)[:, None])[None, :, None].expand(L, B, H, T).clone()
    for b, per_layer in enumerate(placed):
        if per_layer is not None:  # routed: tokens in pages (and evicted ones) are not rows
            m = per_layer[0].n_tokens
            read[:, b, :, :m] = torch.stack([p.lists.rows for p in per_layer])
    unit = (torch.arange(H, device=dev)[:, None] * T0 + t).expand(L, B, H, T)
    out = _indptr(read.sum(-1).flatten()), slot[read].to(torch.int32), unit[read].to(torch.int32)
    return (*out, read)


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
        page_units=units,
        page_unit=torch.where(lo == hi, lo, -1).to(torch.int32),
        page_indptr=_indptr(torch.cat(counts)),
        page_ids=torch.arange(n, dtype=torch.int32, device=dev),
        k_table=torch.cat(table),
        perm=torch.cat(perm).contiguous(),
    )


@dataclass
class ZoneLists:
    """One decode step's lists of every layer, layer-major with global offsets (as
    :class:`.trizone.Lists`): zone B ``full_ptr`` (list ``(l, b, h)``), ``slots``, ``units``;
    zone A ``page_ptr`` (list ``(l, b, h, V width)``) over every layer's pages ``page_off``
    (bytes in the layer's Zone A store), ``page_ntok``, ``page_units [n, P]``, ``page_unit``;
    per layer ``k_table [L, B * H * 4, 12]`` and ``perm [L, B * H, d]``. Units are
    ``h * n_max + t``. ``ahead``: each list's rows past the request's length (its last
    window's future rows), with ``lists(ahead=True)``."""

    full_ptr: Tensor
    slots: Tensor
    units: Tensor
    page_ptr: Tensor
    page_off: Tensor
    page_ntok: Tensor
    page_units: Tensor
    page_unit: Tensor
    k_table: Tensor
    perm: Tensor
    n: list[int]
    n_max: int
    ahead: Tensor | None = None

    def layer_pages(self, li: int, B: int, H: int) -> dict[str, Tensor]:
        """Layer ``li``'s zone A fields of a :class:`TriZoneLayout` (local offsets)."""
        ptr = self.page_ptr[li * B * H * 4 : (li + 1) * B * H * 4 + 1]
        lo, hi = int(ptr[0]), int(ptr[-1])
        return dict(
            page_indptr=ptr - lo, page_off=self.page_off[lo:hi], page_ntok=self.page_ntok[lo:hi],
            page_units=self.page_units[lo:hi], page_unit=self.page_unit[lo:hi],
            page_ids=torch.arange(hi - lo, dtype=torch.int32, device=ptr.device),
            k_table=self.k_table[li], perm=self.perm[li],
        )  # fmt: skip


def lists(pool, rids: list[str], views, seqs: list[int], n_max: int | None = None,
          ahead: bool = False) -> ZoneLists:  # fmt: skip
    """:class:`ZoneLists` of decoupled requests ``rids`` with ``views`` and lengths ``seqs``;
    ``n_max`` (default: the longest request) numbers the units. ``ahead``: each request's
    last window lists all its ``W`` rows, the ones past ``seqs`` too (the next decode steps
    write there)."""
    L, H, W = pool.layer_num, pool.head_num, pool.layout.window
    B, T = len(views), n_max or max(seqs)
    placed = [pool.zones.placed.get(r) for r in rids]
    ends = [-(-s // W) * W if ahead else s for s in seqs]
    full_ptr, slots, units, listed = _rows(pool, views, placed, ends, T)
    future = None
    if ahead:
        extra = torch.tensor([e - s for e, s in zip(ends, seqs, strict=True)], device=pool.device)
        future = extra[None, :, None].expand(L, B, H).flatten().to(torch.int32)
    layers = [_pages(pool, li, placed, T) for li in range(L)]
    ptrs, at = [], 0
    for lay in layers:
        ptrs.append(lay["page_indptr"][:-1] + at)
        at += lay["page_off"].numel()
    ptrs.append(torch.tensor([at], dtype=torch.int32, device=pool.device))
    cat = {k: torch.cat([lay[k] for lay in layers]) for k in
           ("page_off", "page_ntok", "page_units", "page_unit")}  # fmt: skip
    return ZoneLists(
        full_ptr, slots, units, torch.cat(ptrs).to(torch.int32), cat["page_off"],
        cat["page_ntok"], cat["page_units"], cat["page_unit"],
        torch.stack([lay["k_table"] for lay in layers]),
        torch.stack([lay["perm"] for lay in layers]), [T] * B, T, future,
    )  # fmt: skip


def layout(pool, li: int, batch: int, **zones) -> TriZoneLayout:
    """Layer ``li``'s TriZone view of a decoupled pool for ``batch`` requests with index lists
    ``zones`` (as :func:`.trizone.layout`'s, and ``max_units``): zone B the window rows, zone A
    the layer's Zone A store (the general page path), zone C empty."""
    H, W, d, dev = pool.head_num, pool.layout.window, pool.head_dim, pool.device
    rk, rv = pool.rows_k[li], pool.rows_v[li]
    shape, stride = (rk.shape[0] * W, H, d), (d, 0, 1)
    return TriZoneLayout(
        k_pool=rk.as_strided(shape, stride), v_pool=rv.as_strided(shape, stride),
        fresh_indptr=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
        fresh_slots=torch.zeros(0, dtype=torch.int32, device=dev),
        fresh_units=torch.zeros(0, dtype=torch.int32, device=dev),
        arena=pool.zones.bytes_all[li], batch=batch, num_kv_heads=H, head_dim=d, page_size=W,
        v_group=pool.v_group, v_bits_present=BITS, k_bits_present=BITS, k_uniform=False,
        bytes_kv=0, bytes_side=0, **zones,
    )  # fmt: skip


def plan(lay: TriZoneLayout, num_q_heads: int, side_output: bool, max_rows: int,
         splits: int | None) -> decode.DecodePlan:  # fmt: skip
    """The kernel's plan for decoupled layouts like ``lay``: every width, the general pages on
    Zone A's uniform path (``k_path="blocks"``: K widths as dense blocks of 32 channels, the
    fastest and right on the H200 in GPU run 17; 128 registers, no spills on sm_90 under Triton
    3.6, so 4 programs an SM; bench/decode_notes.md)."""
    return decode.plan(
        lay, num_q_heads=num_q_heads, side_output=side_output, v_bits=BITS, k_bits=BITS,
        max_rows=max_rows, num_splits=splits, uniform_pages=False, k_path="blocks",
        max_regs=128,
    )  # fmt: skip


def build(pool, rids: list[str], views, seqs: list[int], num_q_heads: int,
          side_output: bool = True, splits: int | None = None) -> DecodeBatch:  # fmt: skip
    """Index lists of every layer for decoupled requests ``rids`` with ``views`` and lengths
    ``seqs``; ``num_q_heads`` query heads. ``side_output``: the kernel accumulates each
    token's attention mass (``mass``, units ``h * T + t``; read with window 1)."""
    L, H, dev = pool.layer_num, pool.head_num, pool.device
    B, T = len(views), max(seqs)
    ls = lists(pool, rids, views, seqs)
    layouts = [
        layout(pool, li, B, full_indptr=ls.full_ptr[li * B * H : (li + 1) * B * H + 1],
               full_slots=ls.slots, full_units=ls.units, max_units=H * T,
               **ls.layer_pages(li, B, H))
        for li in range(L)
    ]  # fmt: skip
    most = max(layouts, key=lambda lay: lay.page_ntok.numel())  # the side output's rows
    p = plan(most, num_q_heads, side_output, T, splits)
    mass = torch.zeros(L, B, H * T, dtype=torch.float32, device=dev) if side_output else None
    return DecodeBatch(layouts, p, mass, [T] * B, T)
