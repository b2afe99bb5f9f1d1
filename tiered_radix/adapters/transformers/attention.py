"""The attention function transformers calls when a model runs on a :class:`TieredCache`.

Registered with ``AttentionInterface`` under :data:`ATTN_NAME`. The cache's ``update`` returns the
store's view of the layer (K post-RoPE; quantized units dequantized; evicted rows NaN) and hands
the layer over through a thread-local slot; this function takes it, masks evicted tokens, runs
causal grouped-query attention in float32 over query-row chunks (never a ``[Tq, T]`` matrix per
head beyond one chunk: :func:`tiered_radix.engine.attention.attend`), and feeds the store the
signals the policy reads (``attn`` always; ``colmass``/``obs_attn``/``qnorm`` on prefill chunks
only, and only if the policy reads them).

Without a tiered layer handed over (e.g. the model runs on a ``DynamicCache``) it is plain causal
attention over ``key``/``value``: the same numbers, no signals.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor

from tiered_radix.engine.attention import attend

ATTN_NAME = "tiered_radix"

_handoff = threading.local()


class AdapterError(ValueError):
    """The model or the call cannot run on the tiered cache; the message says what to change."""


def hand_over(layer) -> None:
    """Called by the cache's ``update``: ``layer`` has ``keys``, ``kept``, ``needs(tq)`` and
    ``observe(Signals)``; the next attention call whose ``key is layer.keys`` takes it."""
    _handoff.layer = layer


def _take(key: Tensor):
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    return layer if layer is not None and layer.keys is key else None


def tiered_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """``AttentionInterface`` entry: query ``[1, Hq, tq, d]``, key/value ``[1, H, T, d]``;
    returns ``([1, tq, Hq, d], None)``. ``attention_mask`` is not read (batch 1, causal; see the
    cache's module docstring); dropout is not applied (inference only)."""
    if query.shape[0] != 1:
        raise AdapterError(f"the tiered cache runs batch 1, got a batch of {query.shape[0]}")
    layer = _take(key)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    need = layer.needs(query.shape[2]) if layer is not None else frozenset()
    kept = layer.kept if layer is not None else None
    out, signals = attend(query[0], key[0], value[0], kept, scale, need=need)
    if layer is not None:
        layer.observe(signals)
    return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None


def register() -> None:
    """Register :func:`tiered_attention` with transformers under :data:`ATTN_NAME` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, tiered_attention)


@contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """Run ``model`` with the registered attention function ``name`` inside the block; restore
    its previous implementation afterwards."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def tiered_attention_on(model) -> Iterator[None]:
    """Run ``model`` with :func:`tiered_attention` inside the block (see
    :func:`attention_implementation`)."""
    register()
    with attention_implementation(model, ATTN_NAME):
        yield
