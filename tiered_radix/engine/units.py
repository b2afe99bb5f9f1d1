"""Token <-> unit mapping for window, token and channel granularity, and protected masks.

Units are positional and identical for every KV head of a layer (each head has its own tier per
unit). With ``window(size=W)`` unit ``u`` holds tokens ``[u*W, (u+1)*W)``; ``token`` is ``W = 1``;
``channel`` units are the ``d`` K channels (RDKV's K side). A trailing window with fewer than ``W``
tokens is *partial*: it stays at full precision (zone C, like freshly appended tokens) until it
fills up, because a K channel group needs ``W`` tokens.

A unit is *protected* (always full precision, paid before anything else) when any of its tokens
is one of the first ``sinks`` or the last ``recent`` tokens, or when it is partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tiered_radix.policy.model import Granularity, Protect


@dataclass(frozen=True)
class UnitLayout:
    """How one part (K or V) of a layer is cut into units."""

    kind: str  # "window" | "token" | "channel"
    size: int  # tokens per unit (1 for token; unused for channel)
    head_dim: int

    @classmethod
    def of(cls, g: Granularity, head_dim: int) -> UnitLayout:
        return cls(g.kind, g.size if g.kind == "window" else 1, head_dim)

    @property
    def over_tokens(self) -> bool:
        return self.kind != "channel"

    def n_units(self, n_tokens: int) -> int:
        """Units covering ``n_tokens`` tokens (the partial trailing window included)."""
        return self.head_dim if self.kind == "channel" else -(-n_tokens // self.size)

    def n_complete(self, n_tokens: int) -> int:
        return n_tokens // self.size

    def aggregate(self, x: Tensor, how: str = "sum") -> Tensor:
        """Per-token ``[..., T]`` -> per-unit ``[..., U]`` by ``sum``, ``mean`` or ``max`` over
        each unit's tokens (a partial window aggregates the tokens it has)."""
        assert self.over_tokens, "channel units have no tokens to aggregate"
        w, t = self.size, x.shape[-1]
        if w == 1:
            return x
        u = self.n_units(t)
        fill = -torch.inf if how == "max" else 0.0
        xw = (x if u * w == t else F.pad(x, (0, u * w - t), value=fill)).unflatten(-1, (u, w))
        if how == "sum":
            return xw.sum(-1)
        if how == "max":
            return xw.amax(-1)
        return xw.sum(-1) / self.unit_sizes(t, x.device)

    def expand(self, x: Tensor, n_tokens: int) -> Tensor:
        """Per-unit ``[..., U]`` -> per-token ``[..., T]`` (each token takes its unit's value)."""
        assert self.over_tokens
        return x.repeat_interleave(self.size, dim=-1)[..., :n_tokens]

    def first_token(self, n_tokens: int, device=None) -> Tensor:
        """int64 ``[U]``: the first token position of each unit."""
        return torch.arange(self.n_units(n_tokens), device=device) * self.size

    def last_token(self, n_tokens: int, device=None) -> Tensor:
        """int64 ``[U]``: the last token position of each unit."""
        return (self.first_token(n_tokens, device) + self.size - 1).clamp(max=n_tokens - 1)

    def unit_sizes(self, n_tokens: int, device=None) -> Tensor:
        """int64 ``[U]``: tokens per unit (the partial window has fewer)."""
        w = self.size
        return (n_tokens - self.first_token(n_tokens, device)).clamp(max=w)

    def protected(self, n_tokens: int, protect: Protect, device=None) -> Tensor:
        """bool ``[U]``: units that must stay at full precision (see the module docstring).
        They are a prefix (sinks) and a suffix (recent tokens, the partial window), found on
        the host: two slice fills on the device."""
        if not self.over_tokens:
            return torch.zeros(self.head_dim, dtype=torch.bool, device=device)
        w, t = self.size, n_tokens
        u = self.n_units(t)
        head = min(u, -(-protect.sinks // w))  # units whose first token is a sink
        # first unit whose last token min(u*w + w - 1, t - 1) is recent; the last unit when
        # recent >= 1 or it is partial
        tail = u if protect.recent == 0 else max(0, -(-(t - protect.recent - w + 1) // w))
        tail = min(tail, u - 1) if protect.recent or t % w else tail
        out = torch.zeros(u, dtype=torch.bool, device=device)
        if head:
            out[:head] = True
        if tail < u:
            out[tail:] = True
        return out

    def token_mask(self, unit_mask: Tensor, n_tokens: int) -> Tensor:
        """bool ``[..., U]`` -> ``[..., T]``."""
        return self.expand(unit_mask, n_tokens)

    def rows(self, x: Tensor, n_units: int) -> Tensor:
        """Token rows ``[..., >=U*W, d]`` -> unit blocks ``[..., U, W, d]`` (complete units)."""
        return x[..., : n_units * self.size, :].unflatten(-2, (n_units, self.size))
