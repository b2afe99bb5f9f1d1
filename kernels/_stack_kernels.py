"""Triton free-stack take and give: one program per layer scans a routing's pairs in order.

Launchers in ``stacks.py``; the PyTorch twin is ``FreeStacks.take`` / ``FreeStacks.give`` of
``tiered_radix.adapters.sglang.freelist``, which these equal exactly (integers only).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _stack_take_kernel(
    ids_ptr,  # int64 [L, n + 1] free ids of each layer; the stack's top entry at top - 1
    top_ptr,  # int64 [L] free count per layer; lowered by the blocks taken
    ly_ptr,  # int64 [m] layer of each pair
    want_ptr,  # bool as uint8 [m] pairs that need a block
    got_ptr,  # bool as uint8 [m] out: pairs that got one
    block_ptr,  # int64 [m] out: the block taken, 0 where none
    m,
    n_ids,  # n + 1, the row length of ids
    keep,  # blocks a layer keeps back for another use
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0)
    top = tl.load(top_ptr + layer)
    taken = tl.zeros([], dtype=tl.int64)  # wanting pairs of this layer seen so far
    for start in range(0, m, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mine = (offs < m) & (tl.load(ly_ptr + offs, mask=offs < m, other=-1) == layer)
        want = mine & (tl.load(want_ptr + offs, mask=mine, other=0) != 0)
        rank = taken + tl.cumsum(want.to(tl.int64), 0) - 1  # earlier wanting pairs, this layer
        got = want & (rank < top - keep)
        pos = tl.maximum(top - 1 - rank, 0)
        block = tl.load(ids_ptr + layer.to(tl.int64) * n_ids + pos, mask=got, other=0)
        tl.store(got_ptr + offs, got.to(tl.uint8), mask=mine)
        tl.store(block_ptr + offs, block, mask=mine)
        taken += tl.sum(want.to(tl.int64), 0)
    tl.store(top_ptr + layer, top - tl.minimum(taken, tl.maximum(top - keep, 0)))


@triton.jit
def _stack_give_kernel(
    ids_ptr,  # int64 [L, n + 1]
    top_ptr,  # int64 [L] raised by the blocks given
    ly_ptr,  # int64 [m]
    block_ptr,  # int64 [m] blocks to push
    mask_ptr,  # bool as uint8 [m] which to push
    m,
    n_ids,
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0)
    top = tl.load(top_ptr + layer)
    given = tl.zeros([], dtype=tl.int64)
    for start in range(0, m, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mine = (offs < m) & (tl.load(ly_ptr + offs, mask=offs < m, other=-1) == layer)
        push = mine & (tl.load(mask_ptr + offs, mask=mine, other=0) != 0)
        pos = top + given + tl.cumsum(push.to(tl.int64), 0) - 1
        block = tl.load(block_ptr + offs, mask=push, other=0)
        tl.store(ids_ptr + layer.to(tl.int64) * n_ids + pos, block, mask=push)
        given += tl.sum(push.to(tl.int64), 0)
    tl.store(top_ptr + layer, top + given)
