"""Quantized copies of units, one store per (layer, quantized tier): the write-once ledger.

A copy of unit ``u`` of KV head ``h`` at quantized tier ``j`` holds K and V of the unit's tokens
as :class:`~tiered_radix.formats.codecs.QuantizedTensor` rows. How each part is laid out
(:class:`PartCodec`):

- ``along_tokens=True`` (K under ``axis=kivi``/``channel`` for windows): per channel, groups of
  ``min(group, W)`` along the unit's ``W`` tokens (KIVI's per-channel K).
- ``along_tokens=False`` (V under ``kivi``/``token``; K of *token* units, whose per-channel
  groups would need several tokens): per token, groups of ``min(group, d)`` along ``d``.

Ledger modes (the store decides when to call what):

- ``write_once``: a unit is quantized into tier ``j`` the first time it enters ``j`` (from its
  original full rows when it leaves the full tier) and that copy is kept until the unit is
  evicted; later moves into ``j`` reuse it, promotion restores exactly ``dequantize(copy)``.
  ``write_count[h, u]`` counts writes; :meth:`CopyStore.write` refuses a second one.
- no ledger: a copy lives only while its unit is in the tier; leaving drops it.

Storage is dense ``[*lead, capacity, ...]`` per tier with a ``present`` mask, ``lead`` being
``[H]`` (one layer) or ``[L, H]`` (every layer of a store, so one routing step moves all layers'
units with a few index ops); byte accounting uses ``present`` and :attr:`CopyStore.unit_nbytes`,
i.e. what a packed pool would hold. On CUDA, encoding uses the fused Triton
``quantize_pack`` kernel when it supports the group (bit-identical to
:mod:`~tiered_radix.formats.codecs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.formats import codecs

from .growth import grown


def _quantize(x: Tensor, bits: int, group: int) -> codecs.QuantizedTensor:
    if x.device.type == "cuda" and group % (8 // bits) == 0:
        try:
            from tiered_radix.kernels.quant import quantize_pack
        except ImportError:  # no Triton: the codec gives the same codes
            pass
        else:
            return quantize_pack(x.contiguous(), bits=bits, group=group)
    return codecs.quantize(x, bits, group)


class LedgerError(RuntimeError):
    """A write-once copy was about to be written a second time (an engine bug)."""


def zero_padded(x: Tensor, extra: tuple[int, ...], dim: int) -> Tensor:
    """``x`` followed along ``dim`` by zeros of shape ``extra`` (just the zeros when ``x`` is
    empty: a new store's first reservation copies nothing)."""
    pad = x.new_zeros(extra)
    return pad if x.shape[dim] == 0 else torch.cat([x, pad], dim)


@dataclass(frozen=True)
class PartCodec:
    """How one part (K or V) of a ``[W, d]`` unit is quantized."""

    bits: int
    group: int
    along_tokens: bool

    def encode(self, x: Tensor) -> codecs.QuantizedTensor:
        """``x[n, W, d]`` -> codes over ``[n, d, W]`` (along tokens) or ``[n, W, d]``."""
        return _quantize(x.transpose(-1, -2) if self.along_tokens else x, self.bits, self.group)

    def decode(self, q: codecs.QuantizedTensor) -> Tensor:
        """-> float32 ``[..., W, d]``."""
        x = codecs.dequantize(q)
        return x.transpose(-1, -2) if self.along_tokens else x

    def nbytes(self, window: int, head_dim: int) -> int:
        return codecs.quantized_nbytes(window * head_dim, self.bits, self.group)


def part_codecs(
    bits: int, group: int, axis: str, window: int, head_dim: int
) -> tuple[PartCodec, PartCodec]:
    """(K, V) codecs of a ``quantize(bits, group, axis)`` tier for units of ``window`` tokens."""

    def make(along: bool) -> PartCodec:
        along = along and window > 1
        return PartCodec(bits, min(group, window if along else head_dim), along)

    k_along = axis in ("kivi", "channel")
    return make(k_along), make(axis == "channel")


class CopyStore:
    """Copies of one quantized tier's units, for one layer (``n_layers=None``: masks
    ``[H, U]``) or all layers (masks ``[L, H, U]``). ``parts`` maps "k"/"v" to codecs.
    ``keep_data=False`` keeps the masks and byte counts only (the codes live elsewhere, e.g. in
    the SGLang pool): writes mark units present, reads return no parts."""

    def __init__(
        self,
        parts: dict[str, PartCodec],
        n_heads: int,
        window: int,
        head_dim: int,
        device: torch.device,
        write_once: bool,
        *,
        n_layers: int | None = None,
        keep_data: bool = True,
        units: int = 1,
    ) -> None:
        """``units``: room reserved up front (units per head)."""
        self.parts, self.window, self.head_dim = parts, window, head_dim
        self.keep_data = keep_data
        self.n_heads, self.device, self.write_once = n_heads, device, write_once
        self.lead = (n_heads,) if n_layers is None else (n_layers, n_heads)
        self.unit_nbytes = sum(c.nbytes(window, head_dim) for c in parts.values())
        self.capacity, self._fixed = 0, False
        self.present = torch.empty(*self.lead, 0, dtype=torch.bool, device=device)
        self.write_count = torch.empty(*self.lead, 0, dtype=torch.int32, device=device)
        self.data: dict[str, list[Tensor]] = {}
        self.grow(units)

    def layer(self, li: int) -> CopyStore:
        """The copies of layer ``li`` of an all-layers store: a ``[H, U]`` store sharing its
        tensors (valid until the all-layers store grows)."""
        assert len(self.lead) == 2
        out = object.__new__(CopyStore)
        out.__dict__.update(self.__dict__)
        out.lead, out._fixed = self.lead[1:], True
        out.present, out.write_count = self.present[li], self.write_count[li]
        out.data = {name: [t[li] for t in ts] for name, ts in self.data.items()}
        return out

    def grow(self, n_units: int) -> None:
        if n_units <= self.capacity:
            return
        assert not self._fixed, "a per-layer view cannot grow; grow the all-layers store"
        cap = grown(self.capacity, n_units)
        extra = (*self.lead, cap - self.capacity)
        w, d, dim = self.window, self.head_dim, len(self.lead)
        self.present = zero_padded(self.present, extra, dim)
        self.write_count = zero_padded(self.write_count, extra, dim)
        for name, c in self.parts.items() if self.keep_data else ():
            q = c.encode(torch.zeros(1, w, d, device=self.device))  # shapes of one unit
            new = [t.new_zeros(*extra, *t.shape[1:]) for t in (q.codes, q.scale, q.lo)]
            old = self.data.get(name)
            self.data[name] = (
                new if old is None else [torch.cat(p, dim) for p in zip(old, new, strict=True)]
            )
        self.capacity = cap

    # -- masks over [*lead, U] ---------------------------------------------------------------
    def write(self, mask: Tensor, blocks: dict[str, Tensor]) -> None:
        """Quantize ``blocks[part][*lead, U, W, d]`` into the units where ``mask[*lead, U]``.

        Raises:
            LedgerError: write-once mode and one of these units already has a copy.
        """
        u = mask.shape[-1]
        self.grow(u)
        if self.write_once and bool((self.write_count[..., :u][mask] > 0).any()):
            raise LedgerError("write-once ledger entry written twice")
        idx = self.flat_index(mask.flatten().nonzero()[:, 0], u)
        self.write_at(idx, {p: b[mask] for p, b in blocks.items()})

    def read(self, n_units: int) -> dict[str, Tensor]:
        """float32 ``[*lead, U, W, d]`` per part: ``dequantize(copy)`` (garbage where absent)."""
        self.grow(n_units)
        return {
            name: self._decode(
                name, [t.narrow(len(self.lead), 0, n_units) for t in self.data[name]]
            )
            for name in self.data
        }

    def drop(self, mask: Tensor) -> None:
        """Forget the copies of the units where ``mask[*lead, U]`` is True (the count stays)."""
        self.grow(mask.shape[-1])
        self.present[..., : mask.shape[-1]] &= ~mask

    def held(self, n_units: int) -> Tensor:
        """bool ``[*lead, U]``."""
        self.grow(n_units)
        return self.present[..., :n_units]

    def nbytes(self) -> int:
        return int(self.present.sum()) * self.unit_nbytes

    # -- flat unit indices (no host sync) ----------------------------------------------------
    def flat_index(self, idx: Tensor, n_units: int) -> Tensor:
        """Positions ``idx`` in a flattened ``[*lead, n_units]`` -> in ``[*lead, capacity]``."""
        return idx // n_units * self.capacity + idx % n_units

    def write_at(self, idx: Tensor, blocks: dict[str, Tensor]) -> None:
        """Quantize ``blocks[part][n, W, d]`` into the units at flat indices ``idx[n]`` (see
        :meth:`flat_index`; distinct). The caller checks write-once."""
        for name, c in self.parts.items() if self.keep_data else ():
            x = blocks[name]
            q = c.encode(x if x.dtype in (torch.bfloat16, torch.float16) else x.float())
            for store, new in zip(self.data[name], (q.codes, q.scale, q.lo), strict=True):
                store.view(-1, *store.shape[len(self.lead) + 1 :]).index_copy_(0, idx, new)
        self.present.view(-1).index_fill_(0, idx, True)
        self.write_count.view(-1).index_add_(
            0, idx, torch.ones_like(idx, dtype=self.write_count.dtype)
        )

    def read_at(self, idx: Tensor) -> dict[str, Tensor]:
        """float32 ``[n, W, d]`` per part: ``dequantize`` of the copies at flat ``idx[n]``."""
        out = {}
        for name in self.data:
            ts = [t.view(-1, *t.shape[len(self.lead) + 1 :]) for t in self.data[name]]
            out[name] = self._decode(name, [t.index_select(0, idx) for t in ts])
        return out

    def _decode(self, name: str, tensors: list[Tensor]) -> Tensor:
        c = self.parts[name]
        n = self.window if c.along_tokens else self.head_dim
        return c.decode(codecs.QuantizedTensor(*tensors, c.bits, c.group, n))
