"""Triton code of the two-pass column attention mass (launcher and contract in ``colmass.py``).

Scores are kept in the log2 domain (``s * scale * log2(e)``) so both passes use ``exp2``.
Pass 1 writes one log-sum-exp per (query head, query row); pass 2 recomputes the same scores
block by block and adds ``exp2(s - lse)`` into its key block's columns, looping over the query
heads of its GQA group. Neither pass materialises a ``[Tq, Tk]`` matrix.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_q(q_ptr, offs_m, head, offs_d, Tq, D, sq0, sq1, sq2):
    ptrs = q_ptr + offs_m[:, None] * sq0 + head * sq1 + offs_d[None, :] * sq2
    return tl.load(ptrs, mask=(offs_m < Tq)[:, None] & (offs_d < D)[None, :], other=0.0)


@triton.jit
def _load_kt(k_ptr, offs_n, head, offs_d, Tk, D, sk0, sk1, sk2):
    ptrs = k_ptr + offs_n[None, :] * sk0 + head * sk1 + offs_d[:, None] * sk2
    return tl.load(ptrs, mask=(offs_n < Tk)[None, :] & (offs_d < D)[:, None], other=0.0)


@triton.jit
def _scores(q, kt, scale_log2, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton's CPU interpreter miscomputes bf16 tl.dot; never set on a GPU
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
    return tl.dot(q, kt, input_precision=PRECISION) * scale_log2


@triton.jit
def _visible(offs_m, offs_n, Tk, q_offset, CAUSAL: tl.constexpr):
    ok = (offs_n < Tk)[None, :]
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= (offs_m + q_offset)[:, None])
    return ok


@triton.jit(do_not_specialize=("Tq", "Tk", "q_offset"))
def _row_lse_kernel(
    q_ptr, k_ptr, lse_ptr, Tq, Tk, q_offset, scale_log2,
    sq0, sq1, sq2, sk0, sk1, sk2,
    D: tl.constexpr, G: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_q(q_ptr, offs_m, head, offs_d, Tq, D, sq0, sq1, sq2)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    end = Tk
    if CAUSAL:
        end = tl.minimum(Tk, q_offset + (pid_m + 1) * BLOCK_M)
    # Every row sees key 0 (causal needs q_offset >= 0), so m_i is finite after block 0.
    for n0 in range(0, end, BLOCK_N):
        offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        kt = _load_kt(k_ptr, offs_n, head // G, offs_d, Tk, D, sk0, sk1, sk2)
        s = _scores(q, kt, scale_log2, PRECISION, UPCAST)
        s = tl.where(_visible(offs_m, offs_n, Tk, q_offset, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(lse_ptr + head * Tq + offs_m, m_i + tl.log2(l_i), mask=offs_m < Tq)


@triton.jit(do_not_specialize=("Tq", "Tk", "q_offset"))
def _column_mass_kernel(
    q_ptr, k_ptr, lse_ptr, out_ptr, Tq, Tk, q_offset, scale_log2,
    sq0, sq1, sq2, sk0, sk1, sk2,
    D: tl.constexpr, G: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    kt = _load_kt(k_ptr, offs_n, kv_head, offs_d, Tk, D, sk0, sk1, sk2)

    acc = tl.zeros((BLOCK_N,), tl.float32)
    m_start = 0
    if CAUSAL:  # query rows before this block's first key see none of it
        m_start = (tl.maximum(pid_n * BLOCK_N - q_offset, 0) // BLOCK_M) * BLOCK_M
    for g in range(G):
        head = kv_head * G + g
        for m0 in range(m_start, Tq, BLOCK_M):
            offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            q = _load_q(q_ptr, offs_m, head, offs_d, Tq, D, sq0, sq1, sq2)
            lse = tl.load(lse_ptr + head * Tq + offs_m, mask=offs_m < Tq, other=float("inf"))
            s = _scores(q, kt, scale_log2, PRECISION, UPCAST)
            p = tl.exp2(s - lse[:, None])
            p = tl.where(_visible(offs_m, offs_n, Tk, q_offset, CAUSAL), p, 0.0)
            acc += tl.sum(p, axis=0)
    tl.store(out_ptr + kv_head * Tk + offs_n, acc, mask=offs_n < Tk)
