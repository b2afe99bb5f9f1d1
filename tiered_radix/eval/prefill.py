"""One full-precision prefill per sample, shared by every (policy, budget) decoded from it.

Why sharing is exact: the transformers adapter prefills a prompt in one chunk while every token
is still at full precision (a fresh store holds the rows it was given), and every shipped policy
routes only when that chunk ends (``schedule: after_prefill``; a schedule without it, or
``after_prefill(defer=true)``, routes at a decode step, also after the prefill). So the
prefill's attention outputs, the first token's logits, the cached K/V (post-RoPE) and the
signals the store observes do not depend on the policy; only routing and the decode that
follows do. :func:`capture` runs the model once and
keeps what a :class:`~tiered_radix.adapters.transformers.TieredCache` would have received;
:mod:`.seeded` builds each policy's store from it. (A multi-turn sample's later turns prefill
*over a compressed cache*, so only single-turn samples share a prefill.)

Two ways to compute it:

- ``exact``: the adapter's own :func:`~tiered_radix.adapters.transformers.attend` (float32,
  query-row chunks), so outputs, logits and signals equal an independent adapter run bit for bit
  (``tests/eval/test_shared_prefill.py``);
- ``fast``: ``attend_sdpa`` (``scaled_dot_product_attention``, flash on CUDA, for the outputs;
  ``attend`` on the last query rows for ``attn``/``obs_attn``), the Triton ``column_mass`` kernel
  (CUDA) or a chunked ``attend`` (CPU) for ``colmass``, and ``channel_norms`` for ``qnorm``: the
  same quantities up to floating-point rounding, at flash-attention cost.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.engine.attention import attend, attend_sdpa
from tiered_radix.engine.signals import Signals

CAPTURE_NAME = "tiered_radix_capture"
PREFILL_SIGNALS = frozenset({"colmass", "obs_attn", "qnorm"})
_active = threading.local()


@dataclass(frozen=True)
class Prefill:
    """A captured prompt prefill. ``keys``/``values``: per layer ``[H, T, d]`` in the model's
    dtype, keys post-RoPE; ``signals``: per layer, ``attn [H, T]`` plus whichever of
    ``colmass``/``obs_attn``/``qnorm`` were asked for; ``logits``: float ``[vocab]`` of the last
    prompt position."""

    ids: tuple[int, ...]
    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    signals: tuple[Signals, ...]
    logits: Tensor
    mode: str  # "exact" | "fast"
    seconds: float

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


class _Recorder:
    def __init__(self, n_layers: int, need: frozenset[str], fast: bool) -> None:
        self.need, self.fast = need, fast
        self.signals: list[Signals | None] = [None] * n_layers


def _fast_attend(q: Tensor, k: Tensor, v: Tensor, scale: float, need: frozenset[str]):
    """``attend``'s outputs and signals for a whole prompt (``q [Hq, T, d]``, ``k, v [H, T, d]``)
    without the float32 ``[Hq, T, T]`` pass: ``attend_sdpa`` (flash) and :func:`_column_mass`."""
    out, sig = attend_sdpa(q, k, v, None, scale, need=need - {"colmass"})
    colmass = _column_mass(q, k, v, scale) if "colmass" in need else None
    return out, dataclasses.replace(sig, colmass=colmass)


def _column_mass(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``[H, T]`` prompt column mass: the Triton kernel on CUDA, else chunked ``attend``."""
    if q.is_cuda:
        try:
            from tiered_radix.kernels.colmass import column_mass
        except ImportError:  # kernels not installed (a source checkout): large chunks instead
            pass
        else:
            return column_mass(q.transpose(0, 1), k.transpose(0, 1), scale=scale)
    chunk = 1 << (28 if q.is_cuda else 24)
    return attend(q, k, v, None, scale, need=frozenset({"colmass"}), chunk_elems=chunk)[1].colmass


def capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """``AttentionInterface`` entry while :func:`capture` runs: ``query [1, Hq, T, d]``,
    ``key/value [1, H, T, d]``; records the layer's signals, returns ``([1, T, Hq, d], None)``."""
    rec: _Recorder = _active.recorder
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    q, k, v = query[0], key[0], value[0]
    if rec.fast:
        out, signals = _fast_attend(q, k, v, scale, rec.need)
    else:
        out, signals = attend(q, k, v, None, scale, need=rec.need)
    rec.signals[module.layer_idx] = signals
    return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None


@contextmanager
def _capturing(model, rec: _Recorder) -> Iterator[None]:
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_NAME, capture_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    _active.recorder = rec
    try:
        yield
    finally:
        _active.recorder = None
        model.set_attn_implementation(previous)


def capture(model, ids: Sequence[int], need: frozenset[str], *, fast: bool = False) -> Prefill:
    """Prefill ``ids`` (batch 1, one chunk) and keep K/V, signals and the last logits.

    ``need``: which of :data:`PREFILL_SIGNALS` to compute (``attn`` always is).
    """
    from transformers import DynamicCache

    cfg = model.config.get_text_config()
    rec = _Recorder(cfg.num_hidden_layers, frozenset(need) & PREFILL_SIGNALS, fast)
    cache = DynamicCache(config=model.config)
    x = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    t0 = time.perf_counter()
    with torch.no_grad(), _capturing(model, rec):
        logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    assert all(s is not None for s in rec.signals), "a layer did not run the capture attention"
    layers = cache.layers
    return Prefill(
        ids=tuple(ids),
        keys=tuple(layer.keys[0] for layer in layers),
        values=tuple(layer.values[0] for layer in layers),
        signals=tuple(rec.signals),
        logits=logits.logits[0, -1],
        mode="fast" if fast else "exact",
        seconds=time.perf_counter() - t0,
    )
