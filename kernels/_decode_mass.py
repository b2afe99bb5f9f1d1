"""TriZone decode side-output kernels: attention mass per unit (window, token) from the split
kernel's stored logits (v1: one per token; v2: one log2-sum-exp2 per single-unit tile) and the
merged lse, accumulated with atomics into mass [B, max_units]."""

from __future__ import annotations

import triton
import triton.language as tl
from tiered_radix.kernels._decode_common import _split_range


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
def _token_mass(score_ptr, mass_row, lse, g, rows, units_ptrs, ok, G):
    """mass_row[unit[n]] += sum_g exp2(score[rows[n], g] - lse[g]) for the tokens n where ok."""
    s = tl.load(score_ptr + rows[None, :] * G + g[:, None], mask=ok[None, :] & (g < G)[:, None],
                other=float("-inf"))  # fmt: skip
    p = tl.sum(tl.exp2(s - lse[:, None]), 0)
    u = tl.load(units_ptrs, mask=ok, other=0)
    _add_units(mass_row, u, p, ok)


@triton.jit
def _mass_rows(score_ptr, units_ptr, mass_row, lse, start, end, row0, row_mul, row_add, G,
               G_PAD: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    g = tl.arange(0, G_PAD)
    for i in range(start, end, BLOCK_N):
        n = i + tl.arange(0, BLOCK_N)
        _token_mass(score_ptr, mass_row, lse, g, row0 + n * row_mul + row_add, units_ptr + n,
                    n < end, G)  # fmt: skip


@triton.jit
def _decode_mass_kernel(
    score_ptr, lse_ptr, mass_ptr, mass_stride, full_indptr_ptr, full_end_ptr, full_units_ptr,
    fresh_indptr_ptr, fresh_units_ptr, page_indptr_ptr, page_ids_ptr, page_ntok_ptr,
    page_units_ptr, row_full,
    row_fresh, H_KV, G, S, G_PAD: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Side output: mass[r, unit] += sum over the group's heads of exp2(s - lse) per token."""
    rh = tl.program_id(0)
    j = tl.program_id(1)
    r = rh // H_KV
    h = rh % H_KV
    g = tl.arange(0, G_PAD)
    t = tl.arange(0, P)
    lse = tl.load(lse_ptr + rh * G_PAD + g)
    mass_row = mass_ptr + r.to(tl.int64) * mass_stride
    ps, pe = _split_range(tl.load(page_indptr_ptr + rh * 4), tl.load(page_indptr_ptr + rh * 4 + 4),
                          j, S)  # fmt: skip
    for i in range(ps, pe):
        pid = tl.load(page_ids_ptr + i)
        rows = pid * P + t
        _token_mass(score_ptr, mass_row, lse, g, rows, page_units_ptr + rows,
                    t < tl.load(page_ntok_ptr + pid), G)  # fmt: skip
    fs, fe = _split_range(tl.load(full_indptr_ptr + rh), tl.load(full_end_ptr + rh), j, S)
    _mass_rows(score_ptr, full_units_ptr, mass_row, lse, fs, fe, row_full, 1, 0, G, G_PAD, BLOCK_N)
    cs, ce = _split_range(tl.load(fresh_indptr_ptr + r), tl.load(fresh_indptr_ptr + r + 1), j, S)
    _mass_rows(score_ptr, fresh_units_ptr, mass_row, lse, cs, ce, row_fresh, H_KV, h, G, G_PAD,
               BLOCK_N)  # fmt: skip


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
    score_ptr, lse_ptr, mass_ptr, mass_stride, full_indptr_ptr, full_end_ptr, full_units_ptr,
    fresh_indptr_ptr, fresh_units_ptr, page_indptr_ptr, page_ids_ptr, page_ntok_ptr,
    page_units_ptr, page_unit_ptr,
    row_full, row_fresh, H_KV, G, S, G_PAD: tl.constexpr, G_P2: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, NT: tl.constexpr, NBLK: tl.constexpr,
):  # fmt: skip
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
    ps, pe = _split_range(tl.load(page_indptr_ptr + rh * 4), tl.load(page_indptr_ptr + rh * 4 + 4),
                          j, S)  # fmt: skip
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
    fs, fe = _split_range(tl.load(full_indptr_ptr + rh), tl.load(full_end_ptr + rh), j, S)
    _mass_rows_v2(score_ptr, full_units_ptr, mass_row, lse, g, gm, fs, fe, row_full, 1, 0, G,
                  BLOCK_N, NBLK)  # fmt: skip
    cs, ce = _split_range(tl.load(fresh_indptr_ptr + r), tl.load(fresh_indptr_ptr + r + 1), j, S)
    _mass_rows_v2(score_ptr, fresh_units_ptr, mass_row, lse, g, gm, cs, ce, row_fresh, H_KV, h, G,
                  BLOCK_N, NBLK)  # fmt: skip
