"""Routings planned and not yet moved (:meth:`~.store.TierStore.begin_routes`): the stores'
masks and move counts on the device until the host reads the counts once and lands them.

Stores whose stacks can move together (:func:`~.stacked.stackable`: rows kept elsewhere, one
tier set and shape; here also one rank and a coupled policy) begin and finish in one
:class:`~.stacked.StackedMoves` per such group (requests of one policy; per-request policies
form one group each), the others each through its own stack; a group's masks cover every unit
slot of its stores at once, so a large group moves in parts of at most :data:`_MOVE_SLOTS` unit
slots (:func:`move_parts`). Their counts travel to the host as one flat tensor.
"""

from __future__ import annotations

import torch

from .events import Transitions
from .routing import to_device
from .stacked import StackedMoves, stack_key, stackable

# unit slots (layers x heads x units, summed over the stores) one StackedMoves covers at most:
# its masks are a few bool and int tensors of that many elements (bench/routing_memory.py
# --step land: 32 h2o requests of 1K-30K tokens at Qwen-0.5B's shape in one StackedMoves peak
# at ~1.8 GiB)
_MOVE_SLOTS = 1 << 24


def move_parts(stacks: list) -> list[list[int]]:
    """Indices of ``stacks`` (one group) in the parts that move together, in order, each
    within :data:`_MOVE_SLOTS` unit slots (one stack at least)."""
    parts: list[list[int]] = []
    slots = 0
    for i, s in enumerate(stacks):
        n = s.n_layers * s.n_heads * s.capacity
        if parts and slots + n <= _MOVE_SLOTS:
            parts[-1].append(i)
            slots += n
        else:
            parts.append([i])
            slots = n
    return parts


class PendingRoutes:
    """Routings planned by :meth:`~.store.TierStore.begin_routes`, not yet moved: the plans of
    the stores that route (``plans``: store index -> plan), their movers (a
    :class:`~.stacked.StackedMoves` per group of stores moving together, or one store's
    ``PendingMove``) and all their counts (int64, flat, on the device), copied to pinned host
    memory as soon as they are computed (CUDA), so :meth:`land` waits for the routing's own
    work at most, not for what the device was given after it. ``done``: transitions already
    made (deferrals)."""

    def __init__(self, stores, plans, reasons, movers, done) -> None:
        self.stores, self.plans, self.reasons = stores, plans, reasons
        # tokens per layer at the plan: a landing later holds more (TierStore.landing_budget)
        self.planned = {i: list(stores[i].stack.n_tokens) for i in plans}
        self.movers: list[tuple[list[int], object]] = movers  # (store indices, mover)
        self.done: dict[int, Transitions] = dict(done)
        self.out: list[Transitions] | None = None
        self.dropped: set[int] = set()
        parts = [m.counts.flatten() for _, m in movers]
        self.counts, self.event = (torch.cat(parts) if parts else None), None
        if self.counts is not None and self.counts.device.type == "cuda":
            counts = self.counts
            self.counts = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self.counts.copy_(counts, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    @classmethod
    def begin(cls, stores, plans: dict, reasons, done) -> PendingRoutes:
        """The masks and counts of every planned store's move (``plans``: store index -> plan),
        stores that can move together grouped."""
        groups: dict[tuple, list[int]] = {}
        for i in plans:
            s = stores[i]
            key = stack_key(s.stack) if s.stacks_with_others else (i,)
            groups.setdefault(key, []).append(i)
        movers = []
        for group in groups.values():
            stacks = [stores[i].stack for i in group]
            parts = move_parts(stacks) if stackable(stacks) else [[k] for k in range(len(group))]
            for part in parts:
                idx = [group[k] for k in part]
                if len(idx) > 1:
                    movers.append((idx, StackedMoves([stacks[k] for k in part],
                                                     [plans[i].tiers for i in idx])))  # fmt: skip
                else:
                    movers.append((idx, stores[idx[0]].stack.begin(plans[idx[0]].tiers)))
        return cls(stores, plans, reasons, movers, done)

    def drop(self, i: int) -> None:
        """Store ``i``'s routing is not to land (its sequence ended between plan and land, e.g. a
        server request that finished): :meth:`land` leaves its units as they are and returns
        no transitions for it."""
        assert self.out is None, "drop() after land()"
        self.dropped.add(i)

    def land(self) -> list[Transitions]:
        """Move every store's units as planned; their transitions in the stores' order, those
        :meth:`drop` named left out (once; later calls return the same)."""
        if self.out is None:
            if self.event is not None:
                self.event.synchronize()
            flat = [] if self.counts is None else self.counts.tolist()
            at = 0
            for idx, mover in self.movers:
                k = mover.counts.shape[-1]
                rows = [flat[at + r * k : at + (r + 1) * k] for r in range(len(idx))]
                at += k * len(idx)
                if isinstance(mover, StackedMoves):
                    self._land_stacked(idx, mover, rows)
                elif idx[0] not in self.dropped:
                    i = idx[0]
                    s = self.stores[i]
                    moves = s.stack.finish(mover, rows[0])
                    budget = s.landing_budget(self.planned[i])
                    self.done[i] = s.finish_apply(self.plans[i], self.reasons[i], moves,
                                                  budget=budget)  # fmt: skip
            keep = [i for i in range(len(self.stores)) if i not in self.dropped]
            self.out = [self.done[i] for i in keep]
        return self.out

    def _land_stacked(self, idx: list[int], st: StackedMoves, counts: list[list[int]]) -> None:
        """Stores ``idx`` moved together: their moves, bytes and over-budget flags each in one
        pass."""
        keep = [i not in self.dropped for i in idx]
        moves, used = st.finish(counts, keep), st.nbytes()
        budgets = [self.stores[i].landing_budget(self.planned[i]) for i in idx]
        over = torch.stack([self.plans[i].over for i in idx]) | (
            used > to_device(budgets, used.device)
        )
        for k, (i, m) in enumerate(zip(idx, moves, strict=True)):
            if m is not None:
                s = self.stores[i]
                self.done[i] = s.finish_apply(self.plans[i], self.reasons[i], m, used[k], over[k],
                                              budgets[k])  # fmt: skip
