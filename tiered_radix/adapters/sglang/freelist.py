"""Free block ids of every layer as device stacks, and device counters read lazily by the host.

A routing takes and gives back blocks of many layers at once; keeping the free lists on the
device makes that a few tensor ops with no host round trip. Each layer's free ids form a stack
(last in, first out: the order Python lists with ``append``/``pop`` gave, so the same blocks go
to the same windows): ``ids [L, n + 1]``, the top ``top [L]`` (column ``n`` is a dump slot for
masked-out writes). The host learns the counts through :class:`DeviceCounts`: a pinned copy made
after every device-side change and read when the host needs it (admission, stats, tests), which
waits for that change only, not for the work queued after it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tiered_radix.engine.routing import to_device
from tiered_radix.kernels.moves import Stack
from tiered_radix.kernels.stacks import stack_give, stack_take


class DeviceCounts:
    """An int64 vector on the device whose host copy is refreshed lazily: :meth:`changed` after
    device ops wrote it queues a copy to pinned memory (CUDA) and marks the host copy stale;
    :meth:`host` returns the values, waiting for that copy only if it is not done yet."""

    def __init__(self, values: list[int], device) -> None:
        self.t = torch.tensor(values, dtype=torch.long, device=device)
        self.cuda = self.t.device.type == "cuda"
        self._host: list[int] | None = list(values)
        self._pinned = torch.empty_like(self.t, device="cpu").pin_memory() if self.cuda else None
        self._event = torch.cuda.Event() if self.cuda else None

    def changed(self) -> None:
        """The device values were written: queue their copy to the host (no wait)."""
        self._host = None
        if self.cuda:
            self._pinned.copy_(self.t, non_blocking=True)
            self._event.record()

    def ready(self) -> bool:
        """Whether :meth:`host` returns without waiting for the device."""
        return self._host is not None or not self.cuda or self._event.query()

    def host(self) -> list[int]:
        if self._host is None:
            if self.cuda:
                self._event.synchronize()  # the copy after the last change, not later work
                self._host = self._pinned.tolist()
            else:
                self._host = self.t.tolist()
        return self._host

    def set_host(self, values: list[int]) -> None:
        """The host computed the new values itself (and wrote them to the device)."""
        self._host = list(values)


def rank_in_group(group: Tensor, mask: Tensor, n_groups: int) -> Tensor:
    """int64 ``[m]``: for each entry with ``mask`` the number of earlier masked entries of the
    same ``group`` (int64 ``[m]`` in ``[0, n_groups)``); garbage where not masked. No host sync."""
    m = group.numel()
    key = torch.where(mask, group, n_groups)
    sk, order = torch.sort(key, stable=True)
    first = torch.searchsorted(sk, sk)  # the first entry of each group in sorted order
    ranks = torch.arange(m, device=group.device) - first
    return torch.empty_like(ranks).scatter_(0, order, ranks)


def per_group(group: Tensor, mask: Tensor, n_groups: int) -> Tensor:
    """int64 ``[n_groups]``: masked entries per group (no host sync, unlike ``bincount``)."""
    out = torch.zeros(n_groups, dtype=torch.long, device=group.device)
    return out.index_add_(0, group, mask.long())


class FreeStacks:
    """The free ids ``1..n`` of one kind of block in each of ``n_layers`` layers (initially
    popped in the order ``1, 2, ...``). ``layer(l)`` is a list-like view of one layer for host
    code (``len``, ``pop``, ``append``). ``kernel``: :meth:`take` and :meth:`give` run as one
    Triton launch each (``tiered_radix.kernels.stacks``, the same results as the PyTorch ops
    here); default on CUDA."""

    def __init__(self, n_layers: int, n: int, device, *, kernel: bool | None = None) -> None:
        self.n_layers, self.n = n_layers, n
        self.kernel = torch.device(device).type == "cuda" if kernel is None else kernel
        ids = torch.arange(n, 0, -1, dtype=torch.long, device=device)
        self.ids = torch.cat([ids, ids.new_zeros(1)]).repeat(n_layers, 1)  # [L, n + 1]
        self.top = DeviceCounts([n] * n_layers, device)
        self._floor = [n] * n_layers  # host lower bounds of the counts (see floor)
        self.views = [_LayerView(self, li) for li in range(n_layers)]

    def counts(self) -> list[int]:
        """Free blocks per layer (host values; waits for the last device change if needed)."""
        out = self.top.host()
        self._floor = list(out)
        return out

    def ready(self) -> bool:
        """Whether :meth:`counts` returns without waiting for the device."""
        return self.top.ready()

    def floor(self) -> int:
        """A lower bound of the scarcest layer's free blocks, known without waiting: the last
        counts the host read, less the bound of every :meth:`take` since."""
        return min(self._floor)

    # -- device side: masks over pairs, no host sync -------------------------------------------
    def take(self, ly: Tensor, want: Tensor, bound: int | None = None,
             keep: int = 0) -> tuple[Tensor, Tensor]:  # fmt: skip
        """One block for each pair with ``want`` (bool ``[m]``; ``ly`` int64 ``[m]`` layers), in
        pair order within a layer, while the layer has more than ``keep`` (blocks held for
        another use): ``got`` bool ``[m]`` and the block ids (int64 ``[m]``, 0 where not
        ``got``). ``bound``: a host bound of the pairs with ``want`` (default ``m``), for
        :meth:`floor`."""
        if self.kernel:
            got, block = stack_take(self.ids, self.top.t, ly, want, keep)
        else:
            rank = rank_in_group(ly, want, self.n_layers)
            avail = self.top.t[ly]
            got = want & (rank < avail - keep)
            pos = (avail - 1 - rank).clamp(min=0)
            block = torch.where(got, self.ids[ly, pos], 0)
            self.top.t.sub_(per_group(ly, got, self.n_layers))
        self.changed(taken=ly.numel() if bound is None else bound)
        return got, block

    def give(self, ly: Tensor, block: Tensor, mask: Tensor) -> None:
        """Push ``block`` (int64 ``[m]``) of layers ``ly`` where ``mask``, in order."""
        if self.kernel:
            stack_give(self.ids, self.top.t, ly, block, mask)
        else:
            rank = rank_in_group(ly, mask, self.n_layers)
            pos = torch.where(mask, self.top.t[ly] + rank, self.n)  # the dump column when masked
            self.ids.index_put_((ly, pos), torch.where(mask, block, 0))
            self.top.t.add_(per_group(ly, mask, self.n_layers))
        self.changed()

    # -- kernels that take and give themselves (kernels/moves.py) ---------------------------
    def stack(self) -> Stack:
        """The device stacks as a kernel takes from and gives to them; :meth:`changed` after."""
        return Stack(self.ids, self.top.t)

    def changed(self, taken: int = 0) -> None:
        """The device stacks changed (:meth:`take`, :meth:`give`, or a kernel), at most
        ``taken`` blocks a layer taken (a host bound, for :meth:`floor`): queue the counts' host
        copy."""
        self._floor = [max(0, f - taken) for f in self._floor]
        self.top.changed()

    # -- host-known counts ------------------------------------------------------------------
    def take_counts(self, counts: dict[int, int]) -> Tensor:
        """``counts[l]`` blocks off layer ``l``, layer by layer in ``counts``' order: int64
        ``[n]``; the caller checked that they are there (:meth:`counts`)."""
        have = list(self.counts())
        ly, pos = [], []
        for li, k in counts.items():
            ly += [li] * k
            pos += range(have[li] - 1, have[li] - 1 - k, -1)
            have[li] -= k
        dev = self.ids.device
        idx = to_device([ly, pos], dev)
        out = self.ids[idx[0], idx[1]]
        top = torch.tensor(have, dtype=torch.long)  # pinned: the copy does not wait for the device
        self.top.t.copy_(top.pin_memory() if dev.type == "cuda" else top, non_blocking=True)
        self.top.set_host(have)
        self._floor = list(have)
        return out


class _LayerView:
    """One layer's free stack as host code reads it: ``len``, truthiness, ``pop``, ``append``
    (each a host round trip: for tests and rare host paths, not routing)."""

    def __init__(self, stacks: FreeStacks, li: int) -> None:
        self.s, self.li = stacks, li

    def __len__(self) -> int:
        return self.s.counts()[self.li]

    def pop(self) -> int:
        if not len(self):
            raise IndexError("pop from an empty free list")
        return int(self.s.take_counts({self.li: 1})[0])

    def append(self, block: int) -> None:
        dev = self.s.ids.device
        one = torch.ones(1, dtype=torch.bool, device=dev)
        ly = torch.full((1,), self.li, dtype=torch.long, device=dev)
        self.s.give(ly, torch.full((1,), int(block), dtype=torch.long, device=dev), one)
