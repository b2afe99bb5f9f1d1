"""Triton kernels of a pool move's block bookkeeping: one program per layer scans the pairs.

Launchers and the data layout in ``moves.py``; the PyTorch twin is
``TieredKVPool.move`` / ``release`` of ``tiered_radix.adapters.sglang.pool`` with
``kernels=False``, which these equal exactly (integers only).

Pairs of one move are unique, so a pair's table entries (``block``, ``ref`` at its
``(layer, kind, head, window)``) are read and written by one lane only; what pairs of a layer
share is the layer's free stacks, taken from and pushed onto with running counts in pair order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _entry(layer, kind, h, w, K: tl.constexpr, H, NW):
    """Flat index of ``(layer, kind, head, window)`` in a contiguous ``[L, K, H, NW]`` table."""
    return ((layer.to(tl.int64) * K + kind) * H + h) * NW + w


@triton.jit
def _layer_pairs(ly_ptr, h_ptr, w_ptr, old_ptr, offs, m, layer):
    """Which of pairs ``offs`` are this ``layer``'s (the others masked), and their head, window
    and old state (0 where masked)."""
    mine = (offs < m) & (tl.load(ly_ptr + offs, mask=offs < m, other=-1) == layer)
    h = tl.load(h_ptr + offs, mask=mine, other=0)
    w = tl.load(w_ptr + offs, mask=mine, other=0)
    old = tl.load(old_ptr + offs, mask=mine, other=0)
    return mine, h, w, old


@triton.jit
def _move_claim_kernel(
    ly_ptr,  # int64 [m] layer of each pair
    h_ptr,  # int64 [m] head
    w_ptr,  # int64 [m] window
    old_ptr,  # int64 [m] holder state before the move
    new_ptr,  # int64 [m] planned state
    reached_ptr,  # int64 [m] out: the state reached (new, or degraded for want of a block)
    holds_ptr,  # uint8 [S, K]: which representation kinds a state holds
    block_ptr,  # int32/int64 [L, K, H, NW] block ids; the new Q and R blocks are written
    q_ids_ptr,  # int64 [L, nq + 1] the ledger blocks' free stacks
    q_top_ptr,  # int64 [L] their counts (lowered)
    r_ids_ptr,  # int64 [L, nr + 1] the row blocks' free stacks
    r_top_ptr,  # int64 [L] their counts (lowered)
    got_q_ptr,  # uint8 [m] out: pairs that got a new ledger block
    blk_q_ptr,  # int64 [m] out: that block (0: none)
    src_q_ptr,  # int64 [m] out: the row block its copy is packed from (FULL, or R if restored)
    got_r_ptr,  # uint8 [m] out: pairs that got a new row block for restored rows
    blk_r_ptr,  # int64 [m] out: that block (0: none)
    src_r_ptr,  # int64 [m] out: the ledger block the rows are unpacked from
    tally_ptr,  # int64 [2] += restored row blocks made, pairs degraded
    err_ptr,  # int64 [4] += [1]: an evicted window planned back; [2]: R without a ledger copy
    m,
    H,
    NW,
    nq_ids,  # nq + 1
    nr_ids,  # nr + 1
    keep_rows,  # row blocks a layer keeps back for the forward being prepared
    K: tl.constexpr,  # kinds in the tables (3: FULL, Q, R)
    KF: tl.constexpr,  # the kinds' indices
    KQ: tl.constexpr,
    KR: tl.constexpr,
    S_R: tl.constexpr,  # restored-rows state
    S_EVICT: tl.constexpr,
    DO_Q: tl.constexpr,  # look for pairs that need a ledger copy
    DO_R: tl.constexpr,  # ... restored rows
    EVICTS: tl.constexpr,  # a pair short of a ledger block is evicted (else it stays at old)
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0)
    q_top = tl.zeros([], dtype=tl.int64)
    r_top = tl.zeros([], dtype=tl.int64)
    if DO_Q:
        q_top = tl.load(q_top_ptr + layer)
    if DO_R:
        r_top = tl.load(r_top_ptr + layer)
    q_taken = tl.zeros([], dtype=tl.int64)  # pairs of this layer that wanted one, so far
    r_taken = tl.zeros([], dtype=tl.int64)
    restored = tl.zeros([], dtype=tl.int64)
    short = tl.zeros([], dtype=tl.int64)
    bad = tl.zeros([], dtype=tl.int64)
    for start in range(0, m, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mine, h, w, old = _layer_pairs(ly_ptr, h_ptr, w_ptr, old_ptr, offs, m, layer)
        new = tl.load(new_ptr + offs, mask=mine, other=0)
        bad += tl.sum((mine & (old == S_EVICT) & (new != S_EVICT)).to(tl.int64), 0)
        got_q = offs < 0
        blk_q = tl.zeros([BLOCK], dtype=tl.int64)
        src_q = tl.zeros([BLOCK], dtype=tl.int64)
        cur_q = tl.zeros([BLOCK], dtype=tl.int64)
        if K > 1:
            cur_q = tl.load(block_ptr + _entry(layer, KQ, h, w, K, H, NW), mask=mine, other=0)
        if DO_Q:  # Q first: restored rows come from the ledger copy
            hold = tl.load(holds_ptr + new * K + KQ, mask=mine, other=0) != 0
            want = mine & hold & (cur_q == 0)
            rank = q_taken + tl.cumsum(want.to(tl.int64), 0) - 1
            got_q = want & (rank < q_top)
            pos = tl.maximum(q_top - 1 - rank, 0)
            blk_q = tl.load(q_ids_ptr + layer.to(tl.int64) * nq_ids + pos, mask=got_q, other=0)
            q_taken += tl.sum(want.to(tl.int64), 0)
            lack = want & ~got_q
            short += tl.sum(lack.to(tl.int64), 0)
            if EVICTS:
                new = tl.where(lack, S_EVICT, new)
            else:
                new = tl.where(lack, old, new)
            row_r = tl.load(block_ptr + _entry(layer, KR, h, w, K, H, NW), mask=mine, other=0)
            row_f = tl.load(block_ptr + _entry(layer, KF, h, w, K, H, NW), mask=mine, other=0)
            src_q = tl.where(old == S_R, row_r, row_f).to(tl.int64)
            tl.store(block_ptr + _entry(layer, KQ, h, w, K, H, NW), blk_q, mask=got_q)
        got_r = offs < 0
        blk_r = tl.zeros([BLOCK], dtype=tl.int64)
        src_r = tl.where(got_q, blk_q, cur_q).to(tl.int64)
        if DO_R:
            hold = tl.load(holds_ptr + new * K + KR, mask=mine, other=0) != 0
            cur_r = tl.load(block_ptr + _entry(layer, KR, h, w, K, H, NW), mask=mine, other=0)
            want = mine & hold & (cur_r == 0)
            rank = r_taken + tl.cumsum(want.to(tl.int64), 0) - 1
            got_r = want & (rank < r_top - keep_rows)
            pos = tl.maximum(r_top - 1 - rank, 0)
            blk_r = tl.load(r_ids_ptr + layer.to(tl.int64) * nr_ids + pos, mask=got_r, other=0)
            r_taken += tl.sum(want.to(tl.int64), 0)
            lack = want & ~got_r
            short += tl.sum(lack.to(tl.int64), 0)
            new = tl.where(lack, old, new)
            restored += tl.sum(got_r.to(tl.int64), 0)
            tl.atomic_add(err_ptr + 2, tl.sum((got_r & (src_r <= 0)).to(tl.int64), 0))
            tl.store(block_ptr + _entry(layer, KR, h, w, K, H, NW), blk_r, mask=got_r)
        tl.store(reached_ptr + offs, new, mask=mine)
        tl.store(got_q_ptr + offs, got_q.to(tl.uint8), mask=mine)
        tl.store(blk_q_ptr + offs, blk_q, mask=mine)
        tl.store(src_q_ptr + offs, src_q, mask=mine)
        tl.store(got_r_ptr + offs, got_r.to(tl.uint8), mask=mine)
        tl.store(blk_r_ptr + offs, blk_r, mask=mine)
        tl.store(src_r_ptr + offs, src_r, mask=mine)
    if DO_Q:
        tl.store(q_top_ptr + layer, q_top - tl.minimum(q_taken, tl.maximum(q_top, 0)))
    if DO_R:
        r_room = tl.maximum(r_top - keep_rows, 0)
        tl.store(r_top_ptr + layer, r_top - tl.minimum(r_taken, r_room))
    tl.atomic_add(tally_ptr + 0, restored)
    tl.atomic_add(tally_ptr + 1, short)
    tl.atomic_add(err_ptr + 1, bad)


@triton.jit
def _move_refs_kernel(
    ly_ptr,  # int64 [m]
    h_ptr,  # int64 [m]
    w_ptr,  # int64 [m]
    new_ptr,  # int64 [m] the state the holder takes (read only with ACQUIRE)
    old_ptr,  # int64 [m] the state it leaves
    holds_ptr,  # uint8 [S, K]
    block_ptr,  # [L, K, H, NW] block ids; freed representations' set to 0
    ref_ptr,  # int32 [L, K, H, NW] reference counts
    q_ids_ptr,  # int64 [L, nq + 1] freed ledger blocks are pushed here ...
    q_top_ptr,  # int64 [L]
    r_ids_ptr,  # int64 [L, nr + 1] ... and freed row blocks (FULL or R) here
    r_top_ptr,  # int64 [L]
    row_ptr,  # int64 [m] out: the row block a pair freed (0, the NaN trap, if none)
    tally_ptr,  # int64 [2]: [0] -= restored row blocks freed
    err_ptr,  # int64 [4] += [0]: a reference to a missing block or one below zero
    m,
    H,
    NW,
    nq_ids,
    nr_ids,
    K: tl.constexpr,
    KQ: tl.constexpr,
    KR: tl.constexpr,
    ACQUIRE: tl.constexpr,  # the holder takes references to new's kinds first (a move)
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0)
    q_top = tl.zeros([], dtype=tl.int64)
    if K > 1:
        q_top = tl.load(q_top_ptr + layer)
    r_top = tl.load(r_top_ptr + layer)
    q_given = tl.zeros([], dtype=tl.int64)
    r_given = tl.zeros([], dtype=tl.int64)
    unrestored = tl.zeros([], dtype=tl.int64)
    bad = tl.zeros([], dtype=tl.int64)
    for start in range(0, m, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mine, h, w, old = _layer_pairs(ly_ptr, h_ptr, w_ptr, old_ptr, offs, m, layer)
        new = old
        if ACQUIRE:
            new = tl.load(new_ptr + offs, mask=mine, other=0)
        row = tl.zeros([BLOCK], dtype=tl.int64)
        q_free = offs < 0
        q_blk = tl.zeros([BLOCK], dtype=tl.int64)
        for kind in tl.static_range(K):
            at = _entry(layer, kind, h, w, K, H, NW)
            blk = tl.load(block_ptr + at, mask=mine, other=0)
            ref = tl.load(ref_ptr + at, mask=mine, other=0)
            if ACQUIRE:
                hn = mine & (tl.load(holds_ptr + new * K + kind, mask=mine, other=0) != 0)
                bad += tl.sum((hn & (blk <= 0)).to(tl.int64), 0)
                ref += hn.to(ref.dtype)
            ho = mine & (tl.load(holds_ptr + old * K + kind, mask=mine, other=0) != 0)
            ref -= ho.to(ref.dtype)
            bad += tl.sum((mine & (ref < 0)).to(tl.int64), 0)
            gone = ho & (ref == 0)
            tl.store(ref_ptr + at, ref, mask=mine)
            tl.store(block_ptr + at, tl.where(gone, 0, blk), mask=mine)
            if kind == KQ:
                q_free = gone
                q_blk = blk.to(tl.int64)
            else:  # a holder frees at most one row block (FULL or R) a pair
                row = tl.where(gone, blk.to(tl.int64), row)
                if kind == KR:
                    unrestored += tl.sum(gone.to(tl.int64), 0)
        r_free = row > 0
        pos = r_top + r_given + tl.cumsum(r_free.to(tl.int64), 0) - 1
        tl.store(r_ids_ptr + layer.to(tl.int64) * nr_ids + pos, row, mask=r_free)
        r_given += tl.sum(r_free.to(tl.int64), 0)
        tl.store(row_ptr + offs, row, mask=mine)
        if K > 1:
            pos = q_top + q_given + tl.cumsum(q_free.to(tl.int64), 0) - 1
            tl.store(q_ids_ptr + layer.to(tl.int64) * nq_ids + pos, q_blk, mask=q_free)
            q_given += tl.sum(q_free.to(tl.int64), 0)
    tl.store(r_top_ptr + layer, r_top + r_given)
    if K > 1:
        tl.store(q_top_ptr + layer, q_top + q_given)
    tl.atomic_add(tally_ptr + 0, -unrestored)
    tl.atomic_add(err_ptr + 0, bad)
