"""Shared @triton.jit helpers of the TriZone decode kernels: page loaders, K/V dequantisation,
the online-softmax update and side-output stores (kernels in _decode_split/_merge/_mass.py).

Logits live in the log2 domain (q.k * sm_scale * log2(e)) so every exponential is an exp2.
DT is the dtype of tl.dot operands: the cache dtype on GPU; float32 under the CPU
interpreter, whose bf16 tl.dot is wrong (Triton 3.9).  Softmax state starts at m = -1e30
(finite), so fully masked tiles give p = 0, never NaN.  Compile-time sizes are constexpr
arithmetic, never a @triton.jit call: Triton 3.6 returns a tensor from such a call even with
constexpr arguments (the uniform-page CompilationError of GPU run 3, bench/decode_notes.md).
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
            IL: tl.constexpr = True):  # fmt: skip
    """V [P, D] of the page whose V part starts at byte vbase (rows where tm), VB bits."""
    c = tl.arange(0, D)
    t = tl.arange(0, P)
    if VB == 16:
        v = tl.load(arenadt + vbase // 2 + t[:, None] * D + c[None, :], mask=tm[:, None],
                    other=0.0)  # fmt: skip
    else:
        PER: tl.constexpr = 8 // VB
        NG: tl.constexpr = D // VG
        cb = tl.arange(0, D // PER)
        byte = tl.load(arena8 + vbase + t[:, None] * (D // PER) + cb[None, :], mask=tm[:, None],
                       other=0)  # fmt: skip
        if IL:
            code = tl.reshape(_unpack_il(byte, VB).to(tl.float32), (P, NG, VG))
        else:
            code = tl.reshape(_unpack(byte, VB, P, D // PER).to(tl.float32), (P, NG, VG))
        CB: tl.constexpr = (P * D // PER + 15) // 16 * 16
        MB: tl.constexpr = (2 * P * D // VG + 15) // 16 * 16
        mo = (vbase + CB) // 2 + t[:, None] * NG + tl.arange(0, NG)[None, :]
        sc = tl.load(arena16 + mo, mask=tm[:, None], other=0.0).to(tl.float32)
        lo = tl.load(arena16 + mo + MB // 2, mask=tm[:, None], other=0.0).to(tl.float32)
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
           VG: tl.constexpr, PPI: tl.constexpr):  # fmt: skip
    """Raw bytes of PPI uniform pages at base [PPI]: K codes [D, PPI, P*B/8], K scale/lo
    [D, PPI] f16, V codes [PPI, P, D*B/8], V scale/lo [PPI, P, D/VG] f16."""
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
