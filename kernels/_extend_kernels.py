"""TriZone extend (prefill) kernels: attention of a chunk's queries over the pool in place (with
the last query rows' attention sums where no column sums are asked for), and the signals pass
that turns the same scores into column sums with the first pass's lse.

Both read one layer's storage through per-(request, KV head) window lists (``extend.py``): row
windows are ``W`` contiguous full-precision rows of a row block (``rows_k[blk]``), page windows
are uniform INT-k TriZone pages dequantized in registers (``_decode_common._u_raw``). Queries are
tiles of ``BLOCK_M`` tokens of one request times the ``G_PAD`` query heads of one KV group, so a
window is loaded (and dequantized) once for the whole group. Logits are in the log2 domain.
"""

from __future__ import annotations

import triton
import triton.language as tl
from tiered_radix.kernels._decode_common import NEG, _softmax_step, _u_raw, _unpack_il, _unpack_rows


@triton.jit
def _q_rows(q_ptr, q_st, q_sh, q0, m0, tq, h, G, D: tl.constexpr, G_PAD: tl.constexpr,
            BLOCK_M: tl.constexpr):  # fmt: skip
    """Query tile rows r = token * G_PAD + g: q [BLOCK_M * G_PAD, D], token index, head g, ok."""
    r = tl.arange(0, BLOCK_M * G_PAD)
    tok = m0 + r // G_PAD
    g = r % G_PAD
    ok = (tok < tq) & (g < G)
    d = tl.arange(0, D)
    row = (q0 + tok).to(tl.int64) * q_st + (h * G + g) * q_sh
    q = tl.load(q_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    return q, tok, g, ok


@triton.jit
def _row_kv(rows_k, rows_v, ent_blk, ent_win, e, ok, seq, D: tl.constexpr, W: tl.constexpr,
            N: tl.constexpr):  # fmt: skip
    """Row windows at list entries e [N // W]: k, v [N, D] (0 past seq), positions [N], valid."""
    NW: tl.constexpr = N // W
    blk = tl.load(ent_blk + e, mask=ok, other=0).to(tl.int64)
    j = tl.load(ent_win + e, mask=ok, other=0)
    t = tl.arange(0, W)
    row = tl.reshape(blk[:, None] * W + t[None, :], (N,))
    pos = tl.reshape(j[:, None] * W + t[None, :], (N,))
    valid = tl.reshape(ok[:, None] & (t[None, :] < W), (N,)) & (pos < seq)
    d = tl.arange(0, D)
    # rows past seq in the last window are NaN-poisoned in the pool: never loaded
    k = tl.load(rows_k + row[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(rows_v + row[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    tl.static_assert(NW * W == N)
    return k, v, pos, valid


@triton.jit
def _page_kv(arena8, arena16, page_bytes, ent_blk, ent_win, e, ok, seq, D: tl.constexpr,
             W: tl.constexpr, PPI: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr,
             IL: tl.constexpr):  # fmt: skip
    """Page windows at list entries e [PPI]: kT [D, PPI * W] and v [PPI * W, D] dequantized
    (float32), positions [PPI * W], valid."""
    ids = tl.load(ent_blk + e, mask=ok, other=0).to(tl.int64)
    j = tl.load(ent_win + e, mask=ok, other=0)
    ntok = tl.where(ok, tl.minimum(tl.maximum(seq - j * W, 0), W), 0)
    base = tl.multiple_of(ids * page_bytes, 16)
    kraw, ksc, klo, vraw, vsc, vlo = _u_raw(arena8, arena16, base, ntok, VB, D, W, VG, PPI)
    if IL:
        kc = _unpack_il(kraw, VB).to(tl.float32)  # [D, PPI, W]
        vc = tl.reshape(_unpack_il(vraw, VB).to(tl.float32), (PPI, W, D // VG, VG))
    else:
        kc = _unpack_rows(kraw, VB, D, PPI, W * VB // 8).to(tl.float32)
        vc = tl.reshape(_unpack_rows(vraw, VB, PPI, W, D * VB // 8).to(tl.float32),
                        (PPI, W, D // VG, VG))  # fmt: skip
    k = kc * ksc.to(tl.float32)[:, :, None] + klo.to(tl.float32)[:, :, None]
    v = vc * vsc.to(tl.float32)[:, :, :, None] + vlo.to(tl.float32)[:, :, :, None]
    t = tl.arange(0, W)
    pos = tl.reshape(j[:, None] * W + t[None, :], (PPI * W,))
    valid = tl.reshape(t[None, :] < ntok[:, None], (PPI * W,))
    return tl.reshape(k, (D, PPI * W)), tl.reshape(v, (PPI * W, D)), pos, valid


# Arguments that change with the batch (list and tile counts, strides of per-batch buffers, and
# index tables sliced from one packed tensor, whose addresses move with the batch size) are out
# of the compiled key: otherwise each new combination of "== 1", "% 16 == 0" and "16-byte
# aligned" compiles the kernel again, in front of that batch's first token. The index tables
# are read one scalar at a time, so the alignment hint bought nothing.
_BATCH_INDEX = ("ent_blk", "ent_win", "n_rows", "n_pages", "q_start", "q_len", "seq_len")


@triton.jit
def _tile_sums(s, lse, pos, valid, qpos, tok, seen, tq, obs_ptr, attn_ptr, sig_row,
               OBS: tl.constexpr, LAST: tl.constexpr):  # fmt: skip
    """A tile's probabilities exp2(s - lse) of keys at pos (valid) for its rows ``seen``,
    summed over those rows and the group's heads: obs (every seen row: the last OBS_WINDOW)
    and attn (the last query), stored at sig_row + pos."""
    see = seen[:, None] & valid[None, :] & (pos[None, :] <= qpos[:, None])
    p = tl.where(see, tl.exp2(s - lse[:, None]), 0.0)
    at = sig_row + pos
    if OBS:
        tl.store(obs_ptr + at, tl.sum(p, 0), mask=valid)
    if LAST:
        tl.store(attn_ptr + at, tl.sum(tl.where((tok == tq - 1)[:, None], p, 0.0), 0), mask=valid)


@triton.jit(
    do_not_specialize=("list_stride", "qsq_sb", "sig_sr", "sig_sh"),
    do_not_specialize_on_alignment=_BATCH_INDEX
    + ("tile_b", "tile_m", "lse_ptr", "qsq_ptr", "obs_ptr", "attn_ptr", "sig_off"),
)
def _extend_attn_kernel(
    q_ptr, q_st, q_sh, out_ptr, o_st, o_sh, lse_ptr, rows_k, rows_v, arena8, arena16, page_bytes,
    ent_blk, ent_win, n_rows, n_pages, list_stride, tile_b, tile_m, q_start, q_len, seq_len,
    qk_scale, H_KV, G, qsq_ptr, qsq_sb, obs_ptr, attn_ptr, sig_sr, sig_sh, sig_off,
    DT: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    W: tl.constexpr, WPI: tl.constexpr, PPI: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr,
    PAGES: tl.constexpr, IL: tl.constexpr, QNORM: tl.constexpr, OBS: tl.constexpr,
    LAST: tl.constexpr, OBS_WINDOW: tl.constexpr,
):  # fmt: skip
    """One tile of BLOCK_M query tokens of one request x one KV head (all its query heads):
    online softmax over the request's page windows, then its row windows up to the tile's last
    query (causal: key position <= query position); writes out and lse (log2, per query row).
    QNORM: also the tile's sum of q^2 per channel over its rows (float32 [D]) at
    qsq[b, m0 // BLOCK_M, h] (row b at qsq_sb, then [tiles, H_KV, D] contiguous).
    OBS / LAST: a tile holding some of the request's last OBS_WINDOW query rows (LAST alone:
    its last row) reads its windows a second time with the final lse and writes those rows'
    ``obs_attn`` / ``attn`` at each key's position, in its own row of the signal buffers
    (float32 [rows, H_KV, T], request b's tile r-th from its end at row sig_off[b] + r): the
    signals pass of :func:`_extend_signals_kernel` without its launch, for policies that read
    no ``colmass``."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_b + tile)
    m0 = tl.load(tile_m + tile)
    q0 = tl.load(q_start + b)
    tq = tl.load(q_len + b)
    seq = tl.load(seq_len + b)
    q, tok, g, rok = _q_rows(q_ptr, q_st, q_sh, q0, m0, tq, h, G, D, G_PAD, BLOCK_M)
    if QNORM:  # rows outside the tile's tokens and group load as 0
        qf = q.to(tl.float32)
        at = b.to(tl.int64) * qsq_sb + ((m0 // BLOCK_M) * H_KV + h) * D + tl.arange(0, D)
        tl.store(qsq_ptr + at, tl.sum(qf * qf, 0))
    qd = q.to(DT)
    qpos = seq - tq + tok
    MR: tl.constexpr = BLOCK_M * G_PAD
    m = tl.full([MR], NEG, dtype=tl.float32)
    l_i = tl.zeros([MR], dtype=tl.float32)
    acc = tl.zeros([MR, D], dtype=tl.float32)
    li = b * H_KV + h
    base = li.to(tl.int64) * list_stride
    nr = tl.load(n_rows + li)
    if PAGES:
        npg = tl.load(n_pages + li)
        kk = tl.arange(0, PPI)
        for i in range(0, npg, PPI):
            e = i + kk
            ok = e < npg
            kt, v, pos, valid = _page_kv(arena8, arena16, page_bytes, ent_blk + base + nr,
                                         ent_win + base + nr, e, ok, seq, D, W, PPI, VB, VG,
                                         IL)  # fmt: skip
            s = tl.dot(qd, kt.to(DT)) * qk_scale
            s = tl.where(valid[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
            m, l_i, acc, _ = _softmax_step(s, v, m, l_i, acc, DT)
    # rows: windows in position order, the chunk's windows last and listed in every head, so
    # the windows after the tile's last query are the list's last nwin - 1 - qmax // W
    qmax = seq - tq + tl.minimum(m0 + BLOCK_M, tq) - 1
    re = nr - ((seq + W - 1) // W - 1 - qmax // W)
    ww = tl.arange(0, WPI)
    for i in range(0, re, WPI):
        e = i + ww
        k, v, pos, valid = _row_kv(rows_k, rows_v, ent_blk + base, ent_win + base, e, e < re, seq,
                                   D, W, WPI * W)  # fmt: skip
        s = tl.dot(qd, tl.trans(k.to(DT))) * qk_scale
        s = tl.where(valid[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m, l_i, acc, _ = _softmax_step(s, v, m, l_i, acc, DT)
    safe = tl.where(l_i > 0, l_i, 1.0)
    d = tl.arange(0, D)
    orow = (q0 + tok).to(tl.int64) * o_st + (h * G + g) * o_sh
    o = (acc / safe[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + orow[:, None] + d[None, :], o, mask=rok[:, None])
    lse = m + tl.log2(safe)
    tl.store(lse_ptr + (q0 + tok).to(tl.int64) * (H_KV * G) + h * G + g, lse, mask=rok)
    if OBS or LAST:
        first = tq - OBS_WINDOW if OBS else tq - 1  # the first row whose mass is summed
        if m0 + BLOCK_M > first:
            seen = rok & (tok >= first)
            run = (tq - 1) // BLOCK_M - m0 // BLOCK_M
            sig_row = (tl.load(sig_off + b) + run).to(tl.int64) * sig_sr + h * sig_sh
            if PAGES:
                npg2 = tl.load(n_pages + li)
                kk2 = tl.arange(0, PPI)
                for i in range(0, npg2, PPI):
                    e = i + kk2
                    kt, v, pos, valid = _page_kv(arena8, arena16, page_bytes, ent_blk + base + nr,
                                                 ent_win + base + nr, e, e < npg2, seq, D, W, PPI,
                                                 VB, VG, IL)  # fmt: skip
                    s = tl.dot(qd, kt.to(DT)) * qk_scale
                    _tile_sums(s, lse, pos, valid, qpos, tok, seen, tq, obs_ptr, attn_ptr,
                               sig_row, OBS, LAST)  # fmt: skip
            for i in range(0, re, WPI):
                e = i + ww
                k, v, pos, valid = _row_kv(rows_k, rows_v, ent_blk + base, ent_win + base, e,
                                           e < re, seq, D, W, WPI * W)  # fmt: skip
                s = tl.dot(qd, tl.trans(k.to(DT))) * qk_scale
                _tile_sums(s, lse, pos, valid, qpos, tok, seen, tq, obs_ptr, attn_ptr, sig_row,
                           OBS, LAST)  # fmt: skip


@triton.jit
def _column_sums(
    q_ptr, q_st, q_sh, lse_ptr, kt, pos, valid, q0, tq, seq, h, G, H_KV, qk_scale, r_lo,
    colmass_ptr, obs_ptr, attn_ptr, sig_row, split, n_split,
    DT: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    COLMASS: tl.constexpr, OBS: tl.constexpr, LAST: tl.constexpr, OBS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Probabilities exp2(s - lse) of keys kT [D, N] (positions pos, valid) for query tokens from
    r_lo on (those that can see a key: from the first key's position on), summed over the rows
    and query heads of the group: colmass (every row), obs (the last OBS_WINDOW), attn (the
    last); stored at sig_row + pos. Of those rows' blocks of BLOCK_M tokens, only the
    split-th of n_split equal runs (the sums of the runs add up to all rows')."""
    kd = kt.to(DT)
    first = tl.min(tl.where(valid, pos, 2147483647), 0)
    lo = tl.maximum(r_lo, first - (seq - tq))
    per = ((tq - lo + BLOCK_M - 1) // BLOCK_M + n_split - 1) // n_split  # blocks a split
    start = lo + split * per * BLOCK_M
    cm = tl.sum(tl.zeros_like(kt).to(tl.float32), 0)  # [N] (kt: rows bf16, pages float32)
    ob = cm
    la = cm
    for m0 in range(start, tl.minimum(start + per * BLOCK_M, tq), BLOCK_M):
        q, tok, g, rok = _q_rows(q_ptr, q_st, q_sh, q0, m0, tq, h, G, D, G_PAD, BLOCK_M)
        lse = tl.load(lse_ptr + (q0 + tok).to(tl.int64) * (H_KV * G) + h * G + g, mask=rok,
                      other=0.0)  # fmt: skip
        s = tl.dot(q.to(DT), kd) * qk_scale
        qpos = seq - tq + tok
        see = rok[:, None] & valid[None, :] & (pos[None, :] <= qpos[:, None])
        p = tl.where(see, tl.exp2(s - lse[:, None]), 0.0)
        if COLMASS:
            cm += tl.sum(p, 0)
        # obs and attn: only the blocks that hold their rows (the others would add zeros)
        if OBS:
            if m0 + BLOCK_M > tq - OBS_WINDOW:
                ob += tl.sum(tl.where((tok >= tq - OBS_WINDOW)[:, None], p, 0.0), 0)
        if LAST:
            if m0 + BLOCK_M >= tq:
                la += tl.sum(tl.where((tok == tq - 1)[:, None], p, 0.0), 0)
    at = sig_row + pos
    if COLMASS:
        tl.store(colmass_ptr + at, cm, mask=valid)
    if OBS:
        tl.store(obs_ptr + at, ob, mask=valid)
    if LAST:
        tl.store(attn_ptr + at, la, mask=valid)


@triton.jit(
    do_not_specialize=("list_stride", "sig_sr", "sig_sh", "TILES", "S_MAX"),
    do_not_specialize_on_alignment=_BATCH_INDEX
    + ("lse_ptr", "colmass_ptr", "obs_ptr", "attn_ptr", "split_off", "split_n"),
)
def _extend_signals_kernel(
    q_ptr, q_st, q_sh, lse_ptr, rows_k, rows_v, arena8, arena16, page_bytes, ent_blk, ent_win,
    n_rows, n_pages, list_stride, q_start, q_len, seq_len, colmass_ptr, obs_ptr, attn_ptr,
    sig_sr, sig_sh, split_off, split_n, qk_scale, H_KV, G, TILES, S_MAX,
    DT: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    W: tl.constexpr, WPI: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr, PAGES: tl.constexpr,
    IL: tl.constexpr, COLMASS: tl.constexpr, OBS: tl.constexpr, LAST: tl.constexpr,
    OBS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Program (request b, key tile k, split s) x KV head: the row windows and the page windows
    at list entries [k * WPI, (k + 1) * WPI) of list (b, h), each loaded once, against the s-th
    of split_n[b] runs of the query rows whose signals are asked for (every row with COLMASS,
    else the last OBS_WINDOW or the last); signals [rows, H, T_max] float32, request b's run s
    at row split_off[b] + s, at each key's position (positions in no list keep 0). Programs
    with s >= split_n[b] (up to S_MAX runs a request) do nothing."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = pid // (TILES * S_MAX)
    k0 = (pid // S_MAX % TILES) * WPI
    split = pid % S_MAX
    n_split = tl.load(split_n + b)
    if split < n_split:
        q0 = tl.load(q_start + b)
        tq = tl.load(q_len + b)
        seq = tl.load(seq_len + b)
        li = b * H_KV + h
        base = li.to(tl.int64) * list_stride
        nr = tl.load(n_rows + li)
        if COLMASS:
            r_lo = tq * 0
        elif OBS:
            r_lo = tl.maximum(tq - OBS_WINDOW, 0)
        else:
            r_lo = tq - 1
        sig_row = (tl.load(split_off + b) + split).to(tl.int64) * sig_sr + h * sig_sh
        e = k0 + tl.arange(0, WPI)
        if k0 < nr:
            k, v, pos, valid = _row_kv(rows_k, rows_v, ent_blk + base, ent_win + base, e, e < nr,
                                       seq, D, W, WPI * W)  # fmt: skip
            _column_sums(q_ptr, q_st, q_sh, lse_ptr, tl.trans(k), pos, valid, q0, tq, seq, h, G,
                         H_KV, qk_scale, r_lo, colmass_ptr, obs_ptr, attn_ptr, sig_row, split,
                         n_split, DT, D, G_PAD, BLOCK_M, COLMASS, OBS, LAST,
                         OBS_WINDOW)  # fmt: skip
        if PAGES:
            npg = tl.load(n_pages + li)
            if k0 < npg:
                kt, v, pos, valid = _page_kv(arena8, arena16, page_bytes, ent_blk + base + nr,
                                             ent_win + base + nr, e, e < npg, seq, D, W, WPI,
                                             VB, VG, IL)  # fmt: skip
                _column_sums(q_ptr, q_st, q_sh, lse_ptr, kt, pos, valid, q0, tq, seq, h, G,
                             H_KV, qk_scale, r_lo, colmass_ptr, obs_ptr, attn_ptr, sig_row,
                             split, n_split, DT, D, G_PAD, BLOCK_M, COLMASS, OBS, LAST,
                             OBS_WINDOW)  # fmt: skip
