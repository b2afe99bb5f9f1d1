"""TriZone decode split kernel: one program per (request, KV head) x split reads its zone A
pages (_decode_pages.py) and zone B/C full-precision rows once for all query heads of the group
and writes a partial softmax state; _decode_merge.py combines the splits."""

from __future__ import annotations

import triton
import triton.language as tl
from tiered_radix.kernels._decode_common import (
    NEG,
    _bcast,
    _softmax_step,
    _split_range,
    _store_logits,
    _store_lse,
)
from tiered_radix.kernels._decode_pages import _pages, _pages_b, _pages_g, _pages_u, _pages_up


@triton.jit
def _rows(
    q, m, l_i, acc, k_pool, v_pool, stride_s, stride_h, slots_ptr, units_ptr, start, end, h,
    score_ptr, row0, row_mul, row_add, qk_scale, G, DT: tl.constexpr, D: tl.constexpr,
    G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASS: tl.constexpr,
):  # fmt: skip
    """Full-precision rows slots[start:end] of head h from the pool (zones B and C); side output
    at score rows row0 + n * row_mul + row_add: a block whose rows share one unit stores one
    log2-sum-exp2 per head at its first row instead of every row's logit."""
    d = tl.arange(0, D)
    g = tl.arange(0, G_PAD)
    for i in range(start, end, BLOCK_N):
        n = i + tl.arange(0, BLOCK_N)
        ok = n < end
        slot = tl.load(slots_ptr + n, mask=ok, other=0).to(tl.int64)
        base = slot * stride_s + h * stride_h
        k = tl.load(k_pool + base[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q.to(DT), tl.trans(k.to(DT))) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        v = tl.load(v_pool + base[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        m, l_i, acc, p = _softmax_step(s, v, m, l_i, acc, DT)
        if MASS:
            u = tl.load(units_ptr + n, mask=ok, other=0)
            one = tl.min(tl.where(ok, u, 2147483647), 0) == tl.max(tl.where(ok, u, -1), 0)
            rows = row0 + n * row_mul + row_add
            gm = g < G
            _store_lse(score_ptr, row0 + i * row_mul + row_add, m, p, g, gm & _bcast(one, g), G)
            _store_logits(score_ptr, rows, s, ok & ~_bcast(one, n), g, gm, G)
    return m, l_i, acc


@triton.jit(do_not_specialize_on_alignment=("perm_ptr",))
def _q_perm_kernel(q_ptr, q_stride_b, q_stride_h, perm_ptr, out_ptr, H_KV, G,
                   D: tl.constexpr, G_PAD: tl.constexpr):  # fmt: skip
    """out[rh, g, c] = q[r, h * G + g, perm[rh, c]] for rh = r * H_KV + h (one program each),
    rows G..G_PAD zero: each (request, KV head)'s query in its K channels' permuted order, so
    that k_path="blocks" reads a block's query channels with one contiguous load instead of the
    permutation and a gather that depends on it, once per block of every page.  The same values
    (a copy), so exact."""
    rh = tl.program_id(0)
    r = rh // H_KV
    h = rh % H_KV
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    ch = tl.load(perm_ptr + rh * D + d)
    q_row = r.to(tl.int64) * q_stride_b + (h * G + g) * q_stride_h
    qp = tl.load(q_ptr + q_row[:, None] + ch[None, :], mask=(g < G)[:, None], other=0.0)
    tl.store(out_ptr + (rh.to(tl.int64) * G_PAD + g)[:, None] * D + d[None, :], qp)


# The split count, score-row offsets and the step's index lists (slices of packed per-step
# tensors, whose addresses move with the batch) are out of the compiled key, so an eager step of
# a new batch shape does not compile the kernel again ("== 1", "% 16", "16-byte aligned"); the
# lists are read a scalar at a time. Under CUDA graphs every captured batch has its own buffers.
@triton.jit(
    do_not_specialize=("row_full", "row_fresh", "S"),
    do_not_specialize_on_alignment=(
        "perm_ptr", "full_indptr_ptr", "full_end_ptr", "full_slots_ptr", "fresh_indptr_ptr",
        "fresh_slots_ptr", "page_off_ptr", "page_ntok_ptr", "page_indptr_ptr", "page_ids_ptr",
        "page_unit_ptr", "full_units_ptr", "fresh_units_ptr",
    ),
)  # fmt: skip
def _decode_split_kernel(
    q_ptr, q_stride_b, q_stride_h, perm_ptr, k_pool, v_pool, pool_stride_s, pool_stride_h,
    full_indptr_ptr, full_end_ptr, full_slots_ptr, fresh_indptr_ptr, fresh_slots_ptr, arena8,
    arena16, arenadt,
    page_off_ptr, page_ntok_ptr, page_indptr_ptr, page_ids_ptr, k_table_ptr, part_acc_ptr,
    part_ml_ptr, score_ptr, row_full, row_fresh, qk_scale, H_KV, G, S,
    DT: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, P: tl.constexpr, VG: tl.constexpr,
    BLOCK_N: tl.constexpr, MASS: tl.constexpr, VBITS: tl.constexpr, KBITS: tl.constexpr,
    page_unit_ptr=None, full_units_ptr=None, fresh_units_ptr=None,
    UNIFORM: tl.constexpr = False, PPI: tl.constexpr = 1, IL: tl.constexpr = True,
    arena32=None, KG: tl.constexpr = False, RAW_BF16: tl.constexpr = True,
    UPIPE: tl.constexpr = False, KBL: tl.constexpr = False, KC: tl.constexpr = 16,
    PF: tl.constexpr = 0, MAGIC: tl.constexpr = False, q_perm_ptr=None,
):  # fmt: skip
    """One (request, KV head) x split: partial (m, l_i, acc) of all query heads of the group.
    VBITS / KBITS: bit masks of the V / K widths compiled in (2 | 4 | 8 | 16).  UNIFORM: pages
    of k_uniform layouts, PPI pages an iteration; IL: sub-byte codes unpacked with
    tl.interleave (else shift-and-reshape); UPIPE: uniform (and KG) pages without the
    hand-written prefetch (Triton's pipeliner stages them); KG: general pages with K gathered
    as one [D, P] tile through arena32 (the arena as int32; RAW_BF16: 16-bit K is bf16, else
    fp16); KBL: general pages with K channels in dense [KC, P] blocks of one compile-time width
    (:func:`_pages_b`; PF: next page prefetched into L1 (1) or L2 (2)), and the split cutting
    the (request, head)'s pages across its V-width lists (one contiguous range, mostly one
    list a program) instead of every list into S parts; KBL reads the query in each (request,
    head)'s permuted channel order from q_perm_ptr ([B*H_kv, G_PAD, D], :func:`_q_perm_kernel`,
    launched before).  MAGIC: uniform pages' and KBL pages'
    codes dequantised without int -> float conversions (_dequant.py)."""
    rh = tl.program_id(0)
    j = tl.program_id(1)
    r = rh // H_KV
    h = rh % H_KV
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    gm = g < G
    q_row = r.to(tl.int64) * q_stride_b + (h * G + g) * q_stride_h
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=gm[:, None], other=0.0)
    m = tl.full([G_PAD], NEG, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    if KBL:  # this split's part of the (request, head)'s pages over all its lists
        a_s, a_e = _split_range(tl.load(page_indptr_ptr + rh * 4),
                                tl.load(page_indptr_ptr + rh * 4 + 4), j, S)  # fmt: skip
    for w in tl.static_range(4):  # page list (r, h, V width 2 << w)
        # uniform layouts keep 16-bit tokens as zone B rows: no 16-bit uniform pages.  Triton
        # 3.6 turns an int assigned to a name into a tensor (so 2 << w stays inline) and fails
        # on `int and ...` ("Cannot bitcast data-type"), hence the != 0.
        if (VBITS & (2 << w)) != 0 and (w < 3 or not UNIFORM):
            li = rh * 4 + w
            if KBL:
                ps = tl.maximum(a_s, tl.load(page_indptr_ptr + li))
                pe = tl.minimum(a_e, tl.load(page_indptr_ptr + li + 1))
            else:
                ps, pe = _split_range(tl.load(page_indptr_ptr + li),
                                      tl.load(page_indptr_ptr + li + 1), j, S)  # fmt: skip
            if UNIFORM and UPIPE:
                m, l_i, acc = _pages_up(
                    m, l_i, acc, q, arena8, arena16, page_off_ptr, page_ntok_ptr, page_ids_ptr,
                    page_unit_ptr, ps, pe, score_ptr, qk_scale, G, DT, 2 << w, VG, D, G_PAD, P, PPI,
                    MASS, IL, MAGIC,
                )  # fmt: skip
            elif UNIFORM:
                m, l_i, acc = _pages_u(
                    m, l_i, acc, q, arena8, arena16, page_off_ptr, page_ntok_ptr, page_ids_ptr,
                    page_unit_ptr, ps, pe, score_ptr, qk_scale, G, DT, 2 << w, VG, D, G_PAD, P, PPI,
                    MASS, IL, MAGIC,
                )  # fmt: skip
            elif KBL:
                m, l_i, acc = _pages_b(
                    m, l_i, acc, q_perm_ptr, arena8, arena16, arenadt,
                    page_off_ptr, page_ntok_ptr, page_ids_ptr, k_table_ptr, page_unit_ptr, li, ps,
                    pe, score_ptr, qk_scale, G, DT, 2 << w, VG, D, G_PAD, P, MASS, KBITS, IL, KC,
                    PF, MAGIC,
                )  # fmt: skip
            elif KG:
                m, l_i, acc = _pages_g(
                    m, l_i, acc, q_ptr, perm_ptr, q_row, gm, arena8, arena16, arenadt, arena32,
                    page_off_ptr, page_ntok_ptr, page_ids_ptr, k_table_ptr, page_unit_ptr, li, ps,
                    pe, score_ptr, qk_scale, G, DT, 2 << w, VG, D, G_PAD, P, MASS, RAW_BF16, IL,
                    UPIPE,
                )  # fmt: skip
            else:
                m, l_i, acc = _pages(
                    m, l_i, acc, q_ptr, perm_ptr, q_row, gm, arena8, arena16, arenadt,
                    page_off_ptr, page_ntok_ptr, page_ids_ptr, k_table_ptr, page_unit_ptr, li, ps,
                    pe, score_ptr, qk_scale, G, DT, 2 << w, VG, D, G_PAD, P, MASS, KBITS, IL,
                )  # fmt: skip
    fs, fe = _split_range(tl.load(full_indptr_ptr + rh), tl.load(full_end_ptr + rh), j, S)
    m, l_i, acc = _rows(q, m, l_i, acc, k_pool, v_pool, pool_stride_s, pool_stride_h,
                        full_slots_ptr, full_units_ptr, fs, fe, h, score_ptr, row_full, 1, 0,
                        qk_scale, G, DT, D, G_PAD, BLOCK_N, MASS)  # fmt: skip
    cs, ce = _split_range(tl.load(fresh_indptr_ptr + r), tl.load(fresh_indptr_ptr + r + 1), j, S)
    m, l_i, acc = _rows(q, m, l_i, acc, k_pool, v_pool, pool_stride_s, pool_stride_h,
                        fresh_slots_ptr, fresh_units_ptr, cs, ce, h, score_ptr, row_fresh, H_KV,
                        h, qk_scale, G, DT, D, G_PAD, BLOCK_N, MASS)  # fmt: skip
    po = (rh * S + j).to(tl.int64) * G_PAD
    tl.store(part_acc_ptr + (po + g)[:, None] * D + d[None, :], acc, mask=gm[:, None])
    tl.store(part_ml_ptr + 2 * po + g, m)
    tl.store(part_ml_ptr + 2 * po + G_PAD + g, l_i)
