"""Zone A page loops of the TriZone decode split kernel: general pages (K sections of runtime
size, from k_table; read section by section, or gathered as one [D, P] tile), and uniform pages
(compile-time geometry, PPI pages an iteration; prefetched by hand, or left to Triton's
pipeliner)."""

from __future__ import annotations

import triton
import triton.language as tl
from tiered_radix.kernels._decode_common import (
    _bcast,
    _k_blocks,
    _k_gather,
    _k_geometry,
    _k_section,
    _prefetch_page,
    _softmax_step,
    _store_logits,
    _store_lse,
    _u_k,
    _u_meta,
    _u_raw,
    _u_v,
    _v_page,
)
from tiered_radix.kernels._dequant import _magic_one


@triton.jit
def _attend_page(
    s, m, l_i, acc, arena8, arena16, arenadt, v_base, tm, t, g, pid, page_unit_ptr, score_ptr, G,
    DT: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    MASS: tl.constexpr, IL: tl.constexpr, MAGIC: tl.constexpr = False,
):  # fmt: skip
    """A general page's V (VB bits at v_base, tokens tm; MAGIC: dequantised without
    conversions) folded into the online softmax over its masked logits s [G_PAD, P]; with MASS
    its side output: one log2-sum-exp2 per head where the page is one unit, its logits per token
    where it is not. The tail of every general-page loop (sections, gathered K, K blocks)."""
    v = _v_page(arena8, arena16, arenadt, v_base, tm, DT, VB, VG, D, P, IL, MAGIC,
                _magic_one(G))  # fmt: skip
    m, l_i, acc, p = _softmax_step(s, v, m, l_i, acc, DT)
    if MASS:
        unit = tl.load(page_unit_ptr + pid)
        gm2 = g < G
        _store_lse(score_ptr, pid * P, m, p, g, gm2 & _bcast(unit >= 0, g), G)
        _store_logits(score_ptr, pid * P + t, s, tm & _bcast(unit < 0, t), g, gm2, G)
    return m, l_i, acc


@triton.jit
def _pages(
    m, l_i, acc, q_ptr, perm_ptr, q_row, gm, arena8, arena16, arenadt, page_off_ptr,
    page_ntok_ptr, page_ids_ptr, k_table_ptr, page_unit_ptr, li, ps, pe, score_ptr, qk_scale, G,
    DT: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
    P: tl.constexpr, MASS: tl.constexpr, KBITS: tl.constexpr, IL: tl.constexpr = True,
):  # fmt: skip
    """Pages page_ids[ps:pe] of list li (one (request, head), V bit width VB; K channels at the
    widths in the bit mask KBITS).  Section offsets are 16-byte aligned (vector loads); IL:
    interleave unpacking; side output: one log2-sum-exp2 per head for a single-unit page, every
    token's logit otherwise."""
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
    # every section starts on a 16-byte boundary (layout.pad16)
    o_sc = tl.multiple_of(o_sc, 16)
    o_lo = tl.multiple_of(o_lo, 16)
    k_bytes = tl.multiple_of(k_bytes, 16)
    o2 = tl.multiple_of(o2, 16)
    o4 = tl.multiple_of(o4, 16)
    o8 = tl.multiple_of(o8, 16)
    o16 = tl.multiple_of(o16, 16)
    nq = n2 + n4 + n8
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
        # K sections by width, channels permuted so each width's channels are contiguous
        if KBITS & 2:
            s = _k_section(s, q_ptr, perm_row, q_row, gm, 0, n2, arena8, arena16, arenadt, base,
                           o2, o_sc, o_lo, DT, 2, D, G_PAD, P, IL)  # fmt: skip
        if KBITS & 4:
            s = _k_section(s, q_ptr, perm_row, q_row, gm, n2, n4, arena8, arena16, arenadt, base,
                           o4, o_sc, o_lo, DT, 4, D, G_PAD, P, IL)  # fmt: skip
        if KBITS & 8:
            s = _k_section(s, q_ptr, perm_row, q_row, gm, n2 + n4, n8, arena8, arena16, arenadt,
                           base, o8, o_sc, o_lo, DT, 8, D, G_PAD, P, IL)  # fmt: skip
        if KBITS & 16:
            s = _k_section(s, q_ptr, perm_row, q_row, gm, nq, n16, arena8, arena16, arenadt,
                           base, o16, o_sc, o_lo, DT, 16, D, G_PAD, P, IL)  # fmt: skip
        s = tl.where(tm[None, :], s * qk_scale, float("-inf"))
        m, l_i, acc = _attend_page(s, m, l_i, acc, arena8, arena16, arenadt, base + k_bytes, tm,
                                   t, g, pid, page_unit_ptr, score_ptr, G, DT, VB, VG, D, P,
                                   MASS, IL)  # fmt: skip
    return m, l_i, acc


@triton.jit
def _pages_u(
    m, l_i, acc, q, arena8, arena16, page_off_ptr, page_ntok_ptr, page_ids_ptr, page_unit_ptr,
    ps, pe, score_ptr, qk_scale, G, DT: tl.constexpr, B: tl.constexpr, VG: tl.constexpr,
    D: tl.constexpr, G_PAD: tl.constexpr, P: tl.constexpr, PPI: tl.constexpr, MASS: tl.constexpr,
    IL: tl.constexpr = True, MAGIC: tl.constexpr = False,
):  # fmt: skip
    """Uniform pages (K and V at B bits) page_ids[ps:pe], PPI per iteration.  Software
    pipeline: raw bytes of block i+1, offsets of block i+2 and ids of block i+3 are loaded
    while block i is computed.  MAGIC: codes dequantised without conversions (:mod:`_dequant`)."""
    kk = tl.arange(0, PPI)
    t = tl.arange(0, P)
    g = tl.arange(0, G_PAD)
    gm = g < G
    qd = q.to(DT)
    one = _magic_one(G)
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
        k = _u_k(ck, cks, ckl, DT, B, D, P, PPI, IL, MAGIC, one)
        s = tl.dot(qd, k) * qk_scale  # [G_PAD, PPI*P]
        tm = tl.reshape(t[None, :] < cur_ntok[:, None], (PPI * P,))
        s = tl.where(tm[None, :], s, float("-inf"))
        v = _u_v(cv, cvs, cvl, B, D, P, VG, PPI, IL, MAGIC, one)
        m, l_i, acc, p = _softmax_step(s, v, m, l_i, acc, DT)
        if MASS:
            single = cur_unit >= 0  # [PPI]: one log2-sum-exp2 per (page, head)
            psum = tl.sum(tl.reshape(p, (G_PAD, PPI, P)), 2)
            row0 = cur_ids * P
            tl.store(score_ptr + row0[None, :] * G + g[:, None], m[:, None] + tl.log2(psum),
                     mask=gm[:, None] & (single & (cur_ntok > 0))[None, :])  # fmt: skip
            rows = tl.reshape(row0[:, None] + t[None, :], (PPI * P,))
            multi = tl.reshape((~single)[:, None] & (t[None, :] < cur_ntok[:, None]), (PPI * P,))
            tl.store(score_ptr + rows[None, :] * G + g[:, None], s,
                     mask=gm[:, None] & multi[None, :])  # fmt: skip
    return m, l_i, acc


@triton.jit
def _pages_g(
    m, l_i, acc, q_ptr, perm_ptr, q_row, gm, arena8, arena16, arenadt, arena32, page_off_ptr,
    page_ntok_ptr, page_ids_ptr, k_table_ptr, page_unit_ptr, li, ps, pe, score_ptr, qk_scale, G,
    DT: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
    P: tl.constexpr, MASS: tl.constexpr, RAW_BF16: tl.constexpr, IL: tl.constexpr = True,
    PIPE: tl.constexpr = False,
):  # fmt: skip
    """General pages page_ids[ps:pe] of list li (V at VB bits, K channels at any widths) with K
    read as one gathered [D, P] tile (:func:`_k_gather`): the per-channel geometry and the
    permuted query are computed once per list, not per page and width section; one dot a page.
    The next page's id, offset and length are loaded one iteration ahead, or (PIPE) in the
    iteration that uses them, for Triton's pipeliner to stage."""
    w, word, o_sc, o_lo, k_bytes, nq = _k_geometry(k_table_ptr, li, D, P)
    ch = tl.load(perm_ptr + (li // 4) * D + tl.arange(0, D))
    qp = tl.load(q_ptr + q_row[:, None] + ch[None, :], mask=gm[:, None] & (w > 0)[None, :],
                 other=0.0).to(DT)  # fmt: skip
    t = tl.arange(0, P)
    g = tl.arange(0, G_PAD)
    nxt = tl.load(page_ids_ptr + ps, mask=ps < pe, other=0)
    nbase = tl.load(page_off_ptr + nxt, mask=ps < pe, other=0)
    nntok = tl.load(page_ntok_ptr + nxt, mask=ps < pe, other=0)
    for i in range(ps, pe):
        if PIPE:
            pid = tl.load(page_ids_ptr + i)
            base = tl.multiple_of(tl.load(page_off_ptr + pid), 16)
            ntok = tl.load(page_ntok_ptr + pid)
        else:
            pid = nxt
            base = tl.multiple_of(nbase, 16)
            ntok = nntok
            more = i + 1 < pe
            nxt = tl.load(page_ids_ptr + i + 1, mask=more, other=0)
            nbase = tl.load(page_off_ptr + nxt, mask=more, other=0)
            nntok = tl.load(page_ntok_ptr + nxt, mask=more, other=0)
        tm = t < ntok
        # ntok <= P < 2**16: a zero computed from the page (see _k_gather)
        k = _k_gather(arena32, arena16, base, w, word, o_sc, o_lo, nq, ntok >> 16, RAW_BF16, D,
                      P)  # fmt: skip
        s = tl.dot(qp, k.to(DT)) * qk_scale
        s = tl.where(tm[None, :], s, float("-inf"))
        m, l_i, acc = _attend_page(s, m, l_i, acc, arena8, arena16, arenadt, base + k_bytes, tm,
                                   t, g, pid, page_unit_ptr, score_ptr, G, DT, VB, VG, D, P,
                                   MASS, IL)  # fmt: skip
    return m, l_i, acc


@triton.jit
def _pages_up(
    m, l_i, acc, q, arena8, arena16, page_off_ptr, page_ntok_ptr, page_ids_ptr, page_unit_ptr,
    ps, pe, score_ptr, qk_scale, G, DT: tl.constexpr, B: tl.constexpr, VG: tl.constexpr,
    D: tl.constexpr, G_PAD: tl.constexpr, P: tl.constexpr, PPI: tl.constexpr, MASS: tl.constexpr,
    IL: tl.constexpr = True, MAGIC: tl.constexpr = False,
):  # fmt: skip
    """:func:`_pages_u` without the hand-written prefetch: each iteration loads its own ids,
    offsets and bytes, so Triton's pipeliner (num_stages) may stage the page bytes through
    shared memory (asynchronous copies: bytes in flight without holding registers)."""
    kk = tl.arange(0, PPI)
    t = tl.arange(0, P)
    g = tl.arange(0, G_PAD)
    gm = g < G
    qd = q.to(DT)
    one = _magic_one(G)
    for i in range(ps, pe, PPI):
        ok = i + kk < pe
        cur_ids = tl.load(page_ids_ptr + i + kk, mask=ok, other=0)
        base, cur_ntok, cur_unit = _u_meta(page_ids_ptr, page_off_ptr, page_ntok_ptr,
                                           page_unit_ptr, cur_ids, ok)  # fmt: skip
        ck, cks, ckl, cv, cvs, cvl = _u_raw(arena8, arena16, base, cur_ntok, B, D, P, VG, PPI,
                                            True)  # fmt: skip
        k = _u_k(ck, cks, ckl, DT, B, D, P, PPI, IL, MAGIC, one)
        s = tl.dot(qd, k) * qk_scale  # [G_PAD, PPI*P]
        tm = tl.reshape(t[None, :] < cur_ntok[:, None], (PPI * P,))
        s = tl.where(tm[None, :], s, float("-inf"))
        v = _u_v(cv, cvs, cvl, B, D, P, VG, PPI, IL, MAGIC, one)
        m, l_i, acc, p = _softmax_step(s, v, m, l_i, acc, DT)
        if MASS:
            single = cur_unit >= 0
            psum = tl.sum(tl.reshape(p, (G_PAD, PPI, P)), 2)
            row0 = cur_ids * P
            tl.store(score_ptr + row0[None, :] * G + g[:, None], m[:, None] + tl.log2(psum),
                     mask=gm[:, None] & (single & (cur_ntok > 0))[None, :])  # fmt: skip
            rows = tl.reshape(row0[:, None] + t[None, :], (PPI * P,))
            multi = tl.reshape((~single)[:, None] & (t[None, :] < cur_ntok[:, None]), (PPI * P,))
            tl.store(score_ptr + rows[None, :] * G + g[:, None], s,
                     mask=gm[:, None] & multi[None, :])  # fmt: skip
    return m, l_i, acc


@triton.jit
def _pages_b(
    m, l_i, acc, q_perm_ptr, arena8, arena16, arenadt, page_off_ptr,
    page_ntok_ptr, page_ids_ptr, k_table_ptr, page_unit_ptr, li, ps, pe, score_ptr, qk_scale, G,
    DT: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
    P: tl.constexpr, MASS: tl.constexpr, KBITS: tl.constexpr, IL: tl.constexpr, KC: tl.constexpr,
    PF: tl.constexpr, MAGIC: tl.constexpr = False,
):  # fmt: skip
    """General pages page_ids[ps:pe] of list li (V at VB bits; K channels grouped by width, the
    widths' channel counts from k_table) on one uniform path: for each width in KBITS (a
    compile-time loop) the channels of that width are dense [KC, P] blocks (:func:`_k_blocks`),
    so the K dot product is a few dense sub-blocks whatever the counts, and V is the list's
    compile-time width.  Pipeline: page i+1's bytes are prefetched (PF: 1 into L1, 2 into L2,
    0 off) and page i+2's id, offset and length loaded while page i is computed.  MAGIC: K and
    V codes dequantised without conversions (:mod:`_dequant`)."""
    kt = k_table_ptr + li * 12
    n2 = tl.load(kt + 0)
    n4 = tl.load(kt + 1)
    n8 = tl.load(kt + 2)
    n16 = tl.load(kt + 3)
    o2 = tl.multiple_of(tl.load(kt + 4), 16)
    o4 = tl.multiple_of(tl.load(kt + 5), 16)
    o8 = tl.multiple_of(tl.load(kt + 6), 16)
    o16 = tl.multiple_of(tl.load(kt + 7), 16)
    o_sc = tl.multiple_of(tl.load(kt + 8), 16)
    o_lo = tl.multiple_of(tl.load(kt + 9), 16)
    k_bytes = tl.multiple_of(tl.load(kt + 10), 16)
    if VB == 16:
        VBY: tl.constexpr = (P * D * 2 + 15) // 16 * 16
    else:
        VBY: tl.constexpr = ((P * D * VB // 8 + 15) // 16 * 16
                             + 2 * ((2 * P * D // VG + 15) // 16 * 16))  # fmt: skip
    qp_row = q_perm_ptr + (li // 4) * (G_PAD * D)  # this (request, head)'s permuted query
    t = tl.arange(0, P)
    g = tl.arange(0, G_PAD)
    one = _magic_one(G)
    id0 = tl.load(page_ids_ptr + ps, mask=ps < pe, other=0)
    off0 = tl.load(page_off_ptr + id0, mask=ps < pe, other=0)
    nt0 = tl.load(page_ntok_ptr + id0, mask=ps < pe, other=0)
    id1 = tl.load(page_ids_ptr + ps + 1, mask=ps + 1 < pe, other=0)
    off1 = tl.load(page_off_ptr + id1, mask=ps + 1 < pe, other=0)
    nt1 = tl.load(page_ntok_ptr + id1, mask=ps + 1 < pe, other=0)
    if PF != 0:
        _prefetch_page(arena8, off0, tl.where(ps < pe, k_bytes + VBY, 0), 128, PF)
    for i in range(ps, pe):
        pid = id0
        base = tl.multiple_of(off0, 16)
        ntok = nt0
        id0, off0, nt0 = id1, off1, nt1
        if PF != 0:
            _prefetch_page(arena8, off0, tl.where(i + 1 < pe, k_bytes + VBY, 0), 128, PF)
        more = i + 2 < pe
        id1 = tl.load(page_ids_ptr + i + 2, mask=more, other=0)
        off1 = tl.load(page_off_ptr + id1, mask=more, other=0)
        nt1 = tl.load(page_ntok_ptr + id1, mask=more, other=0)
        tm = t < ntok
        s = tl.zeros([G_PAD, P], dtype=tl.float32)
        if (KBITS & 2) != 0:
            s = _k_blocks(s, qp_row, 0, n2, arena8, arena16, arenadt, base,
                          o2, o_sc, o_lo, DT, 2, KC, G_PAD, P, D, IL, MAGIC, one)  # fmt: skip
        if (KBITS & 4) != 0:
            s = _k_blocks(s, qp_row, n2, n4, arena8, arena16, arenadt, base,
                          o4, o_sc, o_lo, DT, 4, KC, G_PAD, P, D, IL, MAGIC, one)  # fmt: skip
        if (KBITS & 8) != 0:
            s = _k_blocks(s, qp_row, n2 + n4, n8, arena8, arena16, arenadt,
                          base, o8, o_sc, o_lo, DT, 8, KC, G_PAD, P, D, IL, MAGIC, one)  # fmt: skip
        if (KBITS & 16) != 0:
            s = _k_blocks(s, qp_row, n2 + n4 + n8, n16, arena8, arena16,
                          arenadt, base, o16, o_sc, o_lo, DT, 16, KC, G_PAD, P, D, IL,
                          MAGIC, one)  # fmt: skip
        s = tl.where(tm[None, :], s * qk_scale, float("-inf"))
        m, l_i, acc = _attend_page(s, m, l_i, acc, arena8, arena16, arenadt, base + k_bytes, tm,
                                   t, g, pid, page_unit_ptr, score_ptr, G, DT, VB, VG, D, P,
                                   MASS, IL, MAGIC)  # fmt: skip
    return m, l_i, acc
