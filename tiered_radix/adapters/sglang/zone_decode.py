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

A routed request's own lists (its pages, K sections, channel orders and the kept tokens in no
page, every layer) are made once at its routing (:class:`~.zones.PageLists`); a step's lists
gather them and add each request's rows since, with sizes counted on the host: a fixed number of
device ops whatever the batch size and the layer count, and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.engine.routing import to_device
from tiered_radix.formats.layout import TriZoneLayout
from tiered_radix.kernels import decode

from .reps import FULL
from .trizone import DecodeBatch
from .zones import PageLists

BITS = (2, 4, 8, 16)


@dataclass
class ZoneLists:
    """One decode step's lists of every layer, layer-major with global offsets (as
    :class:`.trizone.Lists`): zone B ``full_ptr`` (list ``(l, b, h)``), ``slots``, ``units``;
    zone A ``page_ptr`` (list ``(l, b, h, V width)``) over every layer's pages ``page_off``
    (bytes in the layer's Zone A store), ``page_ntok``, ``page_units [n, P]``, ``page_unit``;
    per layer ``k_table [L, B * H * 4, 12]`` and ``perm [L, B * H, d]``. Units are
    ``h * n_max + t``. ``ahead``: each list's rows past the request's length (its last
    window's future rows), with ``lists(ahead=True)``. ``page_ptr_host``: ``page_ptr`` on the
    host (int64), so a layer's pages are sliced without reading the device."""

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
    page_ptr_host: Tensor | None = None

    def layer_pages(self, li: int, B: int, H: int) -> dict[str, Tensor]:
        """Layer ``li``'s zone A fields of a :class:`TriZoneLayout` (local offsets)."""
        first, last = li * B * H * 4, (li + 1) * B * H * 4
        ptr = self.page_ptr[first : last + 1]
        host = self.page_ptr if self.page_ptr_host is None else self.page_ptr_host
        lo, hi = int(host[first]), int(host[last])
        return dict(
            page_indptr=ptr - lo, page_off=self.page_off[lo:hi], page_ntok=self.page_ntok[lo:hi],
            page_units=self.page_units[lo:hi], page_unit=self.page_unit[lo:hi],
            page_ids=torch.arange(hi - lo, dtype=torch.int32, device=ptr.device),
            k_table=self.k_table[li], perm=self.perm[li],
        )  # fmt: skip


def _excl(x: Tensor) -> Tensor:
    """Exclusive cumulative sum along the last dim."""
    return x.cumsum(-1) - x


def _ptr(counts: Tensor) -> Tensor:
    """int64 ``[n + 1]`` offsets of ``counts`` (flattened) back to back."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.long)
    out[1:] = counts.flatten().cumsum(0)
    return out


def _segments(starts: Tensor, counts: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """For segments of ``counts[j]`` entries back to back (``total`` of them, device): each
    entry's segment ``j`` and ``starts[j]`` plus its rank within the segment."""
    seg = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                  output_size=total)  # fmt: skip
    rank = torch.arange(total, device=counts.device) - (counts.cumsum(0) - counts)[seg]
    return seg, starts[seg] + rank


@dataclass
class _Sizes:
    """A batch's list sizes and source offsets, on the host (int64): list ``(l, b, h)`` reads
    ``routed[l, b, h]`` rows of its request's routing (from ``routed_at`` among the batch's
    ``row_tok``), then every token from ``start[b]`` (the routing's end, 0 before one) to
    ``end[b]``; ``pages[l, b, h * 4 + w]`` pages, those of (``l``, ``b``) from ``pages_at[l, b]``
    among the batch's."""

    routed: Tensor
    routed_at: Tensor
    start: Tensor
    end: Tensor
    pages: Tensor
    pages_at: Tensor

    @staticmethod
    def of(got: list[PageLists | None], ends: list[int], L: int, H: int) -> _Sizes:
        none_rows = torch.zeros(L, H, dtype=torch.long)
        none_pages = torch.zeros(L, H * 4, dtype=torch.long)
        routed = torch.stack([none_rows if g is None else g.row_n for g in got], 1)  # [L, B, H]
        pages = torch.stack([none_pages if g is None else g.pages for g in got], 1)
        per_req = routed.transpose(0, 1).flatten(1)  # [B, L * H]
        at = _excl(per_req.sum(1))[:, None] + _excl(per_req)
        per = pages.sum(2)  # [L, B]
        return _Sizes(
            routed, at.view(-1, L, H).transpose(0, 1),
            torch.tensor([0 if g is None else g.n_tokens for g in got]), torch.tensor(ends),
            pages, _excl(per.sum(0))[None, :] + _excl(per.T).T,
        )  # fmt: skip


def lists(pool, rids: list[str], views, seqs: list[int], n_max: int | None = None,
          ahead: bool = False) -> ZoneLists:  # fmt: skip
    """:class:`ZoneLists` of decoupled requests ``rids`` with ``views`` and lengths ``seqs``;
    ``n_max`` (default: the longest request) numbers the units. ``ahead``: each request's
    last window lists all its ``W`` rows, the ones past ``seqs`` too (the next decode steps
    write there)."""
    L, H, W, dev = pool.layer_num, pool.head_num, pool.layout.window, pool.device
    B, T = len(views), n_max or max(seqs)
    got = [pool.zones.decode_lists(r) for r in rids]
    ends = [-(-s // W) * W if ahead else s for s in seqs]
    sz = _Sizes.of(got, ends, L, H)
    nwin = [v.windows.numel() for v in views]
    # entries of zone B and A (host values: no read of a tensor)
    n_rows = sum(L * H * (e - (0 if g is None else g.n_tokens)) + (0 if g is None else g.n_rows)
                 for g, e in zip(got, ends, strict=True))  # fmt: skip
    n_pages = sum(0 if g is None else g.n_pages for g in got)
    b, h = torch.arange(B)[None, :, None], torch.arange(H)[None, None, :]
    lh = torch.arange(L)[:, None, None] * H + h
    per_list = torch.stack([x.expand(L, B, H) for x in (
        sz.routed + (sz.end - sz.start)[b],  # rows listed
        sz.routed, sz.routed_at, sz.start[b],
        lh * sum(nwin) + _excl(torch.tensor(nwin))[b],  # where its windows' blocks start
        h * T,  # its units' base
        (sz.end - torch.tensor(seqs))[b],  # rows listed ahead
    )]).view(7, -1)  # fmt: skip
    full_ptr, page_ptr = _ptr(per_list[0]), _ptr(sz.pages)
    parts = [per_list, full_ptr, page_ptr, sz.pages.sum(2), sz.pages_at]
    meta = to_device(torch.cat([x.flatten() for x in parts]), dev)  # every size, one copy
    per_list_d, full_ptr_d, page_ptr_d, page_n, pages_at = meta.split([x.numel() for x in parts])
    rows, routed, routed_at, start, blk_at, unit_at, ahead_n = per_list_d.view(7, -1)
    slots, units = _rows(pool, got, views, rows, routed, routed_at, start, blk_at, unit_at,
                         n_rows)  # fmt: skip
    zone_a = _pages(pool, got, page_n, pages_at, n_pages, T)
    return ZoneLists(
        full_ptr_d.to(torch.int32), slots, units, page_ptr_d.to(torch.int32), *zone_a, [T] * B,
        T, ahead_n.to(torch.int32) if ahead else None, page_ptr,
    )  # fmt: skip


def _rows(pool, got, views, rows, routed, routed_at, start, blk_at, unit_at, total: int):
    """Zone B (``total`` entries): each list's routed rows (``routed`` of them from
    ``routed_at`` among the batch's ``row_tok``), then its tokens from ``start`` on; int32
    ``slots`` and ``units``."""
    W = pool.layout.window
    seg, rank = _segments(torch.zeros_like(rows), rows, total)
    mine = [g.row_tok for g in got if g is not None and g.row_tok.numel()]
    new = start[seg] + rank - routed[seg]  # a token after the routing
    if mine:
        src = torch.cat(mine) if len(mine) > 1 else mine[0]
        at = (routed_at[seg] + rank).clamp(max=src.numel() - 1)
        t = torch.where(rank < routed[seg], src[at], new)
    else:
        t = new
    win = torch.cat([v.windows for v in views]) if len(views) > 1 else views[0].windows
    blk = pool.block_all[:, FULL][:, :, win.long()].reshape(-1).long()  # [L, H, windows]
    slots = blk[blk_at[seg] + t // W] * W + t % W
    return slots.to(torch.int32), (unit_at[seg] + t).to(torch.int32)


def _pages(pool, got, page_n, pages_at, total: int, T: int):
    """Zone A (``total`` pages): the routed requests' pages, lists (l, b, h, V width), ``page_n``
    of (layer ``l``, request ``b``) from ``pages_at`` among the batch's; ``page_off``,
    ``page_ntok``, ``page_units``, ``page_unit``, ``k_table``, ``perm``."""
    L, H, d, dev = pool.layer_num, pool.head_num, pool.head_dim, pool.device
    mine = [g for g in got if g is not None]
    if mine:
        _, idx = _segments(pages_at, page_n, total)
        off, ntok, tok, head = (
            (getattr(mine[0], f) if len(mine) == 1 else torch.cat([getattr(g, f) for g in mine]))
            [idx] for f in ("off", "ntok", "tok", "head")
        )  # fmt: skip
    else:
        off, head = (torch.zeros(0, dtype=torch.long, device=dev) for _ in range(2))
        ntok = torch.zeros(0, dtype=torch.int32, device=dev)
        tok = torch.zeros(0, pool.layout.window, dtype=torch.long, device=dev)
    units = torch.where(tok >= 0, head[:, None] * T + tok, -1).to(torch.int32)
    valid = units >= 0
    lo = torch.where(valid, units, torch.iinfo(torch.int32).max).amin(1)
    hi = torch.where(valid, units, -1).amax(1)
    if len(mine) < len(got):  # a request not routed: no pages, every list empty
        table = torch.zeros(L, H * 4, 12, dtype=torch.int32, device=dev)
        perm = torch.arange(d, dtype=torch.int32, device=dev).expand(L, H, d)
    tables = [table if g is None else g.k_table for g in got]
    perms = [perm if g is None else g.perm for g in got]
    return (
        off, ntok, units, torch.where(lo == hi, lo, -1).to(torch.int32),
        torch.cat(tables, 1) if len(got) > 1 else tables[0],
        (torch.cat(perms, 1) if len(got) > 1 else perms[0]).contiguous(),
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
    fastest configuration that is right on sm_90; 128 registers, no spills under Triton 3.6, so
    4 programs an SM), codes dequantized without conversions (``dequant="magic"``: the same
    outputs bit for bit, 5-7% faster at batch 8-64 on an H100, 2% at batch 1;
    bench/results/gpu-run30-kernels/, bench/decode_notes.md)."""
    return decode.plan(
        lay, num_q_heads=num_q_heads, side_output=side_output, v_bits=BITS, k_bits=BITS,
        max_rows=max_rows, num_splits=splits, uniform_pages=False, k_path="blocks",
        max_regs=128, dequant="magic",
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
