"""A pool move's block bookkeeping in two launches (issue 20: a routing's host ops).

The tiered SGLang pool (``tiered_radix.adapters.sglang.pool``) keeps, per ``(layer, kind,
head, window)``, a block id and a reference count (``[L, K, H, NW]`` tables; kinds ``FULL, Q,
R``: original rows, ledger copy, restored rows), and per layer a free stack of row blocks and
one of ledger blocks (``ids [L, n + 1]``, ``top [L]``, as ``kernels/stacks.py``). A move takes
``m`` unique pairs ``(layer, head, window)`` of one holder from state ``old`` to ``new``:

1. :func:`move_claim`: blocks for the representations ``new`` holds and nobody made yet (a
   ledger block where a copy is needed, then a row block where rows are restored from it),
   off the layer's stacks in pair order; a pair short of one is degraded (evicted, or left at
   ``old``). The new ids go into the block table. The caller then writes the data: packs the
   copies from ``src_q`` into ``blk_q``, unpacks ``src_r`` into ``blk_r``.
2. :func:`move_refs`: the holder's references move from ``old``'s kinds to ``new``'s; a
   representation nobody holds any more is freed (table entry 0, block pushed back in pair
   order). With ``new=None`` it is a release only.

In PyTorch (the pool's ``kernels=False`` path, the twin these equal exactly) this is ~90
launching ops a move: expansions over ``(pair, kind)``, gathers, scatters, sorts for ranks.
Here each step is one program per layer scanning the pairs with running counts.

States and kinds are the pool's (passed as :class:`Codes`), so this module knows neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ._device import triton_runs_on
from ._move_kernels import _move_claim_kernel, _move_refs_kernel

_BLOCK = 1024  # pairs a program scans per iteration


@dataclass(frozen=True)
class Codes:
    """The pool's numbering: kind indices in its tables (``q``, ``r`` = -1 where the tables
    hold ``FULL`` only), the restored and evicted states, and ``holds`` (uint8 ``[S, K]``:
    which kinds a state holds a reference to)."""

    holds: torch.Tensor
    full: int
    q: int
    r: int
    restored: int
    evicted: int


@dataclass(frozen=True)
class Stack:
    """One kind of block's free stacks: ``ids [L, n + 1]`` and ``top [L]`` (int64, device)."""

    ids: torch.Tensor
    top: torch.Tensor


@dataclass(frozen=True)
class Claimed:
    """:func:`move_claim`'s result, int64/bool ``[m]`` each."""

    reached: torch.Tensor  # the state each pair reaches
    got_q: torch.Tensor  # a new ledger block was taken ...
    blk_q: torch.Tensor  # ... this one (0: none)
    src_q: torch.Tensor  # the row block the copy is packed from
    got_r: torch.Tensor  # a new row block for restored rows was taken ...
    blk_r: torch.Tensor  # ... this one
    src_r: torch.Tensor  # the ledger block they are unpacked from


def _check(block: torch.Tensor, ly: torch.Tensor, **pairs: torch.Tensor) -> None:
    if not triton_runs_on(block):
        raise ValueError(
            f"the tables are on {block.device}; the move kernels need CUDA (CPU under "
            "TRITON_INTERPRET=1). Use the pool's PyTorch path (kernels=False) there."
        )
    if block.dim() != 4 or not block.is_contiguous():
        raise ValueError(f"expected a contiguous [L, K, H, NW] table; got {list(block.shape)}")
    for name, t in pairs.items():
        if t.dtype != torch.long or t.shape != ly.shape or ly.dim() != 1:
            raise ValueError(f"{name} must be int64 [m] like ly; got {t.dtype} {list(t.shape)}")


def move_claim(
    block: torch.Tensor,
    codes: Codes,
    q: Stack | None,
    rows: Stack,
    ly: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    make_q: bool,
    make_r: bool,
    keep_rows: int,
    evicts: bool,
    tally: torch.Tensor,
    err: torch.Tensor,
) -> Claimed:
    """Blocks for what ``new`` (int64 ``[m]``) holds and nobody made: ledger blocks (where
    ``make_q``), then row blocks for restored rows (where ``make_r``; a layer keeps
    ``keep_rows`` free), written into ``block`` (``[L, K, H, NW]``), stacks lowered. A pair
    short of a ledger block reaches the evicted state if ``evicts`` (else ``old``), one short of
    a row block ``old``. ``tally`` (int64 ``[2]``) += restored row blocks taken, pairs short;
    ``err`` (int64 ``[4]``) += evicted pairs planned back (``[1]``), restores without a ledger
    copy (``[2]``)."""
    _check(block, ly, h=h, w=w, old=old, new=new)
    ly, h, w, old, new = (t.contiguous() for t in (ly, h, w, old, new))
    m, (L, K, H, NW) = ly.numel(), block.shape
    dev = block.device
    reached = torch.empty(m, dtype=torch.long, device=dev)
    got_q, got_r = (torch.empty(m, dtype=torch.bool, device=dev) for _ in range(2))
    blk_q, src_q, blk_r, src_r = (torch.empty(m, dtype=torch.long, device=dev) for _ in range(4))
    make_q = make_q and q is not None and K > 1
    make_r = make_r and K > 1
    qs = q or rows  # a placeholder the kernel never reads without make_q
    if m:
        _move_claim_kernel[(L,)](
            ly, h, w, old, new, reached, codes.holds, block, qs.ids, qs.top, rows.ids, rows.top,
            got_q.view(torch.uint8), blk_q, src_q, got_r.view(torch.uint8), blk_r, src_r, tally,
            err, m, H, NW, qs.ids.shape[1], rows.ids.shape[1], int(keep_rows), K=K,
            KF=codes.full, KQ=codes.q, KR=codes.r, S_R=codes.restored, S_EVICT=codes.evicted,
            DO_Q=make_q, DO_R=make_r, EVICTS=evicts,
            BLOCK=min(_BLOCK, triton.next_power_of_2(m)),
        )  # fmt: skip
    return Claimed(reached, got_q, blk_q, src_q, got_r, blk_r, src_r)


def move_refs(
    block: torch.Tensor,
    ref: torch.Tensor,
    codes: Codes,
    q: Stack | None,
    rows: Stack,
    ly: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor | None,
    *,
    tally: torch.Tensor,
    err: torch.Tensor,
) -> torch.Tensor:
    """The holder of pairs ``(ly, h, w)`` references ``new``'s kinds (unless ``new`` is None)
    and drops ``old``'s; what nobody references is freed: its ``block`` entry zeroed, the block
    pushed onto its layer's stack (ledger blocks onto ``q``, row blocks onto ``rows``) in pair
    order. Returns the row block each pair freed (int64 ``[m]``, 0 where none), for the caller
    to poison. ``tally[0]`` -= restored row blocks freed; ``err[0]`` += references to missing
    blocks and counts below zero."""
    _check(block, ly, h=h, w=w, old=old, **({} if new is None else {"new": new}))
    ly, h, w, old = (t.contiguous() for t in (ly, h, w, old))
    acquire, new = new is not None, old if new is None else new.contiguous()
    m, (L, K, H, NW) = ly.numel(), block.shape
    row = torch.empty(m, dtype=torch.long, device=block.device)
    qs = q or rows
    if m:
        _move_refs_kernel[(L,)](
            ly, h, w, new, old, codes.holds, block, ref, qs.ids, qs.top,
            rows.ids, rows.top, row, tally, err, m, H, NW, qs.ids.shape[1], rows.ids.shape[1],
            K=K, KQ=codes.q, KR=codes.r, ACQUIRE=acquire,
            BLOCK=min(_BLOCK, triton.next_power_of_2(m)),
        )  # fmt: skip
    return row
