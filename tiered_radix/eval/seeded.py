"""One policy's run from a shared :class:`~.prefill.Prefill`: seed a cache, route, decode.

:class:`SeededCache` is the adapter's :class:`TieredCache` (same store, same step and routing
logic, driven through its public ``begin``/``finish_step``) with two differences in *how* the
attention input is produced, neither in *what* it is:

- ``seed(prefill)`` appends the captured K/V and observes the captured signals layer by layer,
  as the adapter's prefill forward would, then closes the prefill step (``after_prefill``
  routing);
- each layer keeps the store's view between routing steps and appends the new token's row to it
  (new tokens are full precision until the next routing), instead of rebuilding the whole
  dequantized view every step; ``verify=True`` checks it against ``store.view`` at every step.

Attention runs through :func:`eval_attention` (registered as :data:`EVAL_NAME`): ``exact`` calls
the adapter's ``attend`` on the same inputs as the adapter (so a shared-prefill run equals an
independent run token for token, ``tests/eval/test_shared_prefill.py``); ``fast`` runs a decode
step as two batched matmuls in float32 on the float32 view (no query-row chunk loop, no per-step
NaN masking). A :class:`~.probes.DecodeProbe`, when given, measures FMM/LIR/churn on the side.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from tiered_radix.adapters.transformers.attention import AdapterError, attention_implementation
from tiered_radix.adapters.transformers.cache import TieredCache, TieredLayer
from tiered_radix.engine.attention import attend
from tiered_radix.engine.signals import Signals

from .prefill import Prefill
from .probes import DecodeProbe

EVAL_NAME = "tiered_radix_eval"
RESERVE = 128  # view rows allocated ahead of the decoded tokens
_handoff = threading.local()


class SeededLayer(TieredLayer):
    """A layer whose store view is cached between routing steps (see the module docstring)."""

    def __init__(self, cache: SeededCache, index: int) -> None:
        super().__init__(cache, index)
        self._k = self._v = self._kept = None
        self._n, self._routes = 0, -1

    def update(self, key_states, value_states, *args, **kwargs):
        """Append ``[1, H, t, d]`` keys/values; return the cached view ``[1, H, T, d]``."""
        if key_states.shape[0] != 1:
            raise AdapterError(f"the tiered cache runs batch 1, got {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache: SeededCache = self.cache
        store = cache.begin(self.index, key_states)
        store.append(self.index, key_states[0], value_states[0])
        t = self._extend(store, key_states[0], value_states[0])
        if cache.probe is not None:
            cache.probe.append(self.index, key_states[0])
        k, v, self.kept = self._k[:, :t], self._v[:, :t], self._kept[:, :t]
        if not cache.fast:  # the adapter hands attention the view in the model's dtype
            k, v = k.to(key_states.dtype), v.to(value_states.dtype)
        self.keys, self.values = k[None], v[None]
        _handoff.layer = self
        return self.keys, self.values

    def _extend(self, store, k_new: Tensor, v_new: Tensor) -> int:
        t, routes = store.n_tokens(self.index), len(store.events.steps)
        n = t - k_new.shape[1]
        if self._k is None or routes != self._routes or n != self._n:
            k, v, kept = store.view(self.index)
            if self.cache.fast:  # evicted rows are NaN: zero them once, not every step
                k, v = (torch.where(kept[..., None], x, 0.0) for x in (k, v))
            h, _, d = k.shape
            self._k, self._v = k.new_empty(h, t + RESERVE, d), v.new_empty(h, t + RESERVE, d)
            self._kept = kept.new_ones(h, t + RESERVE)
            self._k[:, :t], self._v[:, :t], self._kept[:, :t] = k, v, kept
            self._routes = routes
        else:
            if t > self._k.shape[1]:
                self._k, self._v, self._kept = (_grow(x, t + RESERVE) for x in
                                                (self._k, self._v, self._kept))  # fmt: skip
            self._k[:, n:t], self._v[:, n:t] = k_new.float(), v_new.float()
            self._kept[:, n:t] = True
        self._n = t
        if self.cache.verify:
            self._check(store, t)
        return t

    def _check(self, store, t: int) -> None:
        k, v, kept = store.view(self.index)
        assert torch.equal(kept, self._kept[:, :t]), "cached kept mask drifted from the store"
        for mine, ref in ((self._k, k), (self._v, v)):
            ref = ref.masked_fill(~kept[..., None], 0.0)
            assert torch.equal(mine[:, :t].masked_fill(~kept[..., None], 0.0), ref), (
                f"layer {self.index}: cached view drifted from store.view"
            )


def _grow(x: Tensor, n: int) -> Tensor:
    out = x.new_ones(x.shape[0], n, *x.shape[2:])
    out[:, : x.shape[1]] = x
    return out


class SeededCache(TieredCache):
    """A :class:`TieredCache` of :class:`SeededLayer` that can be seeded from a prefill.

    ``fast``: the batched-matmul decode attention; ``probe``: diagnostics; ``verify``: check the
    cached views against the store at every step (tests).
    """

    def __init__(self, policy, config, *, fast=False, probe: DecodeProbe | None = None,
                 verify=False) -> None:  # fmt: skip
        super().__init__(policy, config)
        self.fast, self.probe, self.verify = fast, probe, verify
        self.layers = [SeededLayer(self, i) for i in range(self.n_layers)]

    def seed(self, prefill: Prefill) -> None:
        """Feed ``prefill`` as the adapter's prefill forward would, then route after it."""
        if self.n_tokens():
            raise AdapterError("seed() needs an empty cache")
        for li, (k, v, sig) in enumerate(
            zip(prefill.keys, prefill.values, prefill.signals, strict=True)
        ):
            self.layers[li].lazy_initialization(k[None], v[None])
            store = self.begin(li, k[None])
            store.append(li, k, v)
            extra = {n: getattr(sig, n) for n in self.prefill_needs}
            store.observe(li, Signals(attn=sig.attn, **extra))
        self.finish_step()

    def finish_step(self):
        out = super().finish_step()
        if self.probe is not None and self.store is not None:
            self.probe.routed(self.store)
        return out


def _decode_attend(q: Tensor, k: Tensor, v: Tensor, kept: Tensor, scale: float):
    """One query row: ``q [Hq, 1, d]``; float32 ``k, v [H, T, d]`` with evicted rows zeroed."""
    h, _, d = k.shape
    qg = q.float().reshape(h, -1, d)
    s = torch.bmm(qg, k.transpose(1, 2)).mul_(scale).masked_fill_(~kept[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    return torch.bmm(p, v).reshape(q.shape[0], 1, d), Signals(attn=p.sum(1))


def eval_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """``AttentionInterface`` entry for :class:`SeededCache` (batch 1): ``query [1, Hq, tq, d]``
    -> ``([1, tq, Hq, d], None)``."""
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is None or layer.keys is not key:
        raise AdapterError(f"{EVAL_NAME} attention runs only on a SeededCache")
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    q, tq = query[0], query.shape[2]
    if layer.cache.fast and tq == 1:
        out, signals = _decode_attend(q, key[0], value[0], layer.kept, scale)
    else:
        out, signals = attend(q, key[0], value[0], layer.kept, scale, need=layer.needs(tq))
    kept = layer.kept
    layer.observe(signals)
    if layer.cache.probe is not None and tq == 1:
        layer.cache.probe.attend(layer.index, q, kept, scale)
    return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None


@contextmanager
def eval_attention_on(model) -> Iterator[None]:
    from transformers import AttentionInterface

    AttentionInterface.register(EVAL_NAME, eval_attention)
    with attention_implementation(model, EVAL_NAME):
        yield


def run_seeded(
    model,
    prefill: Prefill,
    policy,
    max_new_tokens: int,
    eos: Collection[int],
    *,
    fast: bool = False,
    probe: DecodeProbe | None = None,
    done: Callable[[list[int]], bool] | None = None,
    verify: bool = False,
) -> tuple[list[int], SeededCache, dict]:
    """Greedy decode under ``policy`` from ``prefill``, as ``ChatSession.ask_ids`` decodes: stop
    at an ``eos`` id (not kept) or after ``max_new_tokens`` (the last token is then fed too);
    also stop when ``done(ids)`` (the last id kept, not fed). Returns (ids, cache, stats)."""
    t0 = time.perf_counter()
    cache = SeededCache(policy, model.config, fast=fast, probe=probe, verify=verify)
    cache.seed(prefill)
    out: list[int] = []
    logits, stopped, step = prefill.logits, False, None
    with torch.no_grad(), eval_attention_on(model):
        for i in range(max_new_tokens):
            if i:
                logits = model(input_ids=step, past_key_values=cache, use_cache=True,
                               logits_to_keep=1).logits[0, -1]  # fmt: skip
            token = int(logits.argmax())
            if token in eos:
                break
            out.append(token)
            step = torch.tensor([[token]], dtype=torch.long, device=model.device)
            if done is not None and done(out):
                stopped = True
                break
        else:
            model(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.finish_step()
    stats = {
        "new_tokens": len(out), "prefill_tokens": prefill.n_tokens, "reused_tokens": 0,
        **{f"occupancy.{k}": v for k, v in cache.occupancy().items()},
        "bytes_used": cache.bytes_used(), "full_bytes": cache.full_bytes(),
        "budget_bytes": cache.budget_bytes(),
        "over_budget": any(s.over_budget for s in cache.store.events.steps),
        "seconds": time.perf_counter() - t0, "prefill_seconds": prefill.seconds,
        "shared_prefill": prefill.mode, "stopped_answered": stopped,
    }  # fmt: skip
    if probe is not None:
        stats.update(probe.summary())
    return out, cache, stats
