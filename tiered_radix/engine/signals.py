"""Measurements a caller hands the engine for one layer, and the ones the engine derives itself.

The caller (SGLang adapter, transformers cache, simulator) provides what only attention can see
(:class:`Signals`); the engine computes ``knorm``, ``key_norm``, ``sigma``, ``recency`` and
``position`` from the cache it holds (:class:`CacheState`, built by the store).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.policy.expr import Name
from tiered_radix.policy.model import Policy


class SignalError(ValueError):
    """A policy needs a signal the caller never provided, or a signal has the wrong shape."""


TOKEN_SIGNALS = ("attn", "colmass", "obs_attn")  # the signals indexed by token, [H, T']
PREFILL_SIGNALS = ("colmass", "obs_attn", "qnorm")  # computed on prefill chunks, when read


@dataclass(frozen=True)
class Signals:
    """Signals of ONE layer, all on one device. H = KV heads, T = tokens cached so far.

    attn: float ``[H, T']`` (T' <= T; missing trailing tokens count 0): probability mass each
        token receives from the newest query (decode step, or the last prompt query after
        prefill), summed over the query heads of the KV group; computed over what the policy
        keeps (evicted tokens get 0).
    colmass: float ``[H, T_prompt]``: sum over prompt queries tau of ``a[tau, t]`` (RDKV ``w_t``).
    obs_attn: float ``[H, T_prompt]``: mass from the last 32 prompt queries (SnapKV).
    qnorm: float ``[H, d]``: per K channel, ``||Q[:, c]||`` over prompt queries of the group.
    """

    attn: Tensor | None = None
    colmass: Tensor | None = None
    obs_attn: Tensor | None = None
    qnorm: Tensor | None = None

    def check(self, n_heads: int, n_tokens: int, head_dim: int) -> None:
        """Raises :class:`SignalError` on a wrong shape."""
        for name in TOKEN_SIGNALS:
            x = getattr(self, name)
            if x is not None and (x.dim() != 2 or x.shape[0] != n_heads or x.shape[1] > n_tokens):
                raise SignalError(
                    f"signal '{name}' must be [H={n_heads}, T<={n_tokens}], got {list(x.shape)}"
                )
        if self.qnorm is not None and tuple(self.qnorm.shape) != (n_heads, head_dim):
            raise SignalError(
                f"signal 'qnorm' must be [H={n_heads}, d={head_dim}], got {list(self.qnorm.shape)}"
            )


def at_positions(signals: Signals, pos: Tensor, n_tokens: int) -> Signals:
    """The signals of attention over only the tokens ``pos [T']`` (ascending) of ``n_tokens``,
    each token signal put at its token's position and 0 elsewhere (what an evicted token
    receives); ``qnorm`` (per channel) as it is."""
    out = {}
    for name in TOKEN_SIGNALS:
        x = getattr(signals, name)
        if x is not None:
            out[name] = x.new_zeros(x.shape[0], n_tokens).index_copy_(1, pos[: x.shape[1]], x)
    return Signals(qnorm=signals.qnorm, **out)


def pad_tokens(x: Tensor, n_tokens: int, fill: float = 0.0) -> Tensor:
    """``[..., H, T']`` -> ``[..., H, n_tokens]``, float32, new tokens filled with ``fill``."""
    x = x.float()
    if x.shape[-1] >= n_tokens:
        return x[..., :n_tokens]
    return torch.nn.functional.pad(x, (0, n_tokens - x.shape[-1]), value=fill)


class CacheState:
    """What the engine reads from its own cache to derive signals, for one layer.

    k, v: float32 ``[H, T, d]`` the attended view (quantized units dequantized; evicted rows
    may hold anything); kept: bool ``[H, T]`` (False for evicted tokens). Give the tensors, or
    ``load() -> (k, v, kept)`` with ``n_tokens``/``head_dim``/``device`` to build them only when
    a policy reads a cache-derived signal.
    """

    def __init__(
        self,
        k: Tensor | None = None,
        v: Tensor | None = None,
        kept: Tensor | None = None,
        *,
        load=None,
        n_tokens: int | None = None,
        head_dim: int | None = None,
        device=None,
    ) -> None:
        self._kvm = None if k is None else (k, v, kept)
        self._load = load
        self.n_tokens = k.shape[1] if k is not None else n_tokens
        self.head_dim = k.shape[2] if k is not None else head_dim
        self.device = k.device if k is not None else torch.device(device)

    def _get(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._kvm is None:
            self._kvm = self._load()
        return self._kvm

    @property
    def k(self) -> Tensor:
        return self._get()[0]

    @property
    def v(self) -> Tensor:
        return self._get()[1]

    @property
    def kept(self) -> Tensor:
        return self._get()[2]

    def key_norm(self) -> Tensor:
        """``[H, T]``: ``||k_t||``, 0 for evicted tokens."""
        return torch.where(self.kept, torch.linalg.vector_norm(_clean(self.k), dim=-1), 0.0)

    def knorm(self) -> Tensor:
        """``[H, d]``: ``||K[:, c]||`` over the kept tokens."""
        return torch.linalg.vector_norm(_clean(self.k) * self.kept[..., None], dim=1)

    def channel_sigma(self) -> Tensor:
        """``[H, d]``: standard deviation of ``K[:, c]`` over the kept tokens."""
        w = self.kept[..., None].float()
        n = w.sum(1).clamp(min=1)
        k = _clean(self.k)
        mean = (k * w).sum(1) / n
        return (((k - mean[:, None]) ** 2 * w).sum(1) / n).sqrt()


def _clean(x: Tensor) -> Tensor:
    """Evicted rows are NaN-poisoned; derived signals treat them as 0 (they are masked anyway)."""
    return torch.nan_to_num(x.float(), nan=0.0)


def policy_reads(policy: Policy) -> set[str]:
    """Every name any expression of ``policy`` reads (signals, scores, constants): what an
    adapter's attention must compute (:data:`PREFILL_SIGNALS` only when read)."""
    return {n.id for e in policy.expressions() for n in e.walk() if isinstance(n, Name)}
