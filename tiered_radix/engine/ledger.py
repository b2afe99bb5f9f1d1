"""Quantized copies of units, one store per (layer, quantized tier): the write-once ledger.

A copy of unit ``u`` of KV head ``h`` at quantized tier ``j`` holds K and V of the unit's tokens
as :class:`~tiered_radix.engine.codecs.QuantizedTensor` rows. How each part is laid out
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

Storage is dense ``[H, capacity, ...]`` per tier with a ``present`` mask; byte accounting uses
``present`` and :attr:`CopyStore.unit_nbytes`, i.e. what a packed pool would hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import codecs


class LedgerError(RuntimeError):
    """A write-once copy was about to be written a second time (an engine bug)."""


@dataclass(frozen=True)
class PartCodec:
    """How one part (K or V) of a ``[W, d]`` unit is quantized."""

    bits: int
    group: int
    along_tokens: bool

    def encode(self, x: Tensor) -> codecs.QuantizedTensor:
        """``x[n, W, d]`` -> codes over ``[n, d, W]`` (along tokens) or ``[n, W, d]``."""
        return codecs.quantize(
            x.transpose(-1, -2) if self.along_tokens else x, self.bits, self.group
        )

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
    """Copies of one layer's units at one quantized tier. ``parts`` maps "k"/"v" to codecs."""

    def __init__(
        self,
        parts: dict[str, PartCodec],
        n_heads: int,
        window: int,
        head_dim: int,
        device: torch.device,
        write_once: bool,
    ) -> None:
        self.parts, self.window, self.head_dim = parts, window, head_dim
        self.n_heads, self.device, self.write_once = n_heads, device, write_once
        self.unit_nbytes = sum(c.nbytes(window, head_dim) for c in parts.values())
        self.capacity = 0
        self.present = torch.zeros(n_heads, 0, dtype=torch.bool, device=device)
        self.write_count = torch.zeros(n_heads, 0, dtype=torch.int32, device=device)
        self.data: dict[str, list[Tensor]] = {}

    def grow(self, n_units: int) -> None:
        if n_units <= self.capacity:
            return
        cap = max(n_units, 2 * self.capacity)
        extra = cap - self.capacity
        h, w, d = self.n_heads, self.window, self.head_dim
        self.present = torch.cat([self.present, self.present.new_zeros(h, extra)], 1)
        self.write_count = torch.cat([self.write_count, self.write_count.new_zeros(h, extra)], 1)
        for name, c in self.parts.items():
            q = c.encode(torch.zeros(1, w, d, device=self.device))  # shapes of one unit
            new = [t.new_zeros(h, extra, *t.shape[1:]) for t in (q.codes, q.scale, q.lo)]
            old = self.data.get(name)
            self.data[name] = (
                new if old is None else [torch.cat(p, 1) for p in zip(old, new, strict=True)]
            )
        self.capacity = cap

    def write(self, mask: Tensor, blocks: dict[str, Tensor]) -> None:
        """Quantize ``blocks[part][H, U, W, d]`` into the units where ``mask[H, U]`` is True.

        Raises:
            LedgerError: write-once mode and one of these units already has a copy.
        """
        u = mask.shape[1]
        self.grow(u)
        if self.write_once and bool((self.write_count[:, :u][mask] > 0).any()):
            raise LedgerError("write-once ledger entry written twice")
        full = torch.zeros(self.n_heads, self.capacity, dtype=torch.bool, device=self.device)
        full[:, :u] = mask
        for name, c in self.parts.items():
            q = c.encode(blocks[name][mask].float())
            for store, new in zip(self.data[name], (q.codes, q.scale, q.lo), strict=True):
                store[full] = new
        self.present |= full
        self.write_count += full.int()

    def read(self, n_units: int) -> dict[str, Tensor]:
        """float32 ``[H, U, W, d]`` per part: ``dequantize(copy)`` (garbage where absent)."""
        self.grow(n_units)
        out = {}
        for name, c in self.parts.items():
            codes, scale, lo = (t[:, :n_units] for t in self.data[name])
            q = codecs.QuantizedTensor(
                codes, scale, lo, c.bits, c.group, self.window if c.along_tokens else self.head_dim
            )
            out[name] = c.decode(q)
        return out

    def drop(self, mask: Tensor) -> None:
        """Forget the copies of the units where ``mask[H, U]`` is True (the count stays)."""
        self.grow(mask.shape[1])
        self.present[:, : mask.shape[1]] &= ~mask

    def held(self, n_units: int) -> Tensor:
        """bool ``[H, U]``."""
        self.grow(n_units)
        return self.present[:, :n_units]

    def nbytes(self) -> int:
        return int(self.present.sum()) * self.unit_nbytes
