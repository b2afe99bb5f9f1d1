"""Every layer of a coupled policy: K and V share units, one tier per (layer, head, unit).

Storage, stacked over layers so one routing step moves every layer with a few index ops: full
rows ``full[part] [L, H, capacity * W, d]`` (``dtype``; parts "k" and "v", or "v" alone for RDKV's
V tokens), NaN where the unit is not in the full tier (freed storage is poisoned, so reading a
demoted or evicted unit shows up as NaN); one all-layers
:class:`~tiered_radix.engine.ledger.CopyStore` per quantized tier; ``tier [L, H, capacity]`` int64
engine tier indices (units appended since the last routing are full). :class:`CoupledLayer` is
one layer's view of it.

Transitions (:meth:`CoupledStack.apply`), in this order so every read precedes the free:
1. a unit entering quantized tier ``j`` without a copy there is quantized from what it holds now
   (its full rows, or ``dequantize`` of its current copy): a ledger write;
2. a unit entering the full tier gets ``dequantize(copy of its previous tier)`` into its rows;
3. rows of units leaving the full tier are NaN-poisoned;
4. without a write-once ledger the copy of the tier a unit leaves is dropped; eviction drops all
   copies of the unit in both modes, except under ``evict(archive=a)``: an evicted unit keeps
   (or, leaving a better tier, first gets, by step 1) its copy at tier ``a``. That *archived*
   copy is read by nobody and counts in no budget (:meth:`CoupledStack.archived_nbytes`);
   :meth:`CoupledStack.recall` puts such units back at tier ``a`` (a later turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from tiered_radix.policy.model import Quantize

from .growth import grown
from .ledger import CopyStore, LedgerError, part_codecs, zero_padded
from .routing import EngineConfigError, TierSet, per_layer
from .units import UnitLayout


class PendingMove(NamedTuple):
    """:meth:`CoupledStack.begin`'s masks (``[L, H, capacity]``; ``need[j]`` per quantized
    tier; ``masks`` all of them stacked and flat) and their counts, on the device."""

    new: Tensor
    old: Tensor
    changed: Tensor
    up: Tensor
    down: Tensor
    need: dict[int, Tensor]
    masks: Tensor
    counts: Tensor


@dataclass
class Moves:
    """One step's transitions as device columns ``[n]``: flat positions ``index`` into a
    ``shape`` ``(L, H, capacity)`` tier map, ``src``/``dst`` tiers (int64), ``wrote`` bool;
    host counts of the promotions and ledger writes among them."""

    index: Tensor
    shape: tuple[int, int, int]
    src: Tensor
    dst: Tensor
    wrote: Tensor
    promoted: int = 0
    written: int = 0


def _compact(mask: Tensor, n: int) -> Tensor:
    """int64 ``[n]``: flat positions of the ``n`` True entries of ``mask``, in order (no host
    sync: the caller knows ``n``). The k-th True entry is where the running count reaches k."""
    count = mask.flatten().cumsum(0)
    return torch.searchsorted(count, torch.arange(1, n + 1, device=mask.device))


def move_masks(
    new: Tensor, old: Tensor, present: dict[int, Tensor], write_count: dict[int, Tensor],
    beyond: Tensor, evict: int, write_once: bool, archive: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict[int, Tensor], Tensor]:  # fmt: skip
    """The masks of a move of units from tiers ``old`` to ``new`` (int64, one shape):
    ``changed``, ``up`` (promoted to full), ``down`` (demoted from full), ``need`` (per
    quantized tier ``j``: a copy to write, none ``present``; at the ``archive`` tier also for
    units being evicted) and ``bad`` (invariant violations: an ``evict``-ed unit promoted, a
    unit where ``beyond`` (past its layer's complete units) moved, with ``write_once`` a copy
    written before written again)."""
    changed = new != old
    need = {j: (new == j) & ~p for j, p in present.items()}
    if archive is not None:
        need[archive] |= (new == evict) & (old != evict) & ~present[archive]
    up, down = changed & (new == 0), changed & (old == 0)
    bad = (up & (old == evict)) | (changed & beyond)
    if write_once:
        for j, m in need.items():
            bad = bad | (m & (write_count[j] > 0))
    return changed, up, down, need, bad


def copies_dropped(
    gone: Tensor, new: Tensor, old: Tensor, j: int, write_once: bool, archive: int | None = None
) -> Tensor:
    """Units whose tier-``j`` copy goes after a move from ``old`` to ``new``: the evicted ones
    (``gone``; not at the ``archive`` tier, whose copy they keep), and without a write-once
    ledger those leaving tier ``j`` for a kept tier."""
    left = (old == j) & (new != j)
    if j == archive:
        return torch.zeros_like(gone) if write_once else left & ~gone
    return gone if write_once else gone | left


_CONSTANTS: dict[tuple, Tensor] = {}


def constant(values: list[float], device) -> Tensor:
    """A float64 device tensor of ``values``, made once per (values, device) and shared by its
    readers (none writes it)."""
    key = (tuple(values), str(torch.device(device)))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(values, dtype=torch.float64, device=device)
    return t


class CoupledStack:
    """Units, tiers and copies of every layer (see the module docstring). ``max_tokens``
    reserves room up front; otherwise capacity grows as tokens arrive (:mod:`.growth`)."""

    def __init__(
        self,
        tiers: TierSet,
        layout: UnitLayout,
        n_layers: int,
        n_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        write_once: bool,
        parts: tuple[str, ...] = ("k", "v"),
        max_tokens: int | None = None,
        keep_data: bool = True,
    ) -> None:
        self.tiers, self.layout, self.write_once, self.parts = tiers, layout, write_once, parts
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.dtype, self.device = dtype, device
        self.n_tokens, self.routed_units = [0] * n_layers, [0] * n_layers
        self.capacity = 0  # units per (layer, head)
        lh = (n_layers, n_heads)
        self.keep_data = keep_data  # False: tiers and byte counts only (rows live elsewhere)
        self.full = {
            p: torch.empty(*lh, 0, head_dim, dtype=dtype, device=device)
            for p in (parts if keep_data else ())
        }
        self.tier = torch.empty(*lh, 0, dtype=torch.long, device=device)
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
            self.stores[j] = CopyStore(
                codec, n_heads, w, head_dim, device, write_once, n_layers=n_layers,
                keep_data=keep_data, units=layout.n_units(max_tokens or 1),
            )  # fmt: skip
        full = 2 * len(parts) * w * head_dim
        ev = tiers.evict
        self.unit_bytes = [
            0 if j == ev else self.stores[j].unit_nbytes if j in self.stores else full
            for j in range(len(tiers.tiers))
        ]  # bytes of one complete unit at each engine tier
        # float64 on the device, made once per (values, device) for every stack: no per-step
        # copies, and no per-request copy either (a host-to-device wait on CUDA)
        self.unit_bytes_t = constant(self.unit_bytes, device)
        self.copy_bytes_t = constant([s.unit_nbytes for s in self.stores.values()], device)
        self._tokens_key, self._tokens = None, None
        self._reserve(max_tokens or 1)

    def layer(self, li: int) -> CoupledLayer:
        return CoupledLayer(self, li)

    def n_units(self, li: int) -> int:
        return self.layout.n_units(self.n_tokens[li])

    def max_units(self) -> int:
        return max(self.n_units(li) for li in range(self.n_layers))

    def _reserve(self, n_tokens: int) -> None:
        u = self.layout.n_units(n_tokens)
        if u <= self.capacity:
            return
        cap = grown(self.capacity, u)
        extra = cap - self.capacity
        lh, w = (self.n_layers, self.n_heads), self.layout.size
        for p, x in self.full.items():
            pad = x.new_full((*lh, extra * w, self.head_dim), torch.nan)
            self.full[p] = torch.cat([x, pad], 2)
        self.tier = zero_padded(self.tier, (*lh, extra), 2)
        for s in self.stores.values():
            s.grow(cap)
        self.capacity = cap

    def append(self, li: int, rows: dict[str, Tensor], n: int | None = None) -> None:
        """Append ``rows[part][H, t, d]`` to layer ``li`` (new tokens are full); without data
        (``keep_data=False``) ``rows`` is empty and ``n`` counts the tokens."""
        t0 = self.n_tokens[li]
        t = t0 + (n if n is not None else next(iter(rows.values())).shape[1])
        self._reserve(t)
        for p, x in self.full.items():
            x[li, :, t0:t] = rows[p].to(self.dtype)
        self.n_tokens[li] = t

    def count(self, n: int) -> None:
        """``n`` new full tokens in every layer, their rows kept elsewhere (``keep_data=False``):
        one reservation for all layers."""
        assert not self.full, "count() is for stacks without rows"
        self._reserve(max(self.n_tokens) + n)
        self.n_tokens = [t + n for t in self.n_tokens]

    def seed(self, tier: Tensor, copied: Tensor) -> None:
        """The first ``n`` units start at tiers decided elsewhere (a prefix borrowed from a
        radix cache, at the states its holders left): ``tier`` long ``[L, H, n]`` the engine
        tiers, ``copied`` bool ``[L, H, n]`` where a quantized tier's ledger copy exists
        (written once); they count as routed, so the next plan treats them as placed."""
        n = tier.shape[-1]
        self.tier[:, :, :n] = tier
        for copies in self.stores.values():
            copies.present[:, :, :n] = copied
            copies.write_count[:, :, :n] = copied.int()
        self.routed_units = [n] * self.n_layers

    # -- accounting (device tensors, no host sync) -------------------------------------------
    def held(self, layers: slice | list[int], n_units: int) -> Tensor | None:
        """bool ``[Q, G, H, U]`` copies kept at each quantized tier (write-once ledger), else
        None."""
        if not self.write_once or not self.stores:
            return None
        held = torch.stack([s.present[layers, :, :n_units] for s in self.stores.values()])
        return self.own(held, layers, n_units)

    def attended(self, layers: slice | list[int], n_units: int) -> Tensor:
        """bool ``[G, H, U]``: units some tier holds for this request (not evicted; an archived
        unit's copy is not the request's)."""
        ev = self.tiers.evict
        return self.tier[layers, :, :n_units] != (-1 if ev is None else ev)

    def own(self, present: Tensor, layers: slice | list[int], n_units: int) -> Tensor:
        """Copy masks ``present [..., G, H, U]`` less the archived copies (not the request's).
        Only a policy with an archive has any: the others' masks pass through, no work."""
        if self.tiers.archive is None:
            return present
        return present & self.attended(layers, n_units)

    def unit_tokens(self, layers: slice | list[int], n_units: int) -> Tensor:
        """int64 ``[U]`` or ``[G, 1, U]``: tokens per unit (partial window fewer, 0 past the
        layer's end)."""
        ids = range(self.n_layers)[layers] if isinstance(layers, slice) else layers
        key = (tuple(self.n_tokens[i] for i in ids), n_units)
        if self._tokens_key != key:  # plan and apply of one step ask for the same
            t = per_layer(list(key[0]), self.device)
            first = self.layout.first_token(n_units * self.layout.size, self.device)
            self._tokens_key, self._tokens = key, (t - first).clamp(0, self.layout.size)
        return self._tokens

    def nbytes(self) -> Tensor:
        """int64 0-d: bytes held for the request over all layers (full rows, copies kept of
        units not evicted)."""
        u = self.max_units()
        rows = ((self.tier[..., :u] == 0) * self.unit_tokens(slice(None), u)).sum()
        b = rows * (2 * len(self.parts) * self.head_dim)
        for s in self.stores.values():
            b = b + self.own(s.present, slice(None), self.capacity).sum() * s.unit_nbytes
        return b

    def archived_nbytes(self) -> Tensor:
        """int64 0-d: bytes of the archived copies (``evict(archive=...)``): evicted units'
        copies kept for a later turn, in no budget."""
        a = self.tiers.archive
        if a is None:
            return torch.zeros((), dtype=torch.long, device=self.device)
        gone = ~self.attended(slice(None), self.capacity)
        return (self.stores[a].present & gone).sum() * self.stores[a].unit_nbytes

    def recall(self) -> int:
        """Put every archived unit (evicted, with its ``archive`` tier copy) back at that tier,
        as a later turn starts (one host sync). Returns how many units came back."""
        a, ev = self.tiers.archive, self.tiers.evict
        if a is None:
            return 0
        back = (self.tier == ev) & self.stores[a].present
        n = int(back.sum())
        if n:
            self.tier.masked_fill_(back, a)
        return n

    # -- moving --------------------------------------------------------------------------------
    def apply(self, new: Tensor) -> Moves:
        """Move every layer's units to ``new[L, H, U]`` (engine tiers, ``U`` the most units
        of any layer; units a layer lacks and partial windows keep their tier). One host sync
        (:meth:`begin`, then :meth:`finish` with its counts read; several stacks share one
        read in :meth:`~.store.TierStore.route_many`).

        Masks span the whole ``[L, H, capacity]`` tier map, so a flat position is also the
        unit's row in the stores. A unit at quantized tier ``j`` always holds its copy there.

        Raises:
            LedgerError: a write-once copy would be written twice (an engine bug).
        """
        step = self.begin(new)
        return self.finish(step, step.counts.tolist())

    def begin(self, new: Tensor) -> PendingMove:
        """The masks of :meth:`apply` and their counts (int64 ``[3 + Q + 1]`` on the device:
        changed, promoted, demoted, ledger writes per quantized tier, invariant violations);
        nothing moves yet and the host does not wait."""
        u, ev = new.shape[-1], -1 if self.tiers.evict is None else self.tiers.evict
        if u < self.capacity:
            new = torch.cat([new, self.tier[..., u:]], -1)
        old = self.tier.clone()
        nc = per_layer([self.layout.n_complete(t) for t in self.n_tokens], self.device)
        changed, up, down, need, bad = move_masks(
            new, old, {j: s.present for j, s in self.stores.items()},
            {j: s.write_count for j, s in self.stores.items()},
            torch.arange(self.capacity, device=new.device) >= nc, ev, self.write_once,
            self.tiers.archive,
        )  # fmt: skip
        masks = torch.stack([changed, up, down, *need.values(), bad]).flatten(1)
        return PendingMove(new, old, changed, up, down, need, masks, masks.sum(1))

    def finish(self, step: PendingMove, counts: list[int]) -> Moves:
        """:meth:`apply` after :meth:`begin`, with ``step.counts`` read by the host. Tokens
        appended in between (a routing that lands late, under SGLang's overlap scheduler) stay
        at their tiers, even where the stack grew for them (:meth:`regrown`)."""
        new, old, changed, up, down, need, masks = self.regrown(step)[:7]
        ev = -1 if self.tiers.evict is None else self.tiers.evict
        (n_changed, n_up, n_down), n_need = counts[:3], counts[3:-1]
        if counts[-1]:
            twice = [m & (self.stores[j].write_count > 0) for j, m in need.items()]
            if self.write_once and any(bool(t.any()) for t in twice):
                raise LedgerError("write-once ledger entry written twice")
            raise AssertionError("promoted an evicted unit or moved a partial window")
        for (j, m), n in zip(need.items(), n_need, strict=True):
            if n:
                self._write(j, _compact(m, n), old)
        if n_up:
            self._restore(_compact(up, n_up), old)
        if n_down:
            idx = _compact(down, n_down)
            for x in self.full.values():
                self._rows(x).index_fill_(0, idx, torch.nan)
        gone = new == ev
        for j, s in self.stores.items():
            s.present &= ~copies_dropped(gone, new, old, j, self.write_once, self.tiers.archive)
        self.tier.copy_(new)
        wrote = masks[3:-1].any(0).view_as(changed)  # no quantized tier: none written
        idx = _compact(changed, n_changed)
        flat = [t.flatten()[idx] for t in (old, new, wrote)]
        shape = (self.n_layers, self.n_heads, self.capacity)
        return Moves(idx, shape, *flat, promoted=n_up, written=sum(n_need))

    def regrown(self, step: PendingMove) -> PendingMove:
        """``step`` over the stack's capacity now: where the stack grew since :meth:`begin`,
        its tier maps go on with the tiers the new units hold and its masks with False (the
        units added since are not part of the move; the counts stay)."""
        u = step.new.shape[-1]
        if u == self.capacity:
            return step
        tail = self.tier[..., u:]
        new, old = (torch.cat([x, tail], -1) for x in (step.new, step.old))
        changed, up, down, *need, bad = (
            zero_padded(m, (*m.shape[:-1], self.capacity - u), m.dim() - 1)
            for m in step.masks.view(-1, *step.new.shape)
        )
        masks = torch.stack([changed, up, down, *need, bad]).flatten(1)
        need = dict(zip(step.need, need, strict=True))
        return PendingMove(new, old, changed, up, down, need, masks, step.counts)

    def _rows(self, x: Tensor) -> Tensor:
        """Full rows ``[L, H, cap * W, d]`` as unit blocks ``[L * H * cap, W, d]`` (a view)."""
        return x.view(-1, self.layout.size, self.head_dim)

    def _current(self, idx: Tensor, old: Tensor, skip: int) -> dict[str, Tensor]:
        """``[n, W, d]`` per part: what the units at flat ``idx`` hold now: full rows, or
        ``dequantize`` of the copy of their quantized tier (other than ``skip``)."""
        out = {p: self._rows(x).index_select(0, idx) for p, x in self.full.items()}
        src = None
        for j, s in self.stores.items():
            if j != skip:
                src = old.flatten()[idx][:, None, None] if src is None else src
                read = s.read_at(idx)
                out = {p: torch.where(src == j, read[p], out[p].float()) for p in out}
        return out

    def _write(self, j: int, idx: Tensor, old: Tensor) -> None:
        s = self.stores[j]
        step = max(1, (2**27 if self.device.type == "cuda" else 2**24) // (s.window * s.head_dim))
        for a in range(0, idx.numel(), step):
            part = idx[a : a + step]
            s.write_at(part, self._current(part, old, skip=j))

    def _restore(self, idx: Tensor, old: Tensor) -> None:
        src, out = None, None
        for j, s in self.stores.items():
            read = s.read_at(idx)
            if out is None:
                out = read
            else:
                src = old.flatten()[idx][:, None, None] if src is None else src
                out = {p: torch.where(src == j, read[p], out[p]) for p in out}
        for p, x in self.full.items():
            self._rows(x).index_copy_(0, idx, out[p].to(self.dtype))


class CoupledLayer:
    """Layer ``li`` of a :class:`CoupledStack`: views of its tensors and per-layer reads."""

    def __init__(self, stack: CoupledStack, li: int) -> None:
        self.stack, self.li = stack, li
        self.tiers, self.layout, self.parts = stack.tiers, stack.layout, stack.parts
        self.n_heads, self.head_dim = stack.n_heads, stack.head_dim

    @property
    def n_tokens(self) -> int:
        return self.stack.n_tokens[self.li]

    @property
    def n_units(self) -> int:
        return self.layout.n_units(self.n_tokens)

    @property
    def full(self) -> dict[str, Tensor]:
        """``[H, capacity * W, d]`` per part."""
        return {p: x[self.li] for p, x in self.stack.full.items()}

    @property
    def tier(self) -> Tensor:
        """int64 ``[H, capacity]``."""
        return self.stack.tier[self.li]

    @property
    def stores(self) -> dict[int, CopyStore]:
        return {j: s.layer(self.li) for j, s in self.stack.stores.items()}

    def blocks(self, tier: Tensor) -> dict[str, Tensor]:
        """float32 ``[H, U, W, d]`` of complete units as they are held at ``tier[H, U]``."""
        u = tier.shape[1]
        out = {p: self.layout.rows(x, u).float() for p, x in self.full.items()}
        for j, s in self.stores.items():
            m = (tier == j)[..., None, None]
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
        if uc and self.stores:
            b, n = self.blocks(tier[:, :uc]), uc * self.layout.size
            for p in out:
                out[p][:, :n] = b[p].reshape(self.n_heads, n, self.head_dim)
        ev = self.tiers.evict
        kept = self.layout.token_mask(tier != (-1 if ev is None else ev), t)
        return {p: torch.where(kept[..., None], x, torch.nan) for p, x in out.items()}, kept
