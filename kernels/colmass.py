"""Prefill-side scores: column attention mass (Triton, two passes) and RDKV channel norms.

``column_mass`` gives, for every key ``t`` of every KV head ``h``, the attention mass it receives
from all query rows and all query heads of its GQA group:
``out[h, t] = sum_{tau, hq in group h} softmax(q[tau, hq] . k[:, h] * scale)[t]``. This is the
RDKV V-token weight and the QEvict window score (summed over a window's tokens).

Pass 1 computes the row log-sum-exps flash-style (online max); pass 2 recomputes the scores
per ``[BLOCK_M, BLOCK_N]`` block and accumulates ``exp(s - lse)`` into columns. Extra memory is
``Hq * Tq + Hkv * Tk`` float32; compute is twice a flash-attention forward without the PV
product. The plain-PyTorch twin is ``tiered_radix.kernels.colmass_ref.column_mass_ref``.

``channel_norms`` / ``channel_weights`` are re-exported from the engine: they are single fused
``vector_norm`` reductions that read each element once, already bandwidth-bound.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from tiered_radix.kernels.colmass_ref import channel_norms, channel_weights, check_attention_inputs

from ._colmass_kernels import _column_mass_kernel, _row_lse_kernel

__all__ = ["channel_norms", "channel_weights", "column_mass"]

_LOG2E = 1.4426950408889634


def _blocks(tq: int, tk: int, d: int) -> dict[str, int]:
    # tl.dot needs every block dim >= 16; 64x64 keeps a d=128 fp32 tile pair within 64 KiB smem.
    return {
        "BLOCK_M": min(64, max(16, triton.next_power_of_2(tq))),
        "BLOCK_N": min(64, max(16, triton.next_power_of_2(tk))),
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
    }


def column_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_offset: int | None = None,
) -> torch.Tensor:
    """Attention mass per key, summed over query rows and GQA group heads.

    Args:
        q: ``[Tq, Hq, d]`` float16/bfloat16/float32 CUDA tensor (any strides).
        k: ``[Tk, Hkv, d]``, same dtype and device; ``Hq % Hkv == 0``.
        scale: softmax scale; default ``1 / sqrt(d)``.
        causal: mask keys after each query's absolute position ``q_offset + tau``.
        q_offset: absolute position of ``q[0]``; default ``Tk - Tq``. Must be >= 0 if causal.

    Returns:
        ``[Hkv, Tk]`` float32. Each causal row sums to 1, so ``out.sum() == Tq * Hq``.
    """
    g, q_offset = check_attention_inputs(q, k, causal, q_offset)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q/k dtype {q.dtype} is not supported; use float16, bfloat16 or float32")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if q.device.type != "cuda" and not interpreting:
        raise ValueError(
            f"q/k are on {q.device}; column_mass needs CUDA tensors. On CPU use "
            "tiered_radix.kernels.colmass_ref.column_mass_ref (same result)."
        )
    (tq, hq, d), (tk, hkv, _) = q.shape, k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty(hkv, tk, dtype=torch.float32, device=q.device)
    if tk == 0:
        return out
    if tq == 0:
        return out.zero_()
    lse = torch.empty(hq, tq, dtype=torch.float32, device=q.device)
    blocks = _blocks(tq, tk, d)
    common = dict(
        D=d,
        G=g,
        CAUSAL=bool(causal),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # ignored for 16-bit inputs
        UPCAST=interpreting and q.dtype == torch.bfloat16,
        num_warps=4,
        **blocks,
    )
    args = (tq, tk, q_offset, scale * _LOG2E, *q.stride(), *k.stride())
    _row_lse_kernel[(triton.cdiv(tq, blocks["BLOCK_M"]), hq)](q, k, lse, *args, **common)
    _column_mass_kernel[(triton.cdiv(tk, blocks["BLOCK_N"]), hkv)](q, k, lse, out, *args, **common)
    return out
