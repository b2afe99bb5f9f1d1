"""The moves of several stacks at once: :meth:`~.coupled.CoupledStack.begin` / ``finish`` of
every request a server routes at one step, as one set of tensor ops whose number does not grow
with the requests.

For stacks of one shape whose rows live elsewhere (``keep_data=False``: tiers, ledger masks and
byte counts only, as the SGLang pool's stores are). Their ``[L, H, capacity_i]`` tier maps and
ledger masks are laid side by side along the units dim (``[L, H, N]``, ``N`` the sum of the
capacities; one ``cat`` each), the masks and their per-stack counts are computed over all of
them, and the results go back to each stack in one ``_foreach_copy_``. A stack's moves are its
slice of the one compacted list (stably sorted by stack, so each keeps its own (layer, head,
unit) order). Everything equals each stack's own ``begin`` / ``finish``
(``tests/engine/test_stacked.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .coupled import CoupledStack, Moves, _compact, copies_dropped, move_masks
from .ledger import LedgerError
from .routing import to_device


def stack_key(s: CoupledStack) -> tuple:
    """What stacks moving together share: tier set, unit layout, model shape, ledger mode,
    parts and device."""
    return (s.tiers, s.layout, s.n_layers, s.n_heads, s.write_once, s.parts, s.device)


def stackable(stacks: list[CoupledStack]) -> bool:
    """Whether :class:`StackedMoves` can move ``stacks`` together: two or more, none holding
    rows, all of one :func:`stack_key` with a unit layout over tokens."""
    if len(stacks) < 2:
        return False
    key = stack_key(stacks[0])
    return stacks[0].layout.over_tokens and all(
        not s.full and not s.keep_data and stack_key(s) == key for s in stacks
    )


class StackedMoves:
    """:meth:`begin` of every stack at once; :meth:`finish` once the host read :attr:`counts`
    (int64 ``[S, 3 + Q + 1]`` on the device, each row as :meth:`CoupledStack.begin`'s)."""

    def __init__(self, stacks: list[CoupledStack], news: list[Tensor]) -> None:
        assert stackable(stacks), "StackedMoves needs stackable() stacks"
        self.stacks = stacks
        s0 = stacks[0]
        dev = s0.device
        self.caps = [s.capacity for s in stacks]
        self.starts = [sum(self.caps[:i]) for i in range(len(stacks))]
        n = sum(self.caps)
        # per stack: capacity, start along N, then per layer its complete units
        meta = to_device(
            [
                [c, a, *(s.layout.n_complete(t) for t in s.n_tokens)]
                for s, c, a in zip(stacks, self.caps, self.starts, strict=True)
            ],
            dev,
        )
        self.which = torch.repeat_interleave(
            torch.arange(len(stacks), device=dev), meta[:, 0], output_size=n
        )  # [N]: the stack of each unit slot
        per = meta[self.which]  # [N, 2 + L]
        self.unit = torch.arange(n, device=dev) - per[:, 1]  # [N]: the slot's unit in its stack
        self.cap, self.start = meta[:, 0], meta[:, 1]
        nc = per[:, 2:].T[:, None]  # [L, 1, N]: complete units of the slot's layer
        parts = []
        for s, t in zip(stacks, news, strict=True):
            parts.append(t)
            if t.shape[-1] < s.capacity:
                parts.append(s.tier[..., t.shape[-1] :])
        ev = -1 if s0.tiers.evict is None else s0.tiers.evict
        self.old = torch.cat([s.tier for s in stacks], 2)  # [L, H, N]
        self.new = new = torch.cat(parts, 2)
        self.present = {j: torch.cat([s.stores[j].present for s in stacks], 2) for j in s0.stores}
        self.count = {j: torch.cat([s.stores[j].write_count for s in stacks], 2) for j in s0.stores}
        changed, up, down, need, bad = move_masks(
            new, self.old, self.present, self.count, self.unit >= nc, ev, s0.write_once,
            s0.tiers.archive,
        )  # fmt: skip
        self.changed, self.up, self.need, self.ev = changed, up, need, ev
        self.masks = torch.stack([changed, up, down, *need.values(), bad])  # [K, L, H, N]
        per_slot = self.masks.sum((1, 2))  # [K, N]
        self.counts = per_slot.new_zeros(len(stacks), per_slot.shape[0])
        self.counts.index_add_(0, self.which, per_slot.T)

    def finish(self, counts: list[list[int]], keep: list[bool]) -> list[Moves | None]:
        """Move the stacks where ``keep`` (the others keep their tiers and copies; ``None`` for
        them) given :attr:`counts` read by the host: each stack's :class:`Moves` as its own
        ``finish`` gives them. A stack that grew since (tokens appended before a late landing)
        moves the units it had; those added since keep their tiers.

        Raises:
            LedgerError: a write-once copy would be written twice (an engine bug).
        """
        s0, new, old = self.stacks[0], self.new, self.old
        for i, c in enumerate(counts):
            if c[-1] and keep[i]:
                self._fail(i)
        sel = [s for s, k in zip(self.stacks, keep, strict=True) if k]
        gone = new == self.ev
        self.held = {}
        for q, (j, p) in enumerate(self.present.items()):
            drop = copies_dropped(gone, new, old, j, s0.write_once, s0.tiers.archive)
            self.held[j] = (p | self.need[j]) & ~drop
            self._give([s.stores[j].present for s in sel], self.held[j], keep)
            if any(c[3 + q] for c, k in zip(counts, keep, strict=True) if k):
                self._give([s.stores[j].write_count for s in sel], self.count[j] + self.need[j],
                           keep)  # fmt: skip
        self._give([s.tier for s in sel], new, keep)
        return self._moves(counts, keep)

    def _give(self, dst: list[Tensor], src: Tensor, keep: list[bool]) -> None:
        """Each kept stack's slice of ``src [L, H, N]`` into its tensor's first units (the
        stack's capacity at :meth:`__init__`; one op)."""
        parts = [p for p, k in zip(src.split(self.caps, 2), keep, strict=True) if k]
        dst = [d[..., : p.shape[-1]] for d, p in zip(dst, parts, strict=True)]
        torch._foreach_copy_(dst, parts)

    def _grown(self) -> list[int]:
        """Units each stack added since :meth:`__init__` (its capacity grew: 0 for most)."""
        return [s.capacity - c for s, c in zip(self.stacks, self.caps, strict=True)]

    def _moves(self, counts: list[list[int]], keep: list[bool]) -> list[Moves | None]:
        L, H, N = self.new.shape
        n = [c[0] for c in counts]
        idx = _compact(self.changed, sum(n))  # flat in [L, H, N], (layer, head, slot) order
        slot = idx % N
        which = self.which[slot]
        order = torch.sort(which, stable=True).indices  # each stack's moves together, in order
        idx, slot, which = idx[order], slot[order], which[order]
        cap = self.cap
        if any(self._grown()):  # flat positions in each stack's tier map as it is now
            cap = to_device([s.capacity for s in self.stacks], cap.device)
        local = idx // N * cap[which] + slot - self.start[which]
        wrote = self.masks[3:-1].any(0)  # no quantized tier: none written
        cols = [t.flatten()[idx] for t in (self.old, self.new, wrote)]
        split = [x.split(n) for x in (local, *cols)]
        out: list[Moves | None] = []
        Q = len(self.present)
        for i, (s, c) in enumerate(zip(self.stacks, counts, strict=True)):
            if not keep[i]:
                out.append(None)
                continue
            loc, src, dst, w = (x[i] for x in split)
            shape = (L, H, s.capacity)
            out.append(Moves(loc, shape, src, dst, w, promoted=c[1], written=sum(c[3 : 3 + Q])))
        return out

    def nbytes(self) -> Tensor:
        """int64 ``[S]``: each stack's :meth:`~.coupled.CoupledStack.nbytes` after
        :meth:`finish` (of the tiers and copies it moved to)."""
        s0 = self.stacks[0]
        w = s0.layout.size
        n_tok = to_device([s.n_tokens for s in self.stacks], s0.device)[self.which]  # [N, L]
        tokens = (n_tok.T[:, None] - self.unit * w).clamp(0, w)  # [L, 1, N]
        per_slot = ((self.new == 0) * tokens).sum((0, 1)) * (2 * len(s0.parts) * s0.head_dim)
        archive = s0.tiers.archive is not None  # an archived copy is in no request's bytes
        for j, s in s0.stores.items():
            held = self.held[j] & (self.new != self.ev) if archive else self.held[j]
            per_slot = per_slot + held.sum((0, 1)) * s.unit_nbytes
        out = per_slot.new_zeros(len(self.stacks))
        out.index_add_(0, self.which, per_slot)
        if any(self._grown()):  # the units added since hold full rows only
            row = s0.n_heads * 2 * len(s0.parts) * s0.head_dim  # a token's, every head
            tail = [sum(max(0, t - c * w) for t in s.n_tokens) * row
                    for s, c in zip(self.stacks, self.caps, strict=True)]  # fmt: skip
            out = out + to_device(tail, out.device)
        return out

    def _fail(self, i: int) -> None:
        """Stack ``i``'s move breaks an invariant: the error its own ``finish`` raises."""
        s, a = self.stacks[i], self.starts[i]
        sl = slice(a, a + self.caps[i])
        twice = [m[..., sl] & (self.count[j][..., sl] > 0) for j, m in self.need.items()]
        if s.write_once and any(bool(t.any()) for t in twice):
            raise LedgerError("write-once ledger entry written twice")
        raise AssertionError("promoted an evicted unit or moved a partial window")


def settle(stacks: list[CoupledStack], sizes: list[int], layer: Tensor, head: Tensor,
           unit: Tensor, tier: Tensor, copy: Tensor, where: Tensor) -> Tensor:  # fmt: skip
    """:meth:`~.store.TierStore.settle` of units of several :func:`stackable` stacks at once:
    the first ``sizes[0]`` of the units ``(layer, head, unit)`` (int64 ``[m]`` each) are stack
    0's, and so on; each sits at ``tier`` with a ledger copy where ``copy``, for the units
    ``where``. Returns bool ``[S]``: the stacks where a unit stayed above its planned tier."""
    caps = [s.capacity for s in stacks]
    meta = to_device([[sum(caps[:i]), m] for i, m in enumerate(sizes)], stacks[0].device)
    S = len(stacks)
    which = torch.repeat_interleave(
        torch.arange(S, device=meta.device), meta[:, 1], output_size=sum(sizes)
    )
    n = meta[which, 0] + unit
    tiers = torch.cat([s.tier for s in stacks], 2)  # [L, H, N]
    cur = tiers[layer, head, n]
    tier = torch.where(where, tier, cur)
    raised = tier < cur  # a better (costlier) tier than planned
    tiers[layer, head, n] = tier
    dst, src = [s.tier for s in stacks], [tiers]
    for j in stacks[0].stores:
        present = torch.cat([s.stores[j].present for s in stacks], 2)
        count = torch.cat([s.stores[j].write_count for s in stacks], 2)
        present[layer, head, n] = torch.where(where, copy, present[layer, head, n])
        count[layer, head, n] = torch.where(where, copy.int(), count[layer, head, n])
        dst += [s.stores[j].present for s in stacks] + [s.stores[j].write_count for s in stacks]
        src += [present, count]
    torch._foreach_copy_(dst, [p for x in src for p in x.split(caps, 2)])
    out = torch.zeros(S, dtype=torch.long, device=raised.device)
    return out.index_add_(0, which, raised.long()) > 0
