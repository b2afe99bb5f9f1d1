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
):
    """Full-precision rows slots[start:end] of head h from the pool (zones B and C)."""
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
        if MASS:
            rows = row0 + n * row_mul + row_add
            tl.store(
                score_ptr + rows[None, :] * G + g[:, None], s, mask=ok[None, :] & (g < G)[:, None]
            )
        v = tl.load(v_pool + base[:, None] + d[None, :], mask=ok[:, None], other=0.0)
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
):
    """Zone A pages of list li (one (request, head) and V bit width VB), split j of S."""
    ps, pe = _split_range(tl.load(page_indptr_ptr + li), tl.load(page_indptr_ptr + li + 1), j, S)
    kt = k_table_ptr + li * 12
    n2 = tl.load(kt + 0)
    n4 = tl.load(kt + 1)
    n8 = tl.load(kt + 2)
    n16 = tl.load(kt + 3)
    o_sc = tl.load(kt + 8)
    o_lo = tl.load(kt + 9)
    k_bytes = tl.load(kt + 10)
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
                    tl.load(kt + 4),
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    2,
                    D,
                    G_PAD,
                    P,
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
                    tl.load(kt + 5),
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    4,
                    D,
                    G_PAD,
                    P,
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
                    tl.load(kt + 6),
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    8,
                    D,
                    G_PAD,
                    P,
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
                    tl.load(kt + 7),
                    o_sc,
                    o_lo,
                    gm,
                    DT,
                    16,
                    D,
                    G_PAD,
                    P,
                )
        s = tl.where(tm[None, :], s * qk_scale, float("-inf"))
        if MASS:
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
            code = tl.reshape(_unpack(byte, VB, P, D // PER).to(tl.float32), (P, NG, VG))
            CB: tl.constexpr = (P * D // PER + 15) // 16 * 16
            MB: tl.constexpr = (2 * P * D // VG + 15) // 16 * 16
            mo = (vbase + CB) // 2 + t[:, None] * NG + tl.arange(0, NG)[None, :]
            sc = tl.load(arena16 + mo, mask=tm[:, None], other=0.0).to(tl.float32)
            lo = tl.load(arena16 + mo + MB // 2, mask=tm[:, None], other=0.0).to(tl.float32)
            v = tl.reshape(code * sc[:, :, None] + lo[:, :, None], (P, D)).to(DT)
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
):
    """One (request, KV head) x split: partial (m, l_i, acc) of all query heads of the group."""
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
    if V2:
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
        )
    if V4:
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
        )
    if V8:
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
        )
    if V16:
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
