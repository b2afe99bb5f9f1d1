"""The pool's Zone A store: decoupled (RDKV) requests' private pages after their routing.

A decoupled request's tokens are full rows in the pool's windows (shared with the radix tree
like any window) until its first routing. There the engine decides V widths per token and K
widths per channel, and the request's layers are *repacked* into Zone A pages
(:mod:`tiered_radix.formats.zone_a`) held here, privately: nobody else reads them. After the
routing the request reads its pages, and the rows of tokens outside them (written since, or
kept full by a rule); a later routing repacks again from what the request reads then. The
windows its pages cover whole it reads no row of: the tree may cache them at full precision
until new tokens need their rows (:meth:`.pool.TieredKVPool._unrow_paged`).

Storage: one uint8 byte store per layer, ``[nbytes]``; each (request, layer) holds one extent
(16-byte aligned: pages keep the kernel's alignment), first fit, freed extents merged with their
neighbours. A request's extents are freed when its view closes (finished, aborted, retracted).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.formats import zone_a


class ZoneFullError(RuntimeError):
    """The Zone A store has no extent large enough for a request's repacked layer."""


class Extents:
    """Free byte ranges of one layer's store, first fit, in 16-byte units."""

    def __init__(self, nbytes: int) -> None:
        self.free: list[tuple[int, int]] = [(0, nbytes // 16)] if nbytes >= 16 else []
        self.used = 0

    def take(self, nbytes: int) -> int | None:
        """A byte offset of ``nbytes`` free bytes (taken), or None."""
        n = -(-nbytes // 16)
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                self.free[i : i + 1] = [(off + n, size - n)] if size > n else []
                self.used += n
                return off * 16
        return None

    def give(self, offset: int, nbytes: int) -> None:
        off, n = offset // 16, -(-nbytes // 16)
        i = bisect.bisect(self.free, (off, 0))
        self.free.insert(i, (off, n))
        self.used -= n
        if i + 1 < len(self.free) and off + n == self.free[i + 1][0]:  # merge the next one
            self.free[i] = (off, n + self.free.pop(i + 1)[1])
        if i and self.free[i - 1][0] + self.free[i - 1][1] == off:  # and the previous one
            prev = self.free.pop(i - 1)
            self.free[i - 1] = (prev[0], prev[1] + self.free[i - 1][1])

    @property
    def used_bytes(self) -> int:
        return 16 * self.used


@dataclass(frozen=True)
class PageLists:
    """A placed request's decode lists of every layer, built once at its routing (the decode
    batch's lists are gathered from them: :mod:`.zone_decode`). Pages, layer-major and within
    a layer by (head, V width) as :class:`~tiered_radix.formats.zone_a.ZoneA` orders them (device
    tensors): ``off`` int64 ``[n]`` byte offsets in the layer's store, ``ntok`` int32 ``[n]``
    valid tokens, ``tok`` int64 ``[n, P]`` token positions (-1 padding), ``head`` int64 ``[n]``;
    per layer ``k_table`` int32 ``[L, H * 4, 12]`` and ``perm`` int32 ``[L, H, d]``. Rows: the
    kept tokens in no page (read from the window rows), ``row_tok`` int64 ``[R]`` their
    positions per (layer, head) in position order. Host int64: ``pages [L, H * 4]`` pages per
    (layer, head, V width) and ``row_n [L, H]`` rows per (layer, head): the batch's list sizes,
    known without reading the device (``n_pages``, ``n_rows`` their sums); ``n_tokens`` the
    tokens the routing covered (those after it are rows)."""

    n_tokens: int
    n_pages: int
    n_rows: int
    off: Tensor
    ntok: Tensor
    tok: Tensor
    head: Tensor
    k_table: Tensor
    perm: Tensor
    row_tok: Tensor
    pages: Tensor
    row_n: Tensor


@dataclass(frozen=True)
class Placed:
    """One request's repacked layer: its pages (``zone``, offsets relative to ``base``), where
    they start in the layer's store, the tokens it covered (``n_tokens``; ``kept [H, n]``:
    those not evicted)."""

    zone: zone_a.ZoneA
    base: int
    n_tokens: int
    kept: Tensor


def _lists(zones: list[zone_a.ZoneA], offs: list[int], n_tokens: int, kept: Tensor,
           dev) -> PageLists:  # fmt: skip
    """Every placed layer's decode lists, built at once on the host (``kept [L, H, n]`` host
    bool: the page lists and decisions are host tensors) and copied to the device once per
    field."""
    L, H = len(zones), zones[0].perm.shape[0]
    pages = torch.stack([z.pages for z in zones])  # [L, H, 4]
    per_layer = torch.tensor([z.page_off.numel() for z in zones])
    base = torch.repeat_interleave(torch.tensor(offs, dtype=torch.long), per_layer)
    off = torch.cat([z.page_off for z in zones]) + base
    tok = torch.cat([z.page_tok for z in zones])
    row = torch.repeat_interleave(torch.arange(L * H), pages.sum(2).flatten())  # l * H + h
    in_page = torch.zeros(L * H, n_tokens + 1, dtype=torch.bool)
    in_page[row[:, None].expand_as(tok), torch.where(tok >= 0, tok, n_tokens)] = True
    rows = kept & ~in_page[:, :n_tokens].reshape(L, H, n_tokens)
    row_tok = rows.nonzero()[:, 2]
    return PageLists(
        n_tokens=n_tokens, n_pages=off.numel(), n_rows=row_tok.numel(), off=off.to(dev),
        ntok=(tok >= 0).sum(1).to(device=dev, dtype=torch.int32), tok=tok.to(dev),
        head=(row % H).to(dev),
        k_table=torch.stack([z.k_table for z in zones]).to(dev),
        perm=torch.stack([z.perm for z in zones]).to(device=dev, dtype=torch.int32),
        row_tok=row_tok.to(dev), pages=pages.reshape(L, H * 4),
        row_n=rows.sum(2),
    )  # fmt: skip


class ZoneStore:
    """Per layer ``bytes_all[l]`` (uint8 ``[nbytes]``) and the requests' placed layers.

    ``page_size`` tokens a page, V groups of ``v_group`` values, 16-bit sections in ``dtype``.
    """

    def __init__(self, layers: int, nbytes: int, page_size: int, v_group: int,
                 dtype: torch.dtype, device) -> None:  # fmt: skip
        self.nbytes = -(-max(nbytes, 16) // 16) * 16
        self.bytes_all = torch.zeros(layers, self.nbytes, dtype=torch.uint8, device=device)
        self.extents = [Extents(self.nbytes) for _ in range(layers)]
        self.page_size, self.v_group, self.dtype = page_size, v_group, dtype
        self.placed: dict[str, list[Placed | None]] = {}
        self.lists: dict[str, PageLists] = {}  # placed requests' decode lists
        self.layers = layers

    def holds(self, rid: str) -> bool:
        return rid in self.placed

    def placed_layer(self, rid: str, li: int) -> Placed | None:
        got = self.placed.get(rid)
        return None if got is None else got[li]

    def placed_layers(self, rid: str) -> list[Placed] | None:
        """Request ``rid``'s placed layers, or None (no pages placed)."""
        return self.placed.get(rid)

    def decode_lists(self, rid: str) -> PageLists | None:
        """Request ``rid``'s decode lists of every layer, or None (no pages placed)."""
        return self.lists.get(rid)

    def put(self, rid: str, zones: list[zone_a.ZoneA], n_tokens: int, kept: list[Tensor]) -> None:
        """Place request ``rid``'s repacked layers (replacing what it held); ``kept[l] [H, n]``
        its tokens not evicted (host tensors: its decode lists are counted on the host).

        Raises:
            ZoneFullError: a layer's store has no room (what the request held is kept).
        """
        offs = []
        for li, z in enumerate(zones):
            off = self.extents[li].take(z.nbytes) if z.nbytes else 0
            if off is None:
                for lj, o in enumerate(offs):
                    if zones[lj].nbytes:
                        self.extents[lj].give(o, zones[lj].nbytes)
                raise ZoneFullError(
                    f"the Zone A store of layer {li} has no {z.nbytes} free bytes "
                    f"({self.nbytes - self.extents[li].used_bytes} of {self.nbytes} free, "
                    "fragmented); raise the budget or lower the load"
                )
            offs.append(off)
        self.drop(rid)
        for li, (z, off) in enumerate(zip(zones, offs, strict=True)):
            if z.nbytes:
                self.bytes_all[li, off : off + z.nbytes] = z.img.to(self.bytes_all.device)
        dev = self.bytes_all.device
        if not zones:
            self.placed[rid] = []
            return
        kept_all = torch.stack(kept).bool()
        self.lists[rid] = _lists(zones, offs, n_tokens, kept_all.cpu(), dev)
        on_dev = kept_all.to(dev)
        self.placed[rid] = [
            Placed(z, off, n_tokens, on_dev[li])
            for li, (z, off) in enumerate(zip(zones, offs, strict=True))
        ]

    def drop(self, rid: str) -> None:
        """Free request ``rid``'s pages (nothing if it holds none)."""
        self.lists.pop(rid, None)
        for li, p in enumerate(self.placed.pop(rid, None) or []):
            if p is not None and p.zone.nbytes:
                self.extents[li].give(p.base, p.zone.nbytes)

    def clear(self) -> None:
        for rid in list(self.placed):
            self.drop(rid)

    def read(self, rid: str, li: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Request ``rid``'s layer ``li`` as its pages hold it: float32 ``k, v [H, n, d]``,
        ``listed [H, n]`` (tokens in a page) and ``kept [H, n]`` (``n`` tokens repacked)."""
        p = self.placed[rid][li]
        k, v, listed = zone_a.unpack(
            p.zone, self.bytes_all[li, p.base :], p.n_tokens, page_size=self.page_size,
            v_group=self.v_group, raw_dtype=self.dtype,
        )  # fmt: skip
        return k, v, listed, p.kept

    def bytes_used(self) -> int:
        return sum(e.used_bytes for e in self.extents)
