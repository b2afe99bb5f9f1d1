"""TriZone decode merge kernel: log-sum-exp combination of the split kernel's partial states
into the attention output and the per-head log2-sum-exp2 (lse) the side output needs."""

from __future__ import annotations

import triton
import triton.language as tl
from tiered_radix.kernels._decode_common import NEG


@triton.jit(do_not_specialize=("S",))  # the split count changes with the batch
def _decode_merge_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, out_stride_b, out_stride_h, lse_ptr, H_KV, G, S,
    D: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
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
