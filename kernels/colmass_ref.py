"""Prefill-side attention statistics in plain PyTorch (any device; the CPU path of the engine).

``column_mass_ref`` is the memory-linear twin of ``tiered_radix.kernels.colmass.column_mass``:
it walks the query rows in chunks and holds one ``[Hq, chunk, Tk]`` score block at a time, never
a ``[Tq, Tk]`` matrix per head. ``channel_norms`` / ``channel_weights`` give the RDKV K-channel
weights ``w_c = ||Q[:, c]|| * ||K[:, c]|| / sqrt(d)``; they are used as-is by the kernels module.

Conventions: ``q[Tq, Hq, d]``, ``k[Tk, Hkv, d]``, ``Hq = G * Hkv``; query head ``hq`` reads KV
head ``hq // G`` (grouped-query attention as in ``repeat_kv``). Causal query ``tau`` sits at
absolute position ``q_offset + tau`` and sees keys ``t <= q_offset + tau``.
"""

from __future__ import annotations

import math

import torch


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, causal: bool, q_offset: int | None
) -> tuple[int, int]:
    """Validate ``q``/``k`` shapes; return ``(G, q_offset)`` with ``q_offset`` defaulted.

    Raises:
        TypeError: non-float tensors or mismatched dtypes.
        ValueError: wrong ranks, head dims, head counts or a negative causal ``q_offset``.
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q must be [Tq, Hq, d] and k [Tk, Hkv, d]; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if not q.is_floating_point() or q.dtype != k.dtype:
        raise TypeError(f"q and k must share a float dtype; got {q.dtype} and {k.dtype}")
    (tq, hq, d), (tk, hkv, dk) = q.shape, k.shape
    if d != dk:
        raise ValueError(f"head dims differ: q has d={d}, k has d={dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} query heads must be a multiple of Hkv={hkv} KV heads")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    q_offset = tk - tq if q_offset is None else int(q_offset)
    if causal and q_offset < 0:
        raise ValueError(
            f"causal q_offset={q_offset} < 0 puts query rows before the first key; pass the "
            "absolute position of q[0] (default Tk - Tq: the queries are the last Tq keys)"
        )
    return hq // hkv, q_offset


def column_mass_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    q_offset: int | None = None,
    chunk_elems: int = 1 << 24,
) -> torch.Tensor:
    """Attention mass each key receives: ``[Hkv, Tk]`` float32.

    ``out[h, t] = sum_{tau, hq in group h} softmax(q[tau, hq] . k[:, h] * scale)[t]``.
    ``chunk_elems`` bounds the score block (``Hq * rows * Tk`` float32 values).
    """
    g, q_offset = check_attention_inputs(q, k, causal, q_offset)
    (tq, hq, _), (tk, hkv, _) = q.shape, k.shape
    out = torch.zeros(hkv, tk, dtype=torch.float32, device=q.device)
    if tq == 0 or tk == 0:
        return out
    kt = k.float().permute(1, 2, 0)[:, None]  # [Hkv, 1, d, Tk]
    keys = torch.arange(tk, device=q.device)
    rows = max(1, chunk_elems // (hq * tk))
    for t0 in range(0, tq, rows):
        qc = q[t0 : t0 + rows].float()
        qc = qc.unflatten(1, (hkv, g)).permute(1, 2, 0, 3)  # [Hkv, G, C, d]
        s = torch.matmul(qc, kt) * scale  # [Hkv, G, C, Tk]
        if causal:
            pos = q_offset + t0 + torch.arange(qc.shape[2], device=q.device)
            s.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))
        out += torch.softmax(s, dim=-1).sum(dim=(1, 2))
    return out


def channel_norms(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel L2 norms: ``qn[Hkv, d]`` over query rows and group heads, ``kn[Hkv, d]``.

    Both float32. Each is one fused reduction (``vector_norm`` with an fp32 accumulator) that
    reads its input once, so a custom kernel cannot beat it by more than launch overhead.
    """
    g, _ = check_attention_inputs(q, k, causal=False, q_offset=0)
    qn = torch.linalg.vector_norm(q.unflatten(1, (-1, g)), dim=(0, 2), dtype=torch.float32)
    kn = torch.linalg.vector_norm(k, dim=0, dtype=torch.float32)
    return qn, kn


def channel_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """RDKV K-channel weights ``w[Hkv, d] = qn * kn / sqrt(d)`` (float32)."""
    qn, kn = channel_norms(q, k)
    return qn * kn / math.sqrt(q.shape[-1])
