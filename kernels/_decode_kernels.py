"""Triton kernels of TriZone decode attention (launchers in decode.py, format in layout.py).

Logits live in the log2 domain (q.k * sm_scale * log2(e)) so every exponential is an exp2.
DT is the dtype of tl.dot operands: the cache dtype on GPU; float32 under the CPU
interpreter, whose bf16 tl.dot is wrong (Triton 3.9).  Softmax state starts at m = -1e30
(finite), so fully masked tiles give p = 0, never NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)


@triton.jit
def _split_range(s, e, j, S):
    n = e - s
    return s + n * j // S, s + n * (j + 1) // S


@triton.jit
def _unpack(byte, BITS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr):
    """Packed uint8 [R, NB] -> int32 codes [R, NB * 8 // BITS], first code in the lowest bits."""
    PER: tl.constexpr = 8 // BITS
    sh = tl.arange(0, PER) * BITS
    x = (byte.to(tl.int32)[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(x, (R, NB * PER))


@triton.jit
def _bcast(flag, like):
    """Scalar bool flag as a bool tensor shaped like the int tensor like (the CPU interpreter
    turns tensor & scalar-bool into ints, which masks reject)."""
    return (like * 0 + flag.to(tl.int32)) > 0


@triton.jit
def _softmax_step(s, v, m, l_i, acc, DT: tl.constexpr):
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT))
    return m_new, l_i, acc


@triton.jit
def _rows(
    q,
    m,
    l_i,
    acc,
    k_pool,
    v_pool,
    stride_s,
    stride_h,
    slots_ptr,
    start,
    end,
    h,
    score_ptr,
    row0,
    row_mul,
    row_add,
    qk_scale,
    G,
    DT: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASS: tl.constexpr,
    units_ptr=None,
    VER2: tl.constexpr = False,
):
    """Full-precision rows slots[start:end] of head h from the pool (zones B and C).
    VER2 side output: a block whose rows share one unit stores one log2-sum-exp2 per head at
    its first row instead of every row's logit."""
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
        if MASS and not VER2:
            rows = row0 + n * row_mul + row_add
            tl.store(
                score_ptr + rows[None, :] * G + g[:, None], s, mask=ok[None, :] & (g < G)[:, None]
            )
        v = tl.load(v_pool + base[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        if VER2:
            m, l_i, acc, p = _softmax_step2(s, v, m, l_i, acc, DT)
            if MASS:
                u = tl.load(units_ptr + n, mask=ok, other=0)
                one = tl.min(tl.where(ok, u, 2147483647), 0) == tl.max(tl.where(ok, u, -1), 0)
                rows = row0 + n * row_mul + row_add
                gm = g < G
                tl.store(score_ptr + (row0 + i * row_mul + row_add) * G + g,
                         m + tl.log2(tl.sum(p, 1)), mask=gm & _bcast(one, g))  # fmt: skip
                tl.store(score_ptr + rows[None, :] * G + g[:, None], s,
                         mask=(ok & ~_bcast(one, n))[None, :] & gm[:, None])  # fmt: skip
        else:
            m, l_i, acc = _softmax_step(s, v, m, l_i, acc, DT)
    return m, l_i, acc


@triton.jit
def _k_segment(
    q_ptr,
    perm_ptr,
    q_row,
    c0,
    n,
    arena8,
    arena16,
    arenadt,
    base,
    o_code,
    o_sc,
    o_lo,
    gm,
    DT: tl.constexpr,
    KB: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    P: tl.constexpr,
    VER2: tl.constexpr = False,
):
    """Logits [G_PAD, P] contributed by the n permuted K channels c0..c0+n stored at KB bits."""
    c = tl.arange(0, D)
    t = tl.arange(0, P)
    cm = c < n
    ch = tl.load(perm_ptr + c0 + c, mask=cm, other=0)
    qs = tl.load(q_ptr + q_row[:, None] + ch[None, :], mask=gm[:, None] & cm[None, :], other=0.0)
    qs = qs.to(tl.float32)
    if KB == 16:
        raw = tl.load(
            arenadt + (base + o_code) // 2 + c[:, None] * P + t[None, :],
            mask=cm[:, None],
            other=0.0,
        )
        s = tl.dot(qs.to(DT), raw.to(DT))
    else:
        PER: tl.constexpr = 8 // KB
        tb = tl.arange(0, P // PER)
        byte = tl.load(
            arena8 + base + o_code + c[:, None] * (P // PER) + tb[None, :],
            mask=cm[:, None],
            other=0,
        )
        if VER2:
            code = _unpack_il(byte, KB)
        else:
            code = _unpack(byte, KB, D, P // PER)
        sc = tl.load(arena16 + (base + o_sc) // 2 + c0 + c, mask=cm, other=0.0).to(tl.float32)
        lo = tl.load(arena16 + (base + o_lo) // 2 + c0 + c, mask=cm, other=0.0).to(tl.float32)
        # K per channel: k = code * sc + lo, so fold sc into q and lo into a per-head bias
        s = tl.dot((qs * sc[None, :]).to(DT), code.to(DT))
        s += tl.sum(qs * lo[None, :], 1)[:, None]
    return s


@triton.jit
def _pages(
    m,
    l_i,
    acc,
    q_ptr,
    perm_ptr,
    q_row,
    gm,
    arena8,
    arena16,
    arenadt,
    page_off_ptr,
    page_ntok_ptr,
    page_indptr_ptr,
    page_ids_ptr,
    k_table_ptr,
    li,
    j,
    S,
    score_ptr,
    qk_scale,
    G,
    DT: tl.constexpr,
    VB: tl.constexpr,
    VG: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    P: tl.constexpr,
    MASS: tl.constexpr,
    K2: tl.constexpr,
    K4: tl.constexpr,
    K8: tl.constexpr,
    K16: tl.constexpr,
    page_unit_ptr=None,
    VER2: tl.constexpr = False,
):
    """Zone A pages of list li (one (request, head) and V bit width VB), split j of S.
    VER2: section offsets known to be 16-byte aligned (vector loads), interleave unpacking,
    per-page log2-sum-exp2 side output for single-unit pages."""
    ps, pe = _split_range(tl.load(page_indptr_ptr + li), tl.load(page_indptr_ptr + li + 1), j, S)
    kt = k_table_ptr + li * 12
    n2 = tl.load(kt + 0)
    n4 = tl.load(kt + 1)
    n8 = tl.load(kt + 2)
    n16 = tl.load(kt + 3)
    o_sc = tl.load(kt + 8)
    o_lo = tl.load(kt + 9)
    k_bytes = tl.load(kt + 10)
    o2 = tl.load(kt + 4)
    o4 = tl.load(kt + 5)
    o8 = tl.load(kt + 6)
    o16 = tl.load(kt + 7)
    if VER2:  # every section starts on a 16-byte boundary (layout.pad16)
        o_sc = tl.multiple_of(o_sc, 16)
        o_lo = tl.multiple_of(o_lo, 16)
        k_bytes = tl.multiple_of(k_bytes, 16)
        o2 = tl.multiple_of(o2, 16)
        o4 = tl.multiple_of(o4, 16)
        o8 = tl.multiple_of(o8, 16)
        o16 = tl.multiple_of(o16, 16)
    nq = n2 + n4 + n8
    c = tl.arange(0, D)
    t = tl.arange(0, P)
    g = tl.arange(0, G_PAD)
    perm_row = perm_ptr + (li // 4) * D
    # the next page's id, offset and length are loaded one iteration ahead (short latency chain)
    nxt = tl.load(page_ids_ptr + ps, mask=ps < pe, other=0)
    nbase = tl.load(page_off_ptr + nxt, mask=ps < pe, other=0)
    nntok = tl.load(page_ntok_ptr + nxt, mask=ps < pe, other=0)
    for i in range(ps, pe):
        pid = nxt
        base = tl.multiple_of(nbase, 16)
        ntok = nntok
        more = i + 1 < pe
        nxt = tl.load(page_ids_ptr + i + 1, mask=more, other=0)
        nbase = tl.load(page_off_ptr + nxt, mask=more, other=0)
        nntok = tl.load(page_ntok_ptr + nxt, mask=more, other=0)
        tm = t < ntok
        s = tl.zeros([G_PAD, P], dtype=tl.float32)
        if K2:
            if n2 > 0:
                s += _k_segment(
                    q_ptr,
                    perm_row,
                    q_row,
                    0,
                    n2,
                    arena8,
                    arena16,
                    arenadt,
                    base,
                    o2,
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    2,
                    D,
                    G_PAD,
                    P,
                    VER2,
                )
        if K4:
            if n4 > 0:
                s += _k_segment(
                    q_ptr,
                    perm_row,
                    q_row,
                    n2,
                    n4,
                    arena8,
                    arena16,
                    arenadt,
                    base,
                    o4,
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    4,
                    D,
                    G_PAD,
                    P,
                    VER2,
                )
        if K8:
            if n8 > 0:
                s += _k_segment(
                    q_ptr,
                    perm_row,
                    q_row,
                    n2 + n4,
                    n8,
                    arena8,
                    arena16,
                    arenadt,
                    base,
                    o8,
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    8,
                    D,
                    G_PAD,
                    P,
                    VER2,
                )
        if K16:
            if n16 > 0:
                s += _k_segment(
                    q_ptr,
                    perm_row,
                    q_row,
                    nq,
                    n16,
                    arena8,
                    arena16,
                    arenadt,
                    base,
                    o16,
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    16,
                    D,
                    G_PAD,
                    P,
                    VER2,
                )
        s = tl.where(tm[None, :], s * qk_scale, float("-inf"))
        if MASS and not VER2:
            rows = pid * P + t
            tl.store(
                score_ptr + rows[None, :] * G + g[:, None], s, mask=tm[None, :] & (g < G)[:, None]
            )
        vbase = base + k_bytes
        if VB == 16:
            v = tl.load(
                arenadt + vbase // 2 + t[:, None] * D + c[None, :], mask=tm[:, None], other=0.0
            )
        else:
            PER: tl.constexpr = 8 // VB
            NG: tl.constexpr = D // VG
            cb = tl.arange(0, D // PER)
            byte = tl.load(
                arena8 + vbase + t[:, None] * (D // PER) + cb[None, :],
                mask=tm[:, None],
                other=0,
            )
            if VER2:
                code = tl.reshape(_unpack_il(byte, VB).to(tl.float32), (P, NG, VG))
            else:
                code = tl.reshape(_unpack(byte, VB, P, D // PER).to(tl.float32), (P, NG, VG))
            CB: tl.constexpr = (P * D // PER + 15) // 16 * 16
            MB: tl.constexpr = (2 * P * D // VG + 15) // 16 * 16
            mo = (vbase + CB) // 2 + t[:, None] * NG + tl.arange(0, NG)[None, :]
            sc = tl.load(arena16 + mo, mask=tm[:, None], other=0.0).to(tl.float32)
            lo = tl.load(arena16 + mo + MB // 2, mask=tm[:, None], other=0.0).to(tl.float32)
            v = tl.reshape(code * sc[:, :, None] + lo[:, :, None], (P, D)).to(DT)
        if VER2:
            m, l_i, acc, p = _softmax_step2(s, v, m, l_i, acc, DT)
            if MASS:
                unit = tl.load(page_unit_ptr + pid)
                gm2 = g < G
                tl.store(score_ptr + pid * P * G + g, m + tl.log2(tl.sum(p, 1)),
                         mask=gm2 & _bcast(unit >= 0, g))  # fmt: skip
                tl.store(score_ptr + (pid * P + t)[None, :] * G + g[:, None], s,
                         mask=(tm & _bcast(unit < 0, t))[None, :] & gm2[:, None])  # fmt: skip
        else:
            m, l_i, acc = _softmax_step(s, v, m, l_i, acc, DT)
    return m, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    q_stride_b,
    q_stride_h,
    perm_ptr,
    k_pool,
    v_pool,
    pool_stride_s,
    pool_stride_h,
    full_indptr_ptr,
    full_slots_ptr,
    fresh_indptr_ptr,
    fresh_slots_ptr,
    arena8,
    arena16,
    arenadt,
    page_off_ptr,
    page_ntok_ptr,
    page_indptr_ptr,
    page_ids_ptr,
    k_table_ptr,
    part_acc_ptr,
    part_ml_ptr,
    score_ptr,
    row_full,
    row_fresh,
    qk_scale,
    H_KV,
    G,
    S,
    DT: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    P: tl.constexpr,
    VG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASS: tl.constexpr,
    V2: tl.constexpr,
    V4: tl.constexpr,
    V8: tl.constexpr,
    V16: tl.constexpr,
    K2: tl.constexpr,
    K4: tl.constexpr,
    K8: tl.constexpr,
    K16: tl.constexpr,
    page_unit_ptr=None,
    full_units_ptr=None,
    fresh_units_ptr=None,
    VER2: tl.constexpr = False,
    UNIFORM: tl.constexpr = False,
    PPI: tl.constexpr = 1,
):
    """One (request, KV head) x split: partial (m, l_i, acc) of all query heads of the group.
    VER2 (UNIFORM: pages of k_uniform layouts, PPI pages an iteration) is the v2 code path."""
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
    if UNIFORM and V2:
        ps, pe = _split_range(
            tl.load(page_indptr_ptr + rh * 4 + 0), tl.load(page_indptr_ptr + rh * 4 + 1), j, S
        )
        m, l_i, acc = _pages_u(
            m, l_i, acc, q, arena8, arena16, page_off_ptr, page_ntok_ptr, page_ids_ptr,
            page_unit_ptr, ps, pe, score_ptr, qk_scale, G, DT, 2, VG, D, G_PAD, P, PPI, MASS,
        )  # fmt: skip
    if UNIFORM and V4:
        ps, pe = _split_range(
            tl.load(page_indptr_ptr + rh * 4 + 1), tl.load(page_indptr_ptr + rh * 4 + 2), j, S
        )
        m, l_i, acc = _pages_u(
            m, l_i, acc, q, arena8, arena16, page_off_ptr, page_ntok_ptr, page_ids_ptr,
            page_unit_ptr, ps, pe, score_ptr, qk_scale, G, DT, 4, VG, D, G_PAD, P, PPI, MASS,
        )  # fmt: skip
    if UNIFORM and V8:
        ps, pe = _split_range(
            tl.load(page_indptr_ptr + rh * 4 + 2), tl.load(page_indptr_ptr + rh * 4 + 3), j, S
        )
        m, l_i, acc = _pages_u(
            m, l_i, acc, q, arena8, arena16, page_off_ptr, page_ntok_ptr, page_ids_ptr,
            page_unit_ptr, ps, pe, score_ptr, qk_scale, G, DT, 8, VG, D, G_PAD, P, PPI, MASS,
        )  # fmt: skip
    if V2 and not UNIFORM:
        m, l_i, acc = _pages(
            m,
            l_i,
            acc,
            q_ptr,
            perm_ptr,
            q_row,
            gm,
            arena8,
            arena16,
            arenadt,
            page_off_ptr,
            page_ntok_ptr,
            page_indptr_ptr,
            page_ids_ptr,
            k_table_ptr,
            rh * 4 + 0,
            j,
            S,
            score_ptr,
            qk_scale,
            G,
            DT,
            2,
            VG,
            D,
            G_PAD,
            P,
            MASS,
            K2,
            K4,
            K8,
            K16,
            page_unit_ptr,
            VER2,
        )
    if V4 and not UNIFORM:
        m, l_i, acc = _pages(
            m,
            l_i,
            acc,
            q_ptr,
            perm_ptr,
            q_row,
            gm,
            arena8,
            arena16,
            arenadt,
            page_off_ptr,
            page_ntok_ptr,
            page_indptr_ptr,
            page_ids_ptr,
            k_table_ptr,
            rh * 4 + 1,
            j,
            S,
            score_ptr,
            qk_scale,
            G,
            DT,
            4,
            VG,
            D,
            G_PAD,
            P,
            MASS,
            K2,
            K4,
            K8,
            K16,
            page_unit_ptr,
            VER2,
        )
    if V8 and not UNIFORM:
        m, l_i, acc = _pages(
            m,
            l_i,
            acc,
            q_ptr,
            perm_ptr,
            q_row,
            gm,
            arena8,
            arena16,
            arenadt,
            page_off_ptr,
            page_ntok_ptr,
            page_indptr_ptr,
            page_ids_ptr,
            k_table_ptr,
            rh * 4 + 2,
            j,
            S,
            score_ptr,
            qk_scale,
            G,
            DT,
            8,
            VG,
            D,
            G_PAD,
            P,
            MASS,
            K2,
            K4,
            K8,
            K16,
            page_unit_ptr,
            VER2,
        )
    if V16 and not UNIFORM:
        m, l_i, acc = _pages(
            m,
            l_i,
            acc,
            q_ptr,
            perm_ptr,
            q_row,
            gm,
            arena8,
            arena16,
            arenadt,
            page_off_ptr,
            page_ntok_ptr,
            page_indptr_ptr,
            page_ids_ptr,
            k_table_ptr,
            rh * 4 + 3,
            j,
            S,
            score_ptr,
            qk_scale,
            G,
            DT,
            16,
            VG,
            D,
            G_PAD,
            P,
            MASS,
            K2,
            K4,
            K8,
            K16,
            page_unit_ptr,
            VER2,
        )
    fs, fe = _split_range(tl.load(full_indptr_ptr + rh), tl.load(full_indptr_ptr + rh + 1), j, S)
    m, l_i, acc = _rows(
        q,
        m,
        l_i,
        acc,
        k_pool,
        v_pool,
        pool_stride_s,
        pool_stride_h,
        full_slots_ptr,
        fs,
        fe,
        h,
        score_ptr,
        row_full,
        1,
        0,
        qk_scale,
        G,
        DT,
        D,
        G_PAD,
        BLOCK_N,
        MASS,
        full_units_ptr,
        VER2,
    )
    cs, ce = _split_range(tl.load(fresh_indptr_ptr + r), tl.load(fresh_indptr_ptr + r + 1), j, S)
    m, l_i, acc = _rows(
        q,
        m,
        l_i,
        acc,
        k_pool,
        v_pool,
        pool_stride_s,
        pool_stride_h,
        fresh_slots_ptr,
        cs,
        ce,
        h,
        score_ptr,
        row_fresh,
        H_KV,
        h,
        qk_scale,
        G,
        DT,
        D,
        G_PAD,
        BLOCK_N,
        MASS,
        fresh_units_ptr,
        VER2,
    )
    po = (rh * S + j).to(tl.int64) * G_PAD
    tl.store(part_acc_ptr + (po + g)[:, None] * D + d[None, :], acc, mask=gm[:, None])
    tl.store(part_ml_ptr + 2 * po + g, m)
    tl.store(part_ml_ptr + 2 * po + G_PAD + g, l_i)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    out_stride_b,
    out_stride_h,
    lse_ptr,
    H_KV,
    G,
    S,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """Log-sum-exp merge of the S splits of one (request, KV head); writes out and lse (log2)."""
    rh = tl.program_id(0)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    sj = tl.arange(0, S_PAD)
    po = (rh * S + sj).to(tl.int64) * G_PAD
    ms = tl.load(part_ml_ptr + 2 * po[:, None] + g[None, :], mask=(sj < S)[:, None], other=NEG)
    big_m = tl.max(ms, 0)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    big_l = tl.zeros([G_PAD], dtype=tl.float32)
    for jj in range(S):
        o = (rh * S + jj).to(tl.int64) * G_PAD
        w = tl.exp2(tl.load(part_ml_ptr + 2 * o + g) - big_m)
        big_l += w * tl.load(part_ml_ptr + 2 * o + G_PAD + g)
        part = tl.load(
            part_acc_ptr + (o + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0
        )
        acc += w[:, None] * part
    safe = tl.where(big_l > 0, big_l, 1.0)
    out = acc / safe[:, None]
    r = rh // H_KV
    h = rh % H_KV
    orow = r.to(tl.int64) * out_stride_b + (h * G + g) * out_stride_h
    gm = g < G
    tl.store(
        out_ptr + orow[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=gm[:, None]
    )
    tl.store(lse_ptr + rh * G_PAD + g, big_m + tl.log2(safe))


@triton.jit
def _add_units(mass_row, u, p, ok):
    """mass_row[u] += p; one atomic when the block's valid tokens share one unit (windows)."""
    umin = tl.min(tl.where(ok, u, 2147483647), 0)
    umax = tl.max(tl.where(ok, u, -1), 0)
    if umin == umax:
        tl.atomic_add(mass_row + umin, tl.sum(tl.where(ok, p, 0.0), 0))
    else:
        tl.atomic_add(mass_row + u, p, mask=ok)


@triton.jit
def _mass_rows(
    score_ptr,
    units_ptr,
    mass_row,
    lse,
    start,
    end,
    row0,
    row_mul,
    row_add,
    G,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.arange(0, G_PAD)
    for i in range(start, end, BLOCK_N):
        n = i + tl.arange(0, BLOCK_N)
        ok = n < end
        rows = row0 + n * row_mul + row_add
        s = tl.load(
            score_ptr + rows[None, :] * G + g[:, None],
            mask=ok[None, :] & (g < G)[:, None],
            other=float("-inf"),
        )
        p = tl.sum(tl.exp2(s - lse[:, None]), 0)
        u = tl.load(units_ptr + n, mask=ok, other=0)
        _add_units(mass_row, u, p, ok)


@triton.jit
def _decode_mass_kernel(
    score_ptr,
    lse_ptr,
    mass_ptr,
    mass_stride,
    full_indptr_ptr,
    full_units_ptr,
    fresh_indptr_ptr,
    fresh_units_ptr,
    page_indptr_ptr,
    page_ids_ptr,
    page_ntok_ptr,
    page_units_ptr,
    row_full,
    row_fresh,
    H_KV,
    G,
    S,
    G_PAD: tl.constexpr,
    P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Side output: mass[r, unit] += sum over the group's heads of exp2(s - lse) per token."""
    rh = tl.program_id(0)
    j = tl.program_id(1)
    r = rh // H_KV
    h = rh % H_KV
    g = tl.arange(0, G_PAD)
    t = tl.arange(0, P)
    lse = tl.load(lse_ptr + rh * G_PAD + g)
    mass_row = mass_ptr + r.to(tl.int64) * mass_stride
    ps, pe = _split_range(
        tl.load(page_indptr_ptr + rh * 4), tl.load(page_indptr_ptr + rh * 4 + 4), j, S
    )
    for i in range(ps, pe):
        pid = tl.load(page_ids_ptr + i)
        tm = t < tl.load(page_ntok_ptr + pid)
        rows = pid * P + t
        s = tl.load(
            score_ptr + rows[None, :] * G + g[:, None],
            mask=tm[None, :] & (g < G)[:, None],
            other=float("-inf"),
        )
        p = tl.sum(tl.exp2(s - lse[:, None]), 0)
        u = tl.load(page_units_ptr + rows, mask=tm, other=0)
        _add_units(mass_row, u, p, tm)
    fs, fe = _split_range(tl.load(full_indptr_ptr + rh), tl.load(full_indptr_ptr + rh + 1), j, S)
    _mass_rows(score_ptr, full_units_ptr, mass_row, lse, fs, fe, row_full, 1, 0, G, G_PAD, BLOCK_N)
    cs, ce = _split_range(tl.load(fresh_indptr_ptr + r), tl.load(fresh_indptr_ptr + r + 1), j, S)
    _mass_rows(
        score_ptr, fresh_units_ptr, mass_row, lse, cs, ce, row_fresh, H_KV, h, G, G_PAD, BLOCK_N
    )


# ---- v2: constexpr page geometry, several pages per iteration with one block of raw bytes in
# flight, per-unit log-sum-exp side output, per-head merge.  v1 above stays selectable. ----


@triton.jit
def _pad16(n):
    return (n + 15) // 16 * 16


@triton.jit
def _unpack_il(byte, BITS: tl.constexpr):
    """Packed uint8 [..., NB] -> int32 codes [..., NB * 8 // BITS] (first code in the lowest
    bits), built with interleave so the new codes stay in the thread that loaded the byte."""
    x = byte.to(tl.int32)
    if BITS == 4:
        x = tl.interleave(x & 15, x >> 4)
    elif BITS == 2:
        x = tl.interleave(
            tl.interleave(x & 3, (x >> 4) & 3), tl.interleave((x >> 2) & 3, (x >> 6) & 3)
        )
    return x


@triton.jit
def _softmax_step2(s, v, m, l_i, acc, DT: tl.constexpr):
    """_softmax_step that also returns p = exp2(s - m_new) (for the side output)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT))
    return m_new, l_i, acc, p


@triton.jit
def _u_meta(page_ids_ptr, page_off_ptr, page_ntok_ptr, page_unit_ptr, ids, ok):
    """Byte offset, valid tokens and unit of the pages ids [PPI] (0 tokens where not ok)."""
    base = tl.load(page_off_ptr + ids, mask=ok, other=0)
    ntok = tl.load(page_ntok_ptr + ids, mask=ok, other=0)
    unit = tl.load(page_unit_ptr + ids, mask=ok, other=-1)
    return tl.multiple_of(base, 16), ntok, unit


@triton.jit
def _u_raw(
    arena8,
    arena16,
    base,
    ntok,
    B: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    VG: tl.constexpr,
    PPI: tl.constexpr,
):
    """Raw bytes of PPI uniform pages at base [PPI]: K codes [D, PPI, P*B/8], K scale/lo
    [D, PPI] f16, V codes [PPI, P, D*B/8], V scale/lo [PPI, P, D/VG] f16."""
    NB: tl.constexpr = P * B // 8
    VNB: tl.constexpr = D * B // 8
    NG: tl.constexpr = D // VG
    OSC: tl.constexpr = _pad16(D * NB)
    OLO: tl.constexpr = OSC + _pad16(2 * D)
    KBY: tl.constexpr = OLO + _pad16(2 * D)
    VSC: tl.constexpr = KBY + _pad16(P * VNB)
    VLO: tl.constexpr = VSC + _pad16(2 * P * NG)
    c = tl.arange(0, D)
    t = tl.arange(0, P)
    ok = ntok > 0
    b3 = base[None, :, None]
    kraw = tl.load(
        arena8 + b3 + (c * NB)[:, None, None] + tl.arange(0, NB)[None, None, :],
        mask=ok[None, :, None],
        other=0,
    )
    h2 = (base // 2)[None, :] + c[:, None]
    ksc = tl.load(arena16 + h2 + OSC // 2, mask=ok[None, :], other=0.0)
    klo = tl.load(arena16 + h2 + OLO // 2, mask=ok[None, :], other=0.0)
    tm = t[None, :] < ntok[:, None]  # [PPI, P]
    vraw = tl.load(
        arena8 + base[:, None, None] + KBY + (t * VNB)[None, :, None]
        + tl.arange(0, VNB)[None, None, :],
        mask=tm[:, :, None],
        other=0,
    )  # fmt: skip
    m3 = (base // 2)[:, None, None] + (t * NG)[None, :, None] + tl.arange(0, NG)[None, None, :]
    vsc = tl.load(arena16 + m3 + VSC // 2, mask=tm[:, :, None], other=0.0)
    vlo = tl.load(arena16 + m3 + VLO // 2, mask=tm[:, :, None], other=0.0)
    return kraw, ksc, klo, vraw, vsc, vlo


@triton.jit
def _pages_u(
    m,
    l_i,
    acc,
    q,
    arena8,
    arena16,
    page_off_ptr,
    page_ntok_ptr,
    page_ids_ptr,
    page_unit_ptr,
    ps,
    pe,
    score_ptr,
    qk_scale,
    G,
    DT: tl.constexpr,
    B: tl.constexpr,
    VG: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    P: tl.constexpr,
    PPI: tl.constexpr,
    MASS: tl.constexpr,
):
    """Uniform pages (K and V at B bits) page_ids[ps:pe], PPI per iteration.  Software
    pipeline: raw bytes of block i+1, offsets of block i+2 and ids of block i+3 are loaded
    while block i is computed."""
    NG: tl.constexpr = D // VG
    kk = tl.arange(0, PPI)
    t = tl.arange(0, P)
    g = tl.arange(0, G_PAD)
    gm = g < G
    qd = q.to(DT)
    ok0 = ps + kk < pe
    ids = tl.load(page_ids_ptr + ps + kk, mask=ok0, other=0)
    base, ntok, unit = _u_meta(page_ids_ptr, page_off_ptr, page_ntok_ptr, page_unit_ptr, ids, ok0)
    kraw, ksc, klo, vraw, vsc, vlo = _u_raw(arena8, arena16, base, ntok, B, D, P, VG, PPI)
    ok1 = ps + PPI + kk < pe
    ids1 = tl.load(page_ids_ptr + ps + PPI + kk, mask=ok1, other=0)
    base1, ntok1, unit1 = _u_meta(page_ids_ptr, page_off_ptr, page_ntok_ptr, page_unit_ptr, ids1,
                                  ok1)  # fmt: skip
    ids2 = tl.load(page_ids_ptr + ps + 2 * PPI + kk, mask=ps + 2 * PPI + kk < pe, other=0)
    for i in range(ps, pe, PPI):
        ck, cks, ckl, cv, cvs, cvl = kraw, ksc, klo, vraw, vsc, vlo
        cur_ids, cur_ntok, cur_unit = ids, ntok, unit
        ids, ntok, unit = ids1, ntok1, unit1
        kraw, ksc, klo, vraw, vsc, vlo = _u_raw(arena8, arena16, base1, ntok1, B, D, P, VG, PPI)
        ids1 = ids2
        ok1 = i + 2 * PPI + kk < pe
        base1, ntok1, unit1 = _u_meta(page_ids_ptr, page_off_ptr, page_ntok_ptr, page_unit_ptr,
                                      ids1, ok1)  # fmt: skip
        ids2 = tl.load(page_ids_ptr + i + 3 * PPI + kk, mask=i + 3 * PPI + kk < pe, other=0)
        # K = code * scale + lo per (channel, page); one dot over the PPI pages
        code = _unpack_il(ck, B).to(tl.float32)  # [D, PPI, P]
        k = code * cks.to(tl.float32)[:, :, None] + ckl.to(tl.float32)[:, :, None]
        s = tl.dot(qd, tl.reshape(k, (D, PPI * P)).to(DT)) * qk_scale  # [G_PAD, PPI*P]
        tm = tl.reshape(t[None, :] < cur_ntok[:, None], (PPI * P,))
        s = tl.where(tm[None, :], s, float("-inf"))
        vc = tl.reshape(_unpack_il(cv, B).to(tl.float32), (PPI, P, NG, VG))
        v = vc * cvs.to(tl.float32)[:, :, :, None] + cvl.to(tl.float32)[:, :, :, None]
        v = tl.reshape(v, (PPI * P, D))
        m, l_i, acc, p = _softmax_step2(s, v, m, l_i, acc, DT)
        if MASS:
            single = cur_unit >= 0  # [PPI]: one log2-sum-exp2 per (page, head)
            psum = tl.sum(tl.reshape(p, (G_PAD, PPI, P)), 2)
            row0 = cur_ids * P
            tl.store(
                score_ptr + row0[None, :] * G + g[:, None],
                m[:, None] + tl.log2(psum),
                mask=gm[:, None] & (single & (cur_ntok > 0))[None, :],
            )
            rows = tl.reshape(row0[:, None] + t[None, :], (PPI * P,))
            multi = tl.reshape((~single)[:, None] & (t[None, :] < cur_ntok[:, None]), (PPI * P,))
            tl.store(
                score_ptr + rows[None, :] * G + g[:, None], s, mask=gm[:, None] & multi[None, :]
            )
    return m, l_i, acc


@triton.jit
def _decode_merge_kernel_v2(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    out_stride_b,
    out_stride_h,
    lse_ptr,
    H_KV,
    G,
    S,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge of the S splits of one query head (program (r*H_kv + h)*G + g): S_PAD m/l values
    at once, then BLOCK_S partial rows an iteration (independent loads, no serial chain)."""
    pid = tl.program_id(0)
    rh = pid // G
    gg = pid % G
    d = tl.arange(0, D)
    sj = tl.arange(0, S_PAD)
    ms = tl.load(part_ml_ptr + ((rh * S + sj) * 2 * G_PAD + gg).to(tl.int64), mask=sj < S,
                 other=NEG)  # fmt: skip
    big_m = tl.max(ms, 0)
    acc2 = tl.zeros([BLOCK_S, D], dtype=tl.float32)
    l2 = tl.zeros([BLOCK_S], dtype=tl.float32)
    for j0 in range(0, S, BLOCK_S):
        sb = j0 + tl.arange(0, BLOCK_S)
        ok = sb < S
        o = ((rh * S + sb) * G_PAD + gg).to(tl.int64)
        w = tl.exp2(tl.load(part_ml_ptr + 2 * o - gg, mask=ok, other=NEG) - big_m)
        l2 += w * tl.load(part_ml_ptr + 2 * o - gg + G_PAD, mask=ok, other=0.0)
        part = tl.load(part_acc_ptr + o[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        acc2 += w[:, None] * part
    acc = tl.sum(acc2, 0)
    big_l = tl.sum(l2, 0)
    safe = tl.where(big_l > 0, big_l, 1.0)
    r = rh // H_KV
    h = rh % H_KV
    orow = r.to(tl.int64) * out_stride_b + (h * G + gg) * out_stride_h
    tl.store(out_ptr + orow + d, (acc / safe).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + rh * G_PAD + gg, big_m + tl.log2(safe))


@triton.jit
def _mass_add(score_ptr, mass_row, lse, g, gm, rows0, unit0, one, rows, units, ok, G):
    """mass_row[unit0] += sum_g exp2(v - lse) for single-unit tiles (one value at rows0), and
    mass_row[units] += the same per token for the others (their logits at rows)."""
    v0 = tl.load(score_ptr + rows0[:, None] * G + g[None, :], mask=one[:, None] & gm[None, :],
                 other=float("-inf"))  # fmt: skip
    tl.atomic_add(mass_row + unit0, tl.sum(tl.exp2(v0 - lse[None, :]), 1), mask=one)
    multi = ok & ~one[:, None]
    vs = tl.load(score_ptr + rows[:, :, None] * G + g[None, None, :],
                 mask=multi[:, :, None] & gm[None, None, :], other=float("-inf"))  # fmt: skip
    tl.atomic_add(mass_row + units, tl.sum(tl.exp2(vs - lse[None, None, :]), 2), mask=multi)


@triton.jit
def _mass_rows_v2(score_ptr, units_ptr, mass_row, lse, g, gm, start, end, row0, row_mul, row_add,
                  G, BLOCK_N: tl.constexpr, NBLK: tl.constexpr):  # fmt: skip
    """Rows start:end in the split kernel's blocks of BLOCK_N, NBLK blocks an iteration."""
    bi = tl.arange(0, NBLK)
    tn = tl.arange(0, BLOCK_N)
    for i in range(start, end, NBLK * BLOCK_N):
        first = i + bi * BLOCK_N
        n = first[:, None] + tn[None, :]
        ok = n < end
        u = tl.load(units_ptr + n, mask=ok, other=0)
        umin = tl.min(tl.where(ok, u, 2147483647), 1)
        one = umin == tl.max(tl.where(ok, u, -1), 1)
        _mass_add(score_ptr, mass_row, lse, g, gm, row0 + first * row_mul + row_add, umin, one,
                  row0 + n * row_mul + row_add, u, ok, G)  # fmt: skip


@triton.jit
def _decode_mass_kernel_v2(
    score_ptr,
    lse_ptr,
    mass_ptr,
    mass_stride,
    full_indptr_ptr,
    full_units_ptr,
    fresh_indptr_ptr,
    fresh_units_ptr,
    page_indptr_ptr,
    page_ids_ptr,
    page_ntok_ptr,
    page_units_ptr,
    page_unit_ptr,
    row_full,
    row_fresh,
    H_KV,
    G,
    S,
    G_PAD: tl.constexpr,
    G_P2: tl.constexpr,
    P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NT: tl.constexpr,
    NBLK: tl.constexpr,
):
    """Side output of the v2 split kernel: a single-unit tile (page or row block) holds one
    log2-sum-exp2 per head, others one logit per (token, head); mass[r, unit] += the tile's
    probability summed over the group's heads, exp2(value - lse).  NT pages an iteration."""
    rh = tl.program_id(0)
    j = tl.program_id(1)
    r = rh // H_KV
    h = rh % H_KV
    g = tl.arange(0, G_P2)
    gm = g < G
    t = tl.arange(0, P)
    lse = tl.load(lse_ptr + rh * G_PAD + g, mask=gm, other=0.0)
    mass_row = mass_ptr + r.to(tl.int64) * mass_stride
    ps, pe = _split_range(
        tl.load(page_indptr_ptr + rh * 4), tl.load(page_indptr_ptr + rh * 4 + 4), j, S
    )
    for i in range(ps, pe, NT):
        idx = i + tl.arange(0, NT)
        ok = idx < pe
        pid = tl.load(page_ids_ptr + idx, mask=ok, other=0)
        u0 = tl.load(page_unit_ptr + pid, mask=ok, other=-1)
        ntok = tl.load(page_ntok_ptr + pid, mask=ok & (u0 < 0), other=0)
        tm = t[None, :] < ntok[:, None]
        rows = pid[:, None] * P + t[None, :]
        u = tl.load(page_units_ptr + rows, mask=tm, other=0)
        _mass_add(score_ptr, mass_row, lse, g, gm, pid * P, u0, ok & (u0 >= 0), rows, u, tm, G)
    fs, fe = _split_range(tl.load(full_indptr_ptr + rh), tl.load(full_indptr_ptr + rh + 1), j, S)
    _mass_rows_v2(score_ptr, full_units_ptr, mass_row, lse, g, gm, fs, fe, row_full, 1, 0, G,
                  BLOCK_N, NBLK)  # fmt: skip
    cs, ce = _split_range(tl.load(fresh_indptr_ptr + r), tl.load(fresh_indptr_ptr + r + 1), j, S)
    _mass_rows_v2(score_ptr, fresh_units_ptr, mass_row, lse, g, gm, cs, ce, row_fresh, H_KV, h, G,
                  BLOCK_N, NBLK)  # fmt: skip
