"""What routing did: per-unit transitions and one record per routing step.

A routing step over 32 layers x 8 heads x 4096 windows can move ~10^5 units, so transitions are
kept as columns of tensors (:class:`Transitions`) and turned into :class:`Transition` objects
only when someone iterates them. ``Transitions`` is a read-only ``Sequence[Transition]``: use it
like a list (``len``, indexing, iteration, ``count(kind)`` via :meth:`Transitions.counts`).

Nothing here makes routing wait for the device: columns may stay on the GPU and a step's byte
count may be a 0-d device tensor; they are copied to the host the first time someone reads them
(a column, a count, ``StepEvents.bytes_used``, ``EventLog.counters``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .routing import to_device

Kind = Literal["demote", "promote", "evict"]
KINDS: tuple[Kind, ...] = ("demote", "promote", "evict")


@dataclass(frozen=True)
class Transition:
    """One unit moved between tiers. ``unit`` indexes the layer's units of that part."""

    kind: Kind
    layer: int
    head: int
    unit: int
    src: str
    dst: str
    ledger_write: bool  # True when this move quantized fresh data into the ledger / copy store


class Transitions(Sequence):
    """Columns of transitions: int64 ``layer, head, unit, src, dst`` ``[n]`` (tier indices into
    ``tier_names``) and bool ``ledger_write [n]``, given on any device and read as CPU tensors
    (copied once, on first read)."""

    _COLS = ("layer", "head", "unit", "src", "dst", "ledger_write")

    def __init__(
        self,
        tier_names: Sequence[str],
        evict_index: int | None,
        layer: Tensor,
        head: Tensor,
        unit: Tensor,
        src: Tensor,
        dst: Tensor,
        ledger_write: Tensor,
    ):
        self.tier_names = tuple(tier_names)
        self.evict_index = evict_index
        self._n = int(layer.numel())
        self._raw: tuple[Tensor, ...] | None = (layer, head, unit, src, dst, ledger_write)
        self._shape: tuple[int, int, int] | None = None
        self._cpu: dict[str, Tensor] = {}
        # host counts of promotions and ledger writes where the routing knew them (None: not
        # known without reading the columns); a rows' holder skips work that none needs
        self.promoted: int | None = None
        self.written: int | None = None

    @classmethod
    def from_flat(
        cls,
        tier_names: Sequence[str],
        evict_index: int | None,
        index: Tensor,
        shape: tuple[int, int, int],
        src: Tensor,
        dst: Tensor,
        ledger_write: Tensor,
    ) -> Transitions:
        """Transitions at flat positions ``index`` of a ``shape`` ``(L, H, U)`` tier map (the
        layer/head/unit columns are derived on the host, when first read)."""
        out = cls(tier_names, evict_index, index, index, index, src, dst, ledger_write)
        out._raw, out._shape = (index, src, dst, ledger_write), shape
        return out

    def _column(self, name: str) -> Tensor:
        if self._raw is not None:
            raw = self._raw
            if any(c.device.type != "cpu" for c in raw):  # one copy for all columns
                both = torch.stack([c.long() for c in raw]).cpu()
                raw = tuple(both[i] for i in range(len(raw)))
            if self._shape is not None:
                (idx, *rest), (_, h, u) = raw, self._shape
                raw = (idx // (h * u), idx // u % h, idx % u, *rest)
            cols = dict(zip(self._COLS, raw, strict=True))
            cols["ledger_write"] = cols["ledger_write"].bool()
            self._cpu, self._raw = cols, None
        return self._cpu[name]

    def on(self, device: torch.device | str, *names: str) -> tuple[Tensor, ...]:
        """Columns ``names`` on ``device`` (int64; ``ledger_write`` bool): unravelled there while
        the host has not read them (no round trip, no host sync), else copied from the host."""
        dev = torch.device(device)
        raw = self._raw
        if raw is None or any(not _same(c.device, dev) for c in raw):
            return tuple(self._column(n).to(dev) for n in names)
        if self._shape is None:
            return _picked(dict(zip(self._COLS, raw, strict=True)), names)
        (idx, *rest), (_, h, u) = raw, self._shape
        return _unravelled(idx, rest, h, u, names)

    @staticmethod
    def gather(parts: Sequence[Transitions], device, *names: str) -> tuple[Tensor, ...]:
        """:meth:`on` of every part, concatenated in order, and last int64 ``[n]`` the part each
        row comes from. Parts given as flat positions of tier maps of one ``(L, H)`` (their
        units may differ), none read by the host yet, are unravelled together (the ops do not
        grow with the parts); others part by part."""
        dev = torch.device(device)
        if len(parts) == 1:
            n = len(parts[0])
            return (*parts[0].on(dev, *names), torch.zeros(n, dtype=torch.long, device=dev))
        sizes = [len(p) for p in parts]
        flat = all(
            p._raw is not None and p._shape is not None and p._shape[:2] == parts[0]._shape[:2]
            and all(_same(c.device, dev) for c in p._raw)
            for p in parts
        )  # fmt: skip
        meta = to_device([[len(p), 1 if p._shape is None else p._shape[2]] for p in parts], dev)
        part = torch.repeat_interleave(
            torch.arange(len(parts), device=dev), meta[:, 0], output_size=sum(sizes)
        )
        if not flat:
            cols = [p.on(dev, *names) for p in parts]
            return (*(torch.cat([c[i] for c in cols]) for i in range(len(names))), part)
        idx, *rest = (torch.cat([p._raw[i] for p in parts]) for i in range(4))
        return (*_unravelled(idx, rest, parts[0]._shape[1], meta[part, 1], names), part)

    layer = property(lambda self: self._column("layer"))
    head = property(lambda self: self._column("head"))
    unit = property(lambda self: self._column("unit"))
    src = property(lambda self: self._column("src"))
    dst = property(lambda self: self._column("dst"))
    ledger_write = property(lambda self: self._column("ledger_write"))

    @classmethod
    def empty(cls, tier_names: Sequence[str], evict_index: int | None = None) -> Transitions:
        z = torch.zeros(0, dtype=torch.long)
        return cls(tier_names, evict_index, z, z, z, z, z, z.bool())

    @classmethod
    def concat(cls, parts: Sequence[Transitions], tier_names, evict_index) -> Transitions:
        if not parts:
            return cls.empty(tier_names, evict_index)
        cols = ("layer", "head", "unit", "src", "dst", "ledger_write")
        return cls(
            tier_names, evict_index, *(torch.cat([getattr(p, c) for p in parts]) for c in cols)
        )

    def kinds(self) -> Tensor:
        """int64 ``[n]``: 0 demote, 1 promote, 2 evict (indices into ``KINDS``)."""
        return kinds_of(self.src, self.dst, self.evict_index)

    def counts(self) -> dict[str, int]:
        c = torch.bincount(self.kinds(), minlength=3).tolist()
        return dict(zip(KINDS, c, strict=True))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        kind = KINDS[int(self.kinds()[i])]
        return Transition(
            kind,
            int(self.layer[i]),
            int(self.head[i]),
            int(self.unit[i]),
            self.tier_names[int(self.src[i])],
            self.tier_names[int(self.dst[i])],
            bool(self.ledger_write[i]),
        )

    def __iter__(self):
        kinds = self.kinds().tolist()
        cols = [
            c.tolist()
            for c in (self.layer, self.head, self.unit, self.src, self.dst, self.ledger_write)
        ]
        for k, ly, h, u, s, d, w in zip(kinds, *cols, strict=True):
            yield Transition(KINDS[k], ly, h, u, self.tier_names[s], self.tier_names[d], w)

    def __repr__(self) -> str:
        return f"Transitions({len(self)}: {self.counts()})"


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (b.index is None or a.index == b.index)


def _picked(cols: dict[str, Tensor], names: tuple[str, ...]) -> tuple[Tensor, ...]:
    """Columns ``names`` of ``cols`` (int64; ``ledger_write`` bool)."""
    return tuple(cols[n].bool() if n == "ledger_write" else cols[n].long() for n in names)


def _unravelled(idx: Tensor, rest, h: int, u, names: tuple[str, ...]) -> tuple[Tensor, ...]:
    """:func:`_picked` of transitions at flat positions ``idx`` of ``(L, h, u)`` tier maps
    (``u`` an int, or int64 per row) with their ``src, dst, ledger_write`` columns ``rest``:
    only the index columns asked for are unravelled."""
    cols = dict(zip(Transitions._COLS[3:], rest, strict=True))
    ravel = {"layer": lambda: idx // (h * u), "head": lambda: idx // u % h,
             "unit": lambda: idx % u}  # fmt: skip
    cols.update({n: ravel[n]() for n in names if n in ravel})
    return _picked(cols, names)


class StepEvents:
    """One routing step. ``over_budget``: the forced content (protected tokens, the partial
    trailing window, ``keep``/``promote`` rules, tiers without an evicting option) alone exceeded
    the budget, so everything else went to its cheapest tier and ``bytes_used > budget``
    (``forced``), or the units ended above the budget for another reason (:meth:`mark_over`).
    ``bytes_used``, ``over_budget`` and ``forced`` may be given as 0-d device tensors (read
    lazily)."""

    def __init__(
        self,
        step: int,
        reason: str,
        transitions: Transitions,
        bytes_used: int | Tensor,
        budget: int,
        over_budget: bool | Tensor = False,
        forced: bool | Tensor = False,
    ) -> None:
        self.step, self.reason, self.transitions, self.budget = step, reason, transitions, budget
        self._bytes_used, self._over, self.forced = bytes_used, over_budget, forced

    def release(self) -> None:
        """Let the transitions go (an :class:`EventLog` with ``keep``): the step keeps its
        reason, bytes and flags, and lists no transition."""
        t = self.transitions
        empty = torch.zeros(0, dtype=torch.long)
        self.transitions = Transitions(
            t.tier_names, t.evict_index, empty, empty, empty, empty, empty, empty.bool()
        )

    @property
    def bytes_used(self) -> int:
        if isinstance(self._bytes_used, Tensor):
            self._bytes_used = int(self._bytes_used)
        return self._bytes_used

    @property
    def over_budget(self) -> bool:
        if isinstance(self._over, Tensor):
            self._over = bool(self._over)
        return self._over

    def mark_over(self, over: bool | Tensor) -> None:
        """The step's units ended above the budget after all (a 0-d device tensor or bool:
        no host sync), e.g. where the rows' holder could not demote them as planned."""
        self._over = self._over | over

    def unforced_over(self) -> bool | Tensor:
        """Over the budget without the forced content explaining it (a bug, or a move the rows'
        holder degraded); a 0-d bool device tensor where the flags are (no host sync)."""
        forced = self.forced
        return self._over & (~forced if isinstance(forced, Tensor) else not forced)

    @staticmethod
    def count_unforced(steps: Sequence[StepEvents], device) -> Tensor:
        """int64 0-d on ``device``: how many of ``steps`` are :meth:`unforced_over` (their flags
        stacked: the ops do not grow with the steps; no host sync)."""
        flags = [x for e in steps for x in (e._over, e.forced)]
        if not all(isinstance(x, Tensor) for x in flags):
            return torch.stack([torch.as_tensor(e.unforced_over(), device=device) for e in steps]
                               ).sum()  # fmt: skip
        both = torch.stack(flags).view(-1, 2).to(device)
        return (both[:, 0] & ~both[:, 1]).sum()

    def __repr__(self) -> str:
        return (
            f"StepEvents(step={self.step}, reason={self.reason!r}, {self.transitions!r}, "
            f"bytes_used={self.bytes_used}, budget={self.budget}, over_budget={self.over_budget})"
        )


class EventLog:
    """Every routing step of a store, and transition counts by kind plus "ledger_write".

    ``keep``: only the last ``keep`` steps hold their transitions (None: all); older steps keep
    their reason, bytes and flags, their transitions let go (:meth:`StepEvents.release`). A
    step's transitions are every moved unit's columns, on the store's device: a server's stores
    keep one, since their moves are counted where they happen (the SGLang backend's stats);
    holding them all kept ~1 KB a token of every running token-unit request for its life (a
    first routing moves ~90% of its units). Such a log counts nothing: :attr:`counters`
    refuses."""

    def __init__(self, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"an event log keeps at least one step, got keep={keep}")
        self.keep = keep
        self.steps: list[StepEvents] = []
        self._counters: Counter = Counter()
        self._pending: list[StepEvents] = []

    def record(self, ev: StepEvents) -> None:
        self.steps.append(ev)
        if self.keep is None:
            self._pending.append(ev)
        elif len(self.steps) > self.keep:
            self.steps[-self.keep - 1].release()  # the step that just left the window

    @property
    def counters(self) -> Counter:
        if self.keep is not None:
            raise ValueError(
                f"this event log keeps its last {self.keep} step(s) and counts nothing; "
                "count the transitions where they are applied, or keep every step"
            )
        for ev in self._pending:
            self._counters.update(ev.transitions.counts())
            self._counters["ledger_write"] += int(ev.transitions.ledger_write.sum())
        self._pending = []
        return self._counters

    @property
    def over_budget_steps(self) -> list[int]:
        return [s.step for s in self.steps if s.over_budget]


def kinds_of(src: Tensor, dst: Tensor, evict_index: int | None) -> Tensor:
    """int64: 0 demote, 1 promote, 2 evict (indices into ``KINDS``) for moves ``src -> dst``
    (engine tiers; a lower index is a higher precision)."""
    ev = dst == (-1 if evict_index is None else evict_index)
    return torch.where(ev, 2, torch.where(dst > src, 0, 1))
