"""Decode-time diagnostics of one policy run: FMM, LIR and churn (``engine/diagnostics.py``).

- **FMM** (future missed mass): at every decode step and layer, the newest query attends with
  *full-precision* keys over every token (the prefill's keys plus the decoded ones, nothing
  evicted); FMM is the share of that probability mass landing on tokens the policy has evicted
  (``kept`` False), summed over steps, layers and query heads before dividing.
- **LIR** (leave-and-return rate): the same full attention summed over each KV head's query
  group and over 32-token windows gives ``[steps, layers * heads * windows]``; per step and
  (layer, head) the oracle active set covers 90% of the mass; LIR is the fraction of windows
  that leave that set and are active again later (:func:`global_lir`). It describes the decode
  trajectory the policy produced, with the prompt's windows only (decoded ones come later).
- **churn**: after each routing step past the first (the after-prefill allocation), the share of
  the units present at both steps whose tier changed (:func:`churn`), averaged over steps; None
  for policies that route once.

Everything stays on the model's device; one host copy per run, in :meth:`DecodeProbe.summary`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tiered_radix.engine.diagnostics import churn, global_lir, oracle_active

LIR_WINDOW = 32
LIR_MASS = 0.9


class DecodeProbe:
    """Collects one run's diagnostics; ``prefix_keys``: per layer float32 ``[H, T0, d]`` (the
    prefill's full-precision keys, shared between runs and never written)."""

    def __init__(self, prefix_keys: list[Tensor], capacity: int) -> None:
        self.prefix = prefix_keys
        h, t0, d = prefix_keys[0].shape
        self.t0 = t0
        self.new = [k.new_zeros(h, capacity, d) for k in prefix_keys]  # decoded keys
        self.n_new = [0] * len(prefix_keys)
        self.missed = torch.zeros((), dtype=torch.float64, device=prefix_keys[0].device)
        self.total = 0.0
        self.windows: list[list[Tensor]] = []  # per step, per layer [H, W]
        self.churns: list[Tensor] = []
        self._tiers: Tensor | None = None
        self._routes = 0

    def append(self, layer: int, k: Tensor) -> None:
        """Decoded keys ``[H, t, d]`` of ``layer`` (model dtype)."""
        n, t = self.n_new[layer], k.shape[1]
        if n + t > self.new[layer].shape[1]:
            grow = self.new[layer].new_zeros(k.shape[0], n + t + 64, k.shape[2])
            grow[:, :n] = self.new[layer][:, :n]
            self.new[layer] = grow
        self.new[layer][:, n : n + t] = k.float()
        self.n_new[layer] = n + t

    def attend(self, layer: int, q: Tensor, kept: Tensor, scale: float) -> None:
        """One decode step of ``layer``: ``q [Hq, 1, d]``, ``kept`` bool ``[H, T]``."""
        h = kept.shape[0]
        keys = torch.cat([self.prefix[layer], self.new[layer][:, : self.n_new[layer]]], 1)
        qg = q.float().reshape(h, -1, q.shape[-1])  # [H, G, d]
        p = torch.softmax(torch.bmm(qg, keys.transpose(1, 2)) * scale, -1).sum(1)  # [H, T]
        self.missed += (p * ~kept[:, : p.shape[1]]).sum(dtype=torch.float64)
        self.total += qg.shape[1] * h
        w = self.t0 // LIR_WINDOW
        if layer == 0:
            self.windows.append([])
        self.windows[-1].append(p[:, : w * LIR_WINDOW].reshape(h, w, LIR_WINDOW).sum(-1))

    def routed(self, store) -> None:
        """Call after every possible routing: snapshots tiers when ``store`` routed."""
        n = store.step  # routings applied
        if n == self._routes:
            return
        self._routes = n
        now = store.stack.tier[:, :, : store.stack.n_units(0)]  # [L, H, U]
        if self._tiers is not None:
            m = self._tiers.shape[-1]  # units present at both steps
            pair = torch.stack([self._tiers.reshape(-1), now[..., :m].reshape(-1)])
            self.churns.append(churn(pair)[0])
        self._tiers = now.clone()

    def summary(self) -> dict[str, float | None]:
        """``{"fmm", "lir", "churn"}`` (None where nothing was measured)."""
        fmm = float(self.missed) / self.total if self.total else None
        steps = [torch.stack(s) for s in self.windows if len(s) == len(self.prefix)]
        lir = None
        if len(steps) >= 3 and steps[0].shape[-1]:
            active = oracle_active(torch.stack(steps), LIR_MASS)  # [steps, L, H, W]
            lir = global_lir(active.reshape(len(steps), -1))
        ch = float(torch.stack(self.churns).mean()) if self.churns else None
        return {"fmm": fmm, "lir": lir, "churn": ch}
