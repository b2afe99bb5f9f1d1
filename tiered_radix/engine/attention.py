"""Causal GQA attention over a request's cached rows, and the signals the tier engine observes.

Every adapter attends through these reference functions where it gathers rows itself (the
transformers adapter always; the SGLang backend on extend, and on decode without the TriZone
kernel): :func:`attend` in float32 score blocks, :func:`attend_sdpa` through PyTorch's fused
``scaled_dot_product_attention`` in the inputs' dtype. Both return the output and the
:class:`~tiered_radix.engine.signals.Signals` a policy reads:

- ``attn [H, T]``: probability mass of the newest query row, summed over the group's query heads;
- only when named in ``need``: ``colmass [H, T]`` (summed over every query row), ``obs_attn
  [H, T]`` (the last :data:`OBS_WINDOW` rows), ``qnorm [H, d]``
  (:func:`~tiered_radix.kernels.colmass_ref.channel_norms` of the chunk's queries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tiered_radix.engine.signals import Signals
from tiered_radix.kernels.colmass_ref import channel_norms

OBS_WINDOW = 32  # SnapKV's observation window (engine/signals.py: "the last 32 prompt queries")


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kept: Tensor | None,
    scale: float,
    *,
    need: frozenset[str] = frozenset(),
    chunk_elems: int = 1 << 22,
) -> tuple[Tensor, Signals]:
    """Causal GQA attention of ``q [Hq, tq, d]`` (the last ``tq`` of ``T`` positions) over
    ``k, v [H, T, d]``; ``kept`` bool ``[H, T]`` or None (all kept; evicted rows may be NaN).

    Query head ``i`` reads KV head ``i // (Hq // H)``. Returns float32 ``out [Hq, tq, d]`` and the
    signals: ``attn`` always, ``colmass``/``obs_attn``/``qnorm`` when named in ``need``.
    ``chunk_elems`` bounds one score block (``Hq * rows * T`` float32 values).
    """
    (hq, tq, d), (h, t, _) = q.shape, k.shape
    g = hq // h
    assert g * h == hq and tq <= t, (q.shape, k.shape)
    kf, vf = k.float(), v.float()
    if kept is not None:  # evicted rows are NaN-poisoned: zero them before any product
        kf = kf.masked_fill(~kept[..., None], 0.0)
        vf = vf.masked_fill(~kept[..., None], 0.0)
    qg = q.float().reshape(h, g, tq, d)
    kt = kf.transpose(1, 2)[:, None]  # [H, 1, d, T]
    keys = torch.arange(t, device=q.device)
    out = torch.empty(h, g, tq, d, dtype=torch.float32, device=q.device)
    colmass = torch.zeros(h, t, device=q.device) if "colmass" in need else None
    obs = torch.zeros(h, t, device=q.device) if "obs_attn" in need else None
    rows = max(1, chunk_elems // (hq * t))
    for r0 in range(0, tq, rows):
        r1 = min(tq, r0 + rows)
        s = torch.matmul(qg[:, :, r0:r1], kt) * scale  # [H, G, c, T]
        pos = t - tq + torch.arange(r0, r1, device=q.device)
        masked = (keys[None, :] > pos[:, None])[None, None]
        if kept is not None:
            masked = masked | ~kept[:, None, None, :]
        p = torch.softmax(s.masked_fill(masked, float("-inf")), dim=-1).nan_to_num(0.0)
        out[:, :, r0:r1] = torch.matmul(p, vf[:, None])
        if colmass is not None:
            colmass += p.sum((1, 2))
        if obs is not None and r1 > tq - OBS_WINDOW:
            obs += p[:, :, max(0, tq - OBS_WINDOW - r0) :].sum((1, 2))
    qnorm = None
    if "qnorm" in need:
        qnorm = _chunk_qnorm(q, k, kept)
    signals = Signals(attn=p[:, :, -1].sum(1), colmass=colmass, obs_attn=obs, qnorm=qnorm)
    return out.reshape(hq, tq, d), signals


def _chunk_qnorm(q: Tensor, k: Tensor, kept: Tensor | None) -> Tensor:
    """``qnorm [H, d]`` of the chunk's queries ``q [Hq, tq, d]`` (``channel_norms`` against the
    chunk's own keys, the last ``tq`` of ``k [H, T, d]``; evicted rows read 0)."""
    tq = q.shape[1]
    kn = k[:, k.shape[1] - tq :].float()
    if kept is not None:
        kn = kn.masked_fill(~kept[:, kept.shape[1] - tq :, None], 0.0)
    return channel_norms(q.transpose(0, 1), kn.transpose(0, 1).to(q.dtype))[0]


def attend_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kept: Tensor | None,
    scale: float,
    *,
    need: frozenset[str] = frozenset(),
    chunk_elems: int = 1 << 26,
) -> tuple[Tensor, Signals]:
    """:func:`attend`'s outputs and signals through ``scaled_dot_product_attention`` (a fused
    kernel on CUDA, in the inputs' dtype) instead of float32 score blocks: the same numbers up
    to that dtype's rounding. ``attn``/``obs_attn`` come from :func:`attend` on the last
    :data:`OBS_WINDOW` query rows (or the last row), ``qnorm`` as in :func:`attend`. ``colmass``
    needs every row's probabilities: with it in ``need`` this is :func:`attend` itself.
    ``chunk_elems`` bounds one call's mask (``Hq * rows * T``; :func:`attend`'s score block
    when it delegates) where a mask is needed (evicted keys, or queries that are not the whole
    sequence).
    """
    if "colmass" in need:
        return attend(q, k, v, kept, scale, need=need, chunk_elems=chunk_elems)
    (hq, tq, d), (h, t, _) = q.shape, k.shape
    g = hq // h
    assert g * h == hq and tq <= t, (q.shape, k.shape)
    out = torch.empty(hq, tq, d, dtype=torch.float32, device=q.device)
    # a whole prompt, nothing evicted: no mask, so flash (whose GQA needs 16-bit inputs on CUDA)
    fused_gqa = q.dtype in (torch.float16, torch.bfloat16) or not q.is_cuda
    if kept is None and tq == t and fused_gqa:
        o = F.scaled_dot_product_attention(
            q[None], k.to(q.dtype)[None], v.to(q.dtype)[None], is_causal=True, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        out.copy_(o[0])
    else:
        # A mask with enable_gqa sends SDPA to its math backend, which builds the whole
        # [Hq, rows, T] score matrix: expand K/V to the query heads instead, so the
        # memory-efficient kernel takes the masked rows.
        kq, vq = k.to(q.dtype), v.to(q.dtype)
        keep_q = None
        if kept is not None:  # evicted rows are NaN-poisoned: zero them, then mask them out
            kq = kq.masked_fill(~kept[..., None], 0.0)
            vq = vq.masked_fill(~kept[..., None], 0.0)
            keep_q = kept.repeat_interleave(g, 0)[None, :, None, :]  # [1, Hq, 1, T]
        kq, vq = kq.repeat_interleave(g, 0)[None], vq.repeat_interleave(g, 0)[None]
        keys = torch.arange(t, device=q.device)
        rows = max(1, chunk_elems // (hq * t))
        for r0 in range(0, tq, rows):
            r1 = min(tq, r0 + rows)
            pos = t - tq + torch.arange(r0, r1, device=q.device)
            causal = keys[None, :] <= pos[:, None]  # [rows, T], lower right
            mask = causal[None, None] if keep_q is None else causal[None, None] & keep_q
            o = F.scaled_dot_product_attention(q[None, :, r0:r1], kq, vq, attn_mask=mask,
                                               scale=scale)[0]  # fmt: skip
            out[:, r0:r1] = o.float().nan_to_num(0.0)  # a row with every key evicted: NaN -> 0
    tail = min(OBS_WINDOW if "obs_attn" in need else 1, tq)
    _, sig = attend(q[:, tq - tail :], k, v, kept, scale, need=need & {"obs_attn"})
    qnorm = None
    if "qnorm" in need:
        qnorm = _chunk_qnorm(q, k, kept)
    return out, Signals(attn=sig.attn, obs_attn=sig.obs_attn, qnorm=qnorm)
