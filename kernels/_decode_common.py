"""Shared @triton.jit helpers of the TriZone decode kernels: page loaders, K/V dequantisation,
the online-softmax update and side-output stores (kernels in _decode_split/_merge/_mass.py).

Logits live in the log2 domain (q.k * sm_scale * log2(e)) so every exponential is an exp2.
DT is the dtype of tl.dot operands: the cache dtype on GPU; float32 under the CPU
interpreter, whose bf16 tl.dot is wrong (Triton 3.9).  Softmax state starts at m = -1e30
(finite), so fully masked tiles give p = 0, never NaN.  Compile-time sizes are constexpr
arithmetic, never a @triton.jit call: Triton 3.6 returns a tensor from such a call even with
constexpr arguments (a CompilationError otherwise: bench/decode_notes.md).
"""

from __future__ import annotations

import triton
import triton.language as tl
from tiered_radix.kernels._dequant import _magic_codes, _magic_consts

NEG = tl.constexpr(-1.0e30)


@triton.jit
def _split_range(s, e, j, S):
    n = e - s
    return s + n * j // S, s + n * (j + 1) // S


@triton.jit
def _bcast(flag, like):
    """Scalar bool flag as a bool tensor shaped like the int tensor like (the CPU interpreter
    turns tensor & scalar-bool into ints, which masks reject)."""
    return (like * 0 + flag.to(tl.int32)) > 0


@triton.jit
def _unpack(byte, BITS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr):
    """Packed uint8 [R, NB] -> int32 codes [R, NB * 8 // BITS], first code in the lowest bits."""
    PER: tl.constexpr = 8 // BITS
    sh = tl.arange(0, PER) * BITS
    x = (byte.to(tl.int32)[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(x, (R, NB * PER))


@triton.jit
def _unpack_rows(byte, BITS: tl.constexpr, A: tl.constexpr, R: tl.constexpr, NB: tl.constexpr):
    """Packed uint8 [A, R, NB] -> int32 [A, R, NB * 8 // BITS] through :func:`_unpack`."""
    PER: tl.constexpr = 8 // BITS
    x = _unpack(tl.reshape(byte, (A * R, NB)), BITS, A * R, NB)
    return tl.reshape(x, (A, R, NB * PER))


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
def _softmax_step(s, v, m, l_i, acc, DT: tl.constexpr):
    """Online softmax over logits s [G_PAD, N] and values v [N, D]; also returns
    p = exp2(s - m_new) [G_PAD, N] (the side output's per-tile sums)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT))
    return m_new, l_i, acc, p


@triton.jit
def _store_logits(score_ptr, rows, s, ok, g, gm, G):
    """score[rows[n], g] = s[g, n] where ok[n] and gm[g] (side output, per token)."""
    tl.store(score_ptr + rows[None, :] * G + g[:, None], s, mask=ok[None, :] & gm[:, None])


@triton.jit
def _store_lse(score_ptr, row, m, p, g, mask, G):
    """score[row, g] = log2(sum_n exp2(s[g, n])) = m + log2(sum p): one value per head for a
    tile whose tokens share one unit (the side output)."""
    tl.store(score_ptr + row * G + g, m + tl.log2(tl.sum(p, 1)), mask=mask)


@triton.jit
def _k_section(
    s, q_ptr, perm_ptr, q_row, gm, c0, n, arena8, arena16, arenadt, base, o_code, o_sc, o_lo,
    DT: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, P: tl.constexpr,
    IL: tl.constexpr = True,
):  # fmt: skip
    """s [G_PAD, P] plus the logits of the n permuted K channels c0..c0+n of the page at base,
    stored at KB bits (general pages; nothing when n == 0)."""
    if n > 0:
        c = tl.arange(0, D)
        t = tl.arange(0, P)
        cm = c < n
        ch = tl.load(perm_ptr + c0 + c, mask=cm, other=0)
        qs = tl.load(q_ptr + q_row[:, None] + ch[None, :], mask=gm[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        if KB == 16:
            raw = tl.load(arenadt + (base + o_code) // 2 + c[:, None] * P + t[None, :],
                          mask=cm[:, None], other=0.0)  # fmt: skip
            x = tl.dot(qs.to(DT), raw.to(DT))
        else:
            PER: tl.constexpr = 8 // KB
            tb = tl.arange(0, P // PER)
            byte = tl.load(arena8 + base + o_code + c[:, None] * (P // PER) + tb[None, :],
                           mask=cm[:, None], other=0)  # fmt: skip
            if IL:
                code = _unpack_il(byte, KB)
            else:
                code = _unpack(byte, KB, D, P // PER)
            sc = tl.load(arena16 + (base + o_sc) // 2 + c0 + c, mask=cm, other=0.0).to(tl.float32)
            lo = tl.load(arena16 + (base + o_lo) // 2 + c0 + c, mask=cm, other=0.0).to(tl.float32)
            # K per channel: k = code * sc + lo, so fold sc into q and lo into a per-head bias
            x = tl.dot((qs * sc[None, :]).to(DT), code.to(DT))
            x += tl.sum(qs * lo[None, :], 1)[:, None]
        s += x
    return s


@triton.jit
def _v_page(arena8, arena16, arenadt, vbase, tm, DT: tl.constexpr, VB: tl.constexpr,
            VG: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
            IL: tl.constexpr = True, MAGIC: tl.constexpr = False, one=0):  # fmt: skip
    """V [P, D] of the page whose V part starts at byte vbase (rows where tm), VB bits; MAGIC:
    codes dequantised without conversions (:mod:`_dequant`; one: :func:`_magic_one`)."""
    c = tl.arange(0, D)
    t = tl.arange(0, P)
    if VB == 16:  # (the hint survives Triton's pipeliner, which needs >= 4-byte pieces)
        vb2 = tl.multiple_of(vbase // 2, 8)
        v = tl.load(arenadt + vb2 + t[:, None] * D + c[None, :], mask=tm[:, None], other=0.0)
    else:
        PER: tl.constexpr = 8 // VB
        NG: tl.constexpr = D // VG
        cb = tl.arange(0, D // PER)
        byte = tl.load(arena8 + vbase + t[:, None] * (D // PER) + cb[None, :], mask=tm[:, None],
                       other=0)  # fmt: skip
        if IL:
            code = _unpack_il(byte, VB)
        else:
            code = _unpack(byte, VB, P, D // PER)
        if MAGIC:
            code = _magic_codes(code, VB, one)
        else:
            code = code.to(tl.float32)
        code = tl.reshape(code, (P, NG, VG))
        CB: tl.constexpr = (P * D // PER + 15) // 16 * 16
        MB: tl.constexpr = (2 * P * D // VG + 15) // 16 * 16
        mo = (vbase + CB) // 2 + t[:, None] * NG + tl.arange(0, NG)[None, :]
        sc = tl.load(arena16 + mo, mask=tm[:, None], other=0.0).to(tl.float32)
        lo = tl.load(arena16 + mo + MB // 2, mask=tm[:, None], other=0.0).to(tl.float32)
        if MAGIC:  # [P, NG]
            sc, lo = _magic_consts(sc, lo, VB)
        v = tl.reshape(code * sc[:, :, None] + lo[:, :, None], (P, D)).to(DT)
    return v


@triton.jit
def _u_meta(page_ids_ptr, page_off_ptr, page_ntok_ptr, page_unit_ptr, ids, ok):
    """Byte offset, valid tokens and unit of the pages ids [PPI] (0 tokens where not ok)."""
    base = tl.load(page_off_ptr + ids, mask=ok, other=0)
    ntok = tl.load(page_ntok_ptr + ids, mask=ok, other=0)
    unit = tl.load(page_unit_ptr + ids, mask=ok, other=-1)
    return tl.multiple_of(base, 16), ntok, unit


@triton.jit
def _u_raw(arena8, arena16, base, ntok, B: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
           VG: tl.constexpr, PPI: tl.constexpr, PAIRS: tl.constexpr = False):  # fmt: skip
    """Raw bytes of PPI uniform pages at base [PPI]: K codes [D, PPI, P*B/8], K scale/lo
    [D, PPI] f16, V codes [PPI, P, D*B/8], V scale/lo [PPI, P, D/VG] f16.  PAIRS: each
    scale/lo pair (adjacent sections) is one load of twice the elements, so a thread holds
    >= 4 contiguous bytes and Triton's pipeliner can copy it asynchronously like the codes."""
    NB: tl.constexpr = P * B // 8
    VNB: tl.constexpr = D * B // 8
    NG: tl.constexpr = D // VG
    OSC: tl.constexpr = (D * NB + 15) // 16 * 16  # section offsets as in layout.k/v_sections
    OLO: tl.constexpr = OSC + (2 * D + 15) // 16 * 16
    KBY: tl.constexpr = OLO + (2 * D + 15) // 16 * 16
    VSC: tl.constexpr = KBY + (P * VNB + 15) // 16 * 16
    VLO: tl.constexpr = VSC + (2 * P * NG + 15) // 16 * 16
    c = tl.arange(0, D)
    t = tl.arange(0, P)
    ok = ntok > 0
    b3 = base[None, :, None]
    kraw = tl.load(arena8 + b3 + (c * NB)[:, None, None] + tl.arange(0, NB)[None, None, :],
                   mask=ok[None, :, None], other=0)  # fmt: skip
    h2 = (base // 2)[None, :] + c[:, None]
    j2 = tl.arange(0, 2)
    if PAIRS:  # [2, D, PPI] then [2, PPI, P, NG]: row 0 the scales, row 1 the lows
        kp = tl.load(arena16 + OSC // 2 + j2[:, None, None] * ((OLO - OSC) // 2) + h2[None],
                     mask=ok[None, None, :], other=0.0).to(tl.float32)  # fmt: skip
        ksc = tl.sum(tl.where(j2[:, None, None] == 0, kp, 0.0), 0)
        klo = tl.sum(tl.where(j2[:, None, None] == 1, kp, 0.0), 0)
    else:
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
    if PAIRS:
        j4 = j2[:, None, None, None]
        vp = tl.load(arena16 + VSC // 2 + j4 * ((VLO - VSC) // 2) + m3[None],
                     mask=tm[None, :, :, None], other=0.0).to(tl.float32)  # fmt: skip
        vsc = tl.sum(tl.where(j4 == 0, vp, 0.0), 0)
        vlo = tl.sum(tl.where(j4 == 1, vp, 0.0), 0)
    else:
        vsc = tl.load(arena16 + m3 + VSC // 2, mask=tm[:, :, None], other=0.0)
        vlo = tl.load(arena16 + m3 + VLO // 2, mask=tm[:, :, None], other=0.0)
    return kraw, ksc, klo, vraw, vsc, vlo


@triton.jit
def _u_k(kraw, ksc, klo, DT: tl.constexpr, B: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
         PPI: tl.constexpr, IL: tl.constexpr, MAGIC: tl.constexpr, one):  # fmt: skip
    """K [D, PPI * P] in DT of PPI uniform pages from :func:`_u_raw`'s K codes [D, PPI, P*B/8]
    and scale/lo [D, PPI]: k = code * scale + lo per (channel, page) (MAGIC: without
    conversions, :mod:`_dequant`; one: :func:`_magic_one`)."""
    if IL:
        code = _unpack_il(kraw, B)  # [D, PPI, P]
    else:
        code = _unpack_rows(kraw, B, D, PPI, P * B // 8)
    if MAGIC:
        mul, add = _magic_consts(ksc, klo, B)
        k = _magic_codes(code, B, one) * mul[:, :, None] + add[:, :, None]
    else:
        k = code.to(tl.float32) * ksc.to(tl.float32)[:, :, None] + klo.to(tl.float32)[:, :, None]
    return tl.reshape(k, (D, PPI * P)).to(DT)


@triton.jit
def _u_v(vraw, vsc, vlo, B: tl.constexpr, D: tl.constexpr, P: tl.constexpr, VG: tl.constexpr,
         PPI: tl.constexpr, IL: tl.constexpr, MAGIC: tl.constexpr, one):  # fmt: skip
    """V [PPI * P, D] float32 of PPI uniform pages from :func:`_u_raw`'s V codes
    [PPI, P, D*B/8] and scale/lo [PPI, P, D/VG]: v = code * scale + lo per (token, group of VG
    channels).  Rounded to DT by the softmax step, as before this helper: rounded here, the
    uncapped d128 kernel took 128 registers instead of 167 (Triton 3.6), a change of the
    default's code left to its own option."""
    NG: tl.constexpr = D // VG
    if IL:
        code = _unpack_il(vraw, B)  # [PPI, P, D]
    else:
        code = _unpack_rows(vraw, B, PPI, P, D * B // 8)
    if MAGIC:
        vc = tl.reshape(_magic_codes(code, B, one), (PPI, P, NG, VG))
        mul, add = _magic_consts(vsc, vlo, B)
        v = vc * mul[:, :, :, None] + add[:, :, :, None]
    else:
        vc = tl.reshape(code.to(tl.float32), (PPI, P, NG, VG))
        v = vc * vsc.to(tl.float32)[:, :, :, None] + vlo.to(tl.float32)[:, :, :, None]
    return tl.reshape(v, (PPI * P, D))


@triton.jit
def _k_geometry(k_table_ptr, li, D: tl.constexpr, P: tl.constexpr):
    """Per permuted K channel c of list li's pages (from k_table): bit width w [D] (0: dropped),
    first 32-bit word of its code row in a page, and the K part's scale/lo offsets, bytes and
    quantized-channel count.  A page's channels of width w form rows of P * w / 8 bytes in the
    width's section, so (channel, token) -> (word, shift) is a compile-time shape of run-time
    values: one [D, P] tile, whatever the widths' channel counts."""
    kt = k_table_ptr + li * 12
    e2 = tl.load(kt + 0)
    e4 = e2 + tl.load(kt + 1)
    e8 = e4 + tl.load(kt + 2)
    e16 = e8 + tl.load(kt + 3)
    c = tl.arange(0, D)
    w = tl.where(c < e2, 2, tl.where(c < e4, 4, tl.where(c < e8, 8, tl.where(c < e16, 16, 0))))
    c0 = tl.where(c < e2, 0, tl.where(c < e4, e2, tl.where(c < e8, e4, e8)))
    sec = tl.where(c < e2, tl.load(kt + 4), tl.where(c < e4, tl.load(kt + 5),
                   tl.where(c < e8, tl.load(kt + 6), tl.load(kt + 7))))  # fmt: skip
    word = (sec + (c - c0) * (P * w // 8)) // 4  # sections and rows are 4-byte aligned
    o_sc = tl.multiple_of(tl.load(kt + 8), 16)
    o_lo = tl.multiple_of(tl.load(kt + 9), 16)
    k_bytes = tl.multiple_of(tl.load(kt + 10), 16)
    return w, word, o_sc, o_lo, k_bytes, e8


@triton.jit
def _k_gather(arena32, arena16, base, w, word, o_sc, o_lo, nq, zero, RAW_BF16: tl.constexpr,
              D: tl.constexpr, P: tl.constexpr):  # fmt: skip
    """K [D, P] float32 (permuted channels; dropped ones 0) of the general page at byte base:
    one gathered load of the 32-bit word holding each (channel, token) code, then shift, mask
    and per-channel dequantisation (k = code * scale + lo), or the raw 16-bit value.
    zero: an int32 0 that the compiler cannot prove 0 (from the page's data): the [D, P] bit
    positions stay inside the page loop; hoisted as loop invariants they held ~75 registers a
    thread (sm_90, Triton 3.6: 244 -> 168 with one V width)."""
    c = tl.arange(0, D)
    t = tl.arange(0, P)
    bit = t[None, :] * (w + zero)[:, None]  # [D, P]
    raw = tl.load(arena32 + base // 4 + word[:, None] + bit // 32, mask=(w > 0)[:, None],
                  other=0)  # fmt: skip
    code = (raw >> (bit % 32)) & ((1 << w) - 1)[:, None]
    if RAW_BF16:
        r16 = (code << 16).to(tl.float32, bitcast=True)
    else:
        r16 = code.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    qm = c < nq
    sc = tl.load(arena16 + (base + o_sc) // 2 + c, mask=qm, other=0.0).to(tl.float32)
    lo = tl.load(arena16 + (base + o_lo) // 2 + c, mask=qm, other=0.0).to(tl.float32)
    deq = code.to(tl.float32) * sc[:, None] + lo[:, None]
    return tl.where((w == 16)[:, None], r16, deq)


@triton.jit
def _k_blocks(
    s, qp_row, c0, n, arena8, arena16, arenadt, base, o_code, o_sc, o_lo,
    DT: tl.constexpr, KB: tl.constexpr, KC: tl.constexpr, G_PAD: tl.constexpr, P: tl.constexpr,
    D: tl.constexpr, IL: tl.constexpr = True, MAGIC: tl.constexpr = False, one=0,
):  # fmt: skip
    """s [G_PAD, P] plus the logits of the n permuted K channels c0..c0+n of the page at base,
    all at KB bits (a compile-time width): dense [KC, P] blocks of KC consecutive channels, the
    last one masked; no per-channel width, branch or gather. A block's KC code rows are one
    contiguous span of the width's section (16-byte aligned), dequantised in registers
    (k = code * scale + lo, MAGIC: without conversions, one: :func:`_magic_one`; or the raw
    16-bit value) and multiplied by the query's permuted channels [G_PAD, KC]: one contiguous
    load from qp_row, the (request, head)'s query already in permuted channel order
    ([G_PAD, D], rows past the group zero; :func:`_q_perm_kernel`), L1-resident and
    independent of the page's bytes and of the permutation."""
    c = tl.arange(0, KC)
    t = tl.arange(0, P)
    g = tl.arange(0, G_PAD)
    for cb in range(0, n, KC):
        cm = cb + c < n
        qc = tl.load(qp_row + g[:, None] * D + (c0 + cb + c)[None, :],
                     mask=cm[None, :], other=0.0)  # fmt: skip
        if KB == 16:
            k = tl.load(arenadt + (base + o_code) // 2 + (cb + c)[:, None] * P + t[None, :],
                        mask=cm[:, None], other=0.0)  # fmt: skip
        else:
            PER: tl.constexpr = 8 // KB
            tb = tl.arange(0, P // PER)
            byte = tl.load(arena8 + base + o_code + (cb + c)[:, None] * (P // PER) + tb[None, :],
                           mask=cm[:, None], other=0)  # fmt: skip
            if IL:
                code = _unpack_il(byte, KB)
            else:
                code = _unpack(byte, KB, KC, P // PER)
            sc = tl.load(arena16 + (base + o_sc) // 2 + c0 + cb + c, mask=cm, other=0.0)
            lo = tl.load(arena16 + (base + o_lo) // 2 + c0 + cb + c, mask=cm, other=0.0)
            if MAGIC:
                mul, add = _magic_consts(sc, lo, KB)
                k = _magic_codes(code, KB, one) * mul[:, None] + add[:, None]
            else:
                k = code.to(tl.float32) * sc.to(tl.float32)[:, None] + lo.to(tl.float32)[:, None]
        s += tl.dot(qc.to(DT), k.to(DT))
    return s


@triton.jit
def _prefetch_page(arena8, base, nbytes, NSEC: tl.constexpr, LEVEL: tl.constexpr):
    """Ask the memory system for the page bytes arena8[base : base + nbytes], one 32-byte sector
    a lane, NSEC lanes an iteration, ahead of their loads: into L1 (LEVEL 1) or L2 (2).
    PTX prefetch has no result and no effect on values; lanes past the page repeat its first
    sector.  CUDA only (inline PTX): the plan turns it off under the interpreter."""
    for at in range(0, nbytes, NSEC * 32):
        sec = at + tl.arange(0, NSEC) * 32
        ptr = arena8 + base + tl.where(sec < nbytes, sec, 0)
        if LEVEL == 1:
            tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [ptr], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [ptr], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
