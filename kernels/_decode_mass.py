"""TriZone decode side-output kernel: attention mass per unit (window, token) from the split
kernel's stored values (one log2-sum-exp2 per single-unit tile, else one logit per token) and
the merged lse, accumulated with atomics into mass [B, max_units]."""

from __future__ import annotations

import triton
import triton.language as tl
from tiered_radix.kernels._decode_common import _split_range


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
def _mass_rows(score_ptr, units_ptr, mass_row, lse, g, gm, start, end, row0, row_mul, row_add,
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


# batch-dependent offsets, counts and index lists out of the compiled key (_decode_split.py)
@triton.jit(
    do_not_specialize=("mass_stride", "row_full", "row_fresh", "S"),
    do_not_specialize_on_alignment=(
        "mass_ptr", "full_indptr_ptr", "full_end_ptr", "full_units_ptr",
        "fresh_indptr_ptr", "fresh_units_ptr", "page_indptr_ptr", "page_ids_ptr",
        "page_ntok_ptr", "page_units_ptr", "page_unit_ptr",
    ),
)  # fmt: skip
def _decode_mass_kernel(
    score_ptr, lse_ptr, mass_ptr, mass_stride, full_indptr_ptr, full_end_ptr, full_units_ptr,
    fresh_indptr_ptr, fresh_units_ptr, page_indptr_ptr, page_ids_ptr, page_ntok_ptr,
    page_units_ptr, page_unit_ptr,
    row_full, row_fresh, H_KV, G, S, G_PAD: tl.constexpr, G_P2: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, NT: tl.constexpr, NBLK: tl.constexpr,
):  # fmt: skip
    """Side output of the split kernel: a single-unit tile (page or row block) holds one
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
    _mass_rows(score_ptr, full_units_ptr, mass_row, lse, g, gm, fs, fe, row_full, 1, 0, G,
                  BLOCK_N, NBLK)  # fmt: skip
    cs, ce = _split_range(tl.load(fresh_indptr_ptr + r), tl.load(fresh_indptr_ptr + r + 1), j, S)
    _mass_rows(score_ptr, fresh_units_ptr, mass_row, lse, g, gm, cs, ce, row_fresh, H_KV, h, G,
                  BLOCK_N, NBLK)  # fmt: skip
