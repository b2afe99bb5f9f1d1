"""Triton rank allocation: one program per row sorts its units and fills the tiers in order.

The launcher is ``rank.rank_allocate_rows``; the plain-PyTorch twin (the definition) is
``tiered_radix.engine.allocate_rank.rank_allocate``, which this kernel equals bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

# float32 bits mapped to int32 so that signed integer order is float order (-0.0 and +0.0 are
# made equal before the map); -inf maps to the smallest value a real score key can take
_NEG_INF_KEY = tl.constexpr(-2139095041)  # 0xFF800000 ^ 0x7FFFFFFF, as int32
_LOW32 = tl.constexpr(0xFFFFFFFF)
_PAD_KEY = tl.constexpr(-(2**63))  # padding lanes sort after every unit


@triton.jit
def _descending_key(eff, offs):
    """int64 sort keys: float order in the high 32 bits, ``LOW32 - offs`` in the low 32 bits, so
    a descending sort visits equal scores by ascending unit index (a stable sort's order)."""
    bits = (eff + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into +0.0
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (key.to(tl.int64) << 32) | (_LOW32 - offs.to(tl.int64))


@triton.jit
def _rank_allocate_kernel(
    score_ptr,  # float32 [R, U] or, PER_TIER, [R, U, T - 1]; contiguous
    cost_ptr,  # float64 [R, U, T] bytes per unit per tier; contiguous
    budget_ptr,  # float64 [R]
    cum_ptr,  # float64 [T - 1] cumulative shares (the host's running sum)
    prev_ptr,  # int64 [R, U] tier of the last routing (read when HAS_PREV)
    prot_ptr,  # bool as uint8 [R, U] protected units (read when HAS_PROT)
    tier_ptr,  # int8 [R, U] out; also the state between tiers
    U,
    hysteresis,  # float32, as the twin's ``hysteresis * score.abs()`` rounds it
    T: tl.constexpr,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
    PER_TIER: tl.constexpr,
    HAS_PREV: tl.constexpr,
    HAS_PROT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < U
    unit_cost = cost_ptr + row * U * T + offs * T
    budget = tl.load(budget_ptr + row)

    if HAS_PROT:
        prot = tl.load(prot_ptr + row * U + offs, mask=inside, other=0) != 0
    else:
        prot = offs < 0
    paid = tl.sum(tl.where(prot, tl.load(unit_cost, mask=inside, other=0.0), 0.0), 0)
    tl.store(tier_ptr + row * U + offs, tl.where(prot, 0, T - 1).to(tl.int8), mask=inside)
    if HAS_PREV:
        prev = tl.load(prev_ptr + row * U + offs, mask=inside, other=T)
    used = paid

    for k in tl.static_range(T - 1):
        tl.debug_barrier()  # tier k - 1's scattered stores are visible to every thread
        if PER_TIER:
            s = tl.load(score_ptr + (row * U + offs) * (T - 1) + k, mask=inside, other=0.0)
        else:
            s = tl.load(score_ptr + row * U + offs, mask=inside, other=0.0)
        free = tl.load(tier_ptr + row * U + offs, mask=inside, other=0) == T - 1
        ok = inside & free & (s > float("-inf"))  # NaN compares false: never placed
        eff = s
        if HAS_PREV:  # the bonus on placeable units only: -inf + inf would be NaN elsewhere
            real = tl.where(ok, s, 0.0)
            eff = tl.where(prev <= k, real + hysteresis * tl.abs(real), s)
        key = _descending_key(tl.where(ok, eff, float("-inf")), offs)
        key = tl.where(inside, key, _PAD_KEY)
        key = tl.sort(key, 0, descending=True)

        # the same lanes in visiting order: lane p holds the p-th unit of the ranking
        unit = _LOW32 - (key & _LOW32)
        valid = offs < U
        taking = valid & ((key >> 32).to(tl.int32) > _NEG_INF_KEY)
        c = tl.load(cost_ptr + row * U * T + unit * T + k, mask=valid, other=0.0)
        cap = tl.minimum(tl.maximum(budget * tl.load(cum_ptr + k), paid), budget)
        room = cap - used
        rest = taking & (c != 0.0)  # units costing 0 fit whatever the room: taken at once
        for _ in tl.static_range(ROUNDS):
            live = rest & (c <= room)  # costing more than the room: never fits
            now = live & (tl.cumsum(tl.where(live, c, 0.0), 0) <= room)
            spent = tl.sum(tl.where(now, c, 0.0), 0)
            rest = rest & ~now
            room -= spent
            used += spent
        tl.store(tier_ptr + row * U + unit, tl.full([BLOCK], k, tl.int8), mask=taking & ~rest)
