"""One layer of a coupled policy: K and V share units, one tier per (head, unit) moves both.

Storage: full rows ``full[part] [H, capacity, d]`` (``dtype``; parts "k" and "v", or "v" alone for
RDKV's V tokens), NaN where the unit is not in the full tier (freed storage is poisoned, so reading
a demoted or evicted unit shows up as NaN); one :class:`~tiered_radix.engine.ledger.CopyStore` per
quantized tier; ``tier [H, U]`` int64 engine tier indices (units appended since the last routing
are full).

Transitions (:meth:`CoupledLayer.apply`), in this order so every read precedes the free:
1. a unit entering quantized tier ``j`` without a copy there is quantized from what it holds now
   (its full rows, or ``dequantize`` of its current copy): a ledger write;
2. a unit entering the full tier gets ``dequantize(copy of its previous tier)`` into its rows;
3. rows of units leaving the full tier are NaN-poisoned;
4. without a write-once ledger the copy of the tier a unit leaves is dropped; eviction drops all
   copies of the unit in both modes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tiered_radix.policy.model import Quantize

from .ledger import CopyStore, part_codecs
from .routing import EngineConfigError, TierSet
from .units import UnitLayout


class CoupledLayer:
    def __init__(
        self,
        tiers: TierSet,
        layout: UnitLayout,
        n_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        write_once: bool,
        parts: tuple[str, ...] = ("k", "v"),
    ) -> None:
        self.tiers, self.layout, self.write_once, self.parts = tiers, layout, write_once, parts
        self.n_heads, self.head_dim, self.dtype, self.device = n_heads, head_dim, dtype, device
        self.n_tokens, self.routed_units = 0, 0
        self.full = {
            p: torch.empty(n_heads, 0, head_dim, dtype=dtype, device=device) for p in parts
        }
        self.tier = torch.zeros(n_heads, 0, dtype=torch.long, device=device)
        self.stores: dict[int, CopyStore] = {}
        w = layout.size
        for j in tiers.quantized:
            a: Quantize = tiers.tiers[j].action
            kc, vc = part_codecs(a.bits, a.group, a.axis, w, head_dim)
            codec = {p: c for p, c in (("k", kc), ("v", vc)) if p in parts}
            for c in codec.values():
                n = w if c.along_tokens else head_dim
                if n % c.group or (c.group * c.bits) % 8:
                    raise EngineConfigError(
                        f"tier '{tiers.names[j]}': quantize(bits={a.bits}, group={a.group}) "
                        f"needs groups of {c.group} that divide {n} and hold whole bytes; "
                        f"pick a group that divides the window ({w}) and head_dim ({head_dim})"
                    )
            self.stores[j] = CopyStore(codec, n_heads, w, head_dim, device, write_once)

    @property
    def n_units(self) -> int:
        return self.layout.n_units(self.n_tokens)

    def append(self, rows: dict[str, Tensor]) -> None:
        """Append ``rows[part][H, t, d]`` (new tokens are full)."""
        n = next(iter(rows.values())).shape[1]
        t = self.n_tokens + n
        for p, x in self.full.items():
            if t > x.shape[1]:
                pad = max(t, 2 * x.shape[1]) - x.shape[1]
                x = self.full[p] = torch.cat(
                    [x, x.new_full((self.n_heads, pad, self.head_dim), torch.nan)], 1
                )
            x[:, self.n_tokens : t] = rows[p].to(self.dtype)
        self.n_tokens = t
        extra = self.n_units - self.tier.shape[1]
        if extra > 0:
            self.tier = torch.cat([self.tier, self.tier.new_zeros(self.n_heads, extra)], 1)

    # -- accounting ------------------------------------------------------------------------
    def unit_bytes(self) -> list[int]:
        """Bytes of one complete unit at each engine tier."""
        full = 2 * len(self.parts) * self.layout.size * self.head_dim
        ev = self.tiers.evict
        return [
            0 if j == ev else self.stores[j].unit_nbytes if j in self.stores else full
            for j in range(len(self.tiers.tiers))
        ]

    def held(self) -> Tensor | None:
        """bool ``[J, H, U]`` copies kept (write-once ledger), else None."""
        if not self.write_once:
            return None
        u = self.n_units
        return (
            torch.stack([self.stores[j].held(u) for j in self.tiers.quantized])
            if self.stores
            else None
        )

    def unit_tokens(self) -> Tensor:
        """int64 ``[U]`` tokens per unit (the partial window has fewer)."""
        t = self.n_tokens
        lay = self.layout
        return lay.last_token(t, self.device) - lay.first_token(t, self.device) + 1

    def bytes_of(self, mask: Tensor) -> Tensor:
        """Bytes held by the units where ``mask[H, U]``: full rows if full, copies kept."""
        u = self.n_units
        full = (self.tier[:, :u] == 0) & mask
        b = (full.long() * self.unit_tokens()).sum() * (2 * len(self.parts) * self.head_dim)
        for s in self.stores.values():
            b = b + (s.held(u) & mask).sum() * s.unit_nbytes
        return b

    def nbytes(self) -> int:
        return int(
            self.bytes_of(
                torch.ones(self.n_heads, self.n_units, dtype=torch.bool, device=self.device)
            )
        )

    # -- reading ---------------------------------------------------------------------------
    def blocks(self, tier: Tensor) -> dict[str, Tensor]:
        """float32 ``[H, U, W, d]`` of complete units as they are held at ``tier[H, U]``."""
        u = tier.shape[1]
        out = {p: self.layout.rows(x, u).float() for p, x in self.full.items()}
        for j, s in self.stores.items():
            m = (tier == j)[..., None, None]
            if bool(m.any()):
                read = s.read(u)
                out = {p: torch.where(m, read[p], out[p]) for p in out}
        return out

    def view(self) -> tuple[dict[str, Tensor], Tensor]:
        """float32 ``[H, T, d]`` per part as attention reads it (NaN where evicted), and
        ``kept`` bool ``[H, T]``."""
        t, u = self.n_tokens, self.n_units
        tier = self.tier[:, :u]
        out = {p: x[:, :t].float() for p, x in self.full.items()}
        uc = self.layout.n_complete(t)
        if uc:
            b, n = self.blocks(tier[:, :uc]), uc * self.layout.size
            for p in out:
                out[p][:, :n] = b[p].reshape(self.n_heads, n, self.head_dim)
        ev = self.tiers.evict
        kept = self.layout.token_mask(tier != (-1 if ev is None else ev), t)
        return {p: torch.where(kept[..., None], x, torch.nan) for p, x in out.items()}, kept

    # -- moving ----------------------------------------------------------------------------
    def apply(self, new: Tensor) -> tuple[Tensor, Tensor]:
        """Move units to ``new[H, U]`` (engine tiers; the partial window stays full).

        Returns ``changed`` bool ``[H, U]`` and ``wrote`` bool ``[H, U]`` (a copy was written).
        """
        u = new.shape[1]
        old = self.tier[:, :u].clone()
        changed, wrote = new != old, torch.zeros_like(new, dtype=torch.bool)
        if not bool(changed.any()):
            return changed, wrote
        uc = self.layout.n_complete(self.n_tokens)
        assert not bool(changed[:, uc:].any()), "the partial window must stay full"
        new_c, old_c = new[:, :uc], old[:, :uc]
        cur = None
        for j, s in self.stores.items():
            need = (new_c == j) & (old_c != j) & ~s.held(uc)
            if bool(need.any()):
                cur = self.blocks(old_c) if cur is None else cur
                s.write(need, cur)
                wrote[:, :uc] |= need
        up = (new_c == 0) & (old_c != 0)
        if bool(up.any()):
            cur = self.blocks(old_c) if cur is None else cur
            self._set_rows(up, cur)
        down = (new_c != 0) & (old_c == 0)
        if bool(down.any()):
            self._set_rows(down, None)
        ev = self.tiers.evict
        for j, s in self.stores.items():
            leave = (old_c == j) & (new_c != j)
            gone = new_c == ev if ev is not None else torch.zeros_like(leave)
            s.drop(gone if self.write_once else leave | gone)
        self.tier[:, :u] = new
        return changed, wrote

    def _set_rows(self, mask: Tensor, blocks: dict[str, Tensor] | None) -> None:
        """Write ``blocks`` (NaN when None) into the full rows of the units in ``mask[H, U]``."""
        rows = self.layout.token_mask(mask, mask.shape[1] * self.layout.size)
        n = rows.shape[1]
        for p, x in self.full.items():
            src = (
                torch.full_like(x[:, :n], torch.nan)
                if blocks is None
                else blocks[p].reshape(self.n_heads, n, self.head_dim).to(self.dtype)
            )
            x[:, :n] = torch.where(rows[..., None], src, x[:, :n])
