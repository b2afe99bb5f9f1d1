"""Replay a recorded attention trace through the tier engine (``tiered-radix simulate``).

For one policy: a fresh :class:`~tiered_radix.engine.store.TierStore` receives the prompt's K/V
and the prefill signals (colmass, qnorm, obs_attn when recorded) and routes once; then every
decode step ``s`` appends token ``prompt_len + s``, attends with ``q_s`` over what the store keeps
(``view``) and, separately, over the full-precision K/V (the oracle), feeds the kept-attention
mass back as the policy's ``attn`` signal, and routes when ``schedule_due(s)``.

The store holds the trace's float16 values, so a full-tier row equals the oracle's row bit for
bit and the ``full`` policy has zero error. A token is "active" (for the policy's Global LIR) when
its unit is in the full tier (engine tier 0; for RDKV its V row is at 16 bits, K channels aside),
a promoted unit included. Attention is one query row per step, never a ``[T, T]`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..engine import diagnostics as diag
from ..engine.signals import Signals, policy_reads
from ..engine.store import TierStore
from ..policy import Policy, load_policy
from ..policy.errors import Span
from ..policy.model import Budget
from ..policy.transformer import parse
from .trace import Trace

KINDS = ("promote", "demote", "evict")


class SimError(ValueError):
    """The policy cannot be replayed on this trace (it needs a signal the trace did not record)."""


@dataclass(frozen=True, eq=False)
class Diagnostics:
    """QEvict's cache-dynamics diagnostics, per (layer, KV head) over the decode steps."""

    fmm: np.ndarray  # float64 [layers, H_kv]: share of oracle attention on evicted tokens
    lir: np.ndarray  # float64 [layers, H_kv]: Global LIR, active = the policy's full tier
    lir_oracle: np.ndarray  # float64 [layers, H_kv]: Global LIR, active = oracle 90% mass set
    churn: float  # tier changes per routing step, summed over layers and heads
    churn_share: float  # mean share of units whose tier changed at a routing step
    routes: int  # routing steps, the after-prefill one included


class DiagnosticsRecorder:
    """Collects one row per decode step and (layer, KV head): oracle mass, evicted, full tier."""

    def __init__(self, n_layers: int, n_heads: int, steps: int, total_len: int) -> None:
        shape = (n_layers, n_heads, steps, total_len)
        self.mass = torch.zeros(shape)
        self.evicted = torch.zeros(shape, dtype=torch.bool)
        self.active = torch.zeros(shape, dtype=torch.bool)
        self.tiers: list[list[np.ndarray]] = []  # per routing step: per layer int [H, U]

    def step(self, li: int, s: int, mass, evicted, active) -> None:
        t = mass.shape[-1]
        self.mass[li, :, s, :t], self.evicted[li, :, s, :t] = mass, evicted
        self.active[li, :, s, :t] = active

    def route(self, tiers: list[np.ndarray]) -> None:
        self.tiers.append(tiers)

    def _churn(self) -> tuple[float, float]:
        """(tier changes per routing step, mean share of units changed); units born since the
        previous routing step are not changes."""
        changes, shares = 0, []
        for before, after in zip(self.tiers, self.tiers[1:], strict=False):
            pairs = []
            for a, b in zip(before, after, strict=True):
                u = min(a.shape[-1], b.shape[-1])
                pairs.append(torch.stack([torch.as_tensor(a[:, :u]), torch.as_tensor(b[:, :u])]))
            both = torch.cat([x.flatten(1) for x in pairs], dim=1)  # [2, units of all layers]
            share = float(diag.churn(both)[0])
            shares.append(share)
            changes += round(share * both.shape[1])
        n = max(len(self.tiers) - 1, 1)
        return changes / n, (sum(shares) / n)

    def finish(self) -> Diagnostics:
        n_l, h = self.mass.shape[:2]
        fmm, lir, lir_o = (np.zeros((n_l, h)) for _ in range(3))
        for li in range(n_l):
            for hi in range(h):
                mass = self.mass[li, hi]
                fmm[li, hi] = float(diag.future_missed_mass(mass, self.evicted[li, hi]))
                lir[li, hi] = float(diag.global_lir(self.active[li, hi]))
                lir_o[li, hi] = float(diag.global_lir(diag.oracle_active(mass, mass=0.9)))
        churn, churn_share = self._churn()
        return Diagnostics(fmm, lir, lir_o, churn, churn_share, len(self.tiers))


@dataclass(frozen=True, eq=False)
class SimResult:
    """What one policy did on one trace. Per-step arrays have ``steps + 1`` entries: entry 0 is
    the state after prefill routing, entry ``s + 1`` the state after decode step ``s``."""

    policy: str
    description: str
    budget: str  # the budget in words
    layers: tuple[int, ...]  # model layer indices of the trace
    seq_len: np.ndarray  # int64 [steps + 1]: tokens cached
    bytes_used: np.ndarray  # int64 [steps + 1]: store bytes after routing
    bytes_peak: np.ndarray  # int64 [steps + 1]: store bytes after the append, before routing
    budget_bytes: np.ndarray  # int64 [steps + 1]
    full_bytes: np.ndarray  # int64 [steps + 1]: the same tokens at full precision (2 B/elt)
    occupancy: dict[str, np.ndarray]  # tier name -> int64 [steps + 1], units over layers/heads
    routed: np.ndarray  # bool [steps + 1]: a routing step happened here
    transitions: dict[str, np.ndarray]  # promote|demote|evict -> int64 [steps + 1]
    error: np.ndarray  # float32 [steps, layers, H_q]: ||o - o_full|| / ||o_full||
    diagnostics: Diagnostics  # FMM, Global LIR (policy and oracle), churn


def parse_budget(text: str) -> Budget:
    """``"10%"``, ``"64 MiB"`` or ``"2048 tokens"`` (policy-file syntax) to a :class:`Budget`.

    Raises:
        PolicyError: the text is not a budget.
    """
    return parse(text.strip(), "budget", Span("--budget", 1, 1, text.strip()))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query over one layer, in float32.

    q ``[H_q, d]``; k, v ``[H, T, d]``; kept bool ``[H, T]`` or None (all kept). Query head ``i``
    reads KV head ``i // (H_q // H)``. Returns (out ``[H_q, d]``, mass ``[H, T]``: probability
    summed over each KV head's query group; 0 on tokens not kept).
    """
    h, t, d = k.shape
    qg = q.float().reshape(h, -1, d)
    k, v = k.float(), v.float()
    if kept is not None:  # evicted rows are NaN-poisoned: zero them before any product
        k = k.masked_fill(~kept[..., None], 0.0)
        v = v.masked_fill(~kept[..., None], 0.0)
    s = torch.einsum("hgd,htd->hgt", qg, k) * scale
    if kept is not None:
        s = s.masked_fill(~kept[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a head with nothing kept reads nothing
    return torch.einsum("hgt,htd->hgd", p, v).reshape(-1, d), p.sum(1)


def _relative_error(o: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (o - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def _prefill_signals(trace: Trace, li: int, p: int) -> Signals:
    obs = getattr(trace, "obs_attn", None)
    return Signals(
        attn=None,
        colmass=torch.from_numpy(trace.colmass[li]).float(),
        obs_attn=None if obs is None else torch.from_numpy(obs[li]).float()[:, :p],
        qnorm=torch.from_numpy(trace.qnorm[li]).float(),
    )


def simulate(
    policy: Policy | str, trace: Trace, budget: Budget | str | None = None, progress: bool = True
) -> SimResult:
    """Replay ``trace`` through ``policy`` (optionally with its budget replaced by ``budget``).

    Raises:
        SimError: the policy reads a signal this trace did not record (``obs_attn``).
        PolicyError: an unknown policy name or a malformed budget string.
    """
    policy = load_policy(policy) if isinstance(policy, str) else policy
    budget = parse_budget(budget) if isinstance(budget, str) else budget
    m = trace.meta
    if "obs_attn" in policy_reads(policy) and getattr(trace, "obs_attn", None) is None:
        raise SimError(
            f"policy '{policy.name}' reads obs_attn (prompt observation-window attention), "
            f"which this trace ({m.model}) does not record; re-record the trace with obs_attn"
        )
    n_l, h, d, p, steps = len(m.layers), m.n_heads_kv, m.head_dim, m.prompt_len, m.steps
    store = TierStore(
        policy,
        n_layers=n_l,
        n_heads=h,
        head_dim=d,
        dtype=torch.float16,
        max_tokens=m.total_len,
        budget_override=budget,
    )
    k16 = [torch.from_numpy(a) for a in trace.k]
    v16 = [torch.from_numpy(a) for a in trace.v]
    k32, v32 = [a.float() for a in k16], [a.float() for a in v16]
    qs = [torch.from_numpy(a) for a in trace.q]
    rec = DiagnosticsRecorder(n_l, h, steps, m.total_len)
    size = policy.v.size if policy.v.kind == "window" else 1  # tokens per tiers() unit
    n = steps + 1
    cols = {
        name: np.zeros(n, np.int64)
        for name in ("seq_len", "bytes_used", "bytes_peak", "budget_bytes", "full_bytes")
    }
    occ: dict[str, np.ndarray] = {}
    moves = {kind: np.zeros(n, np.int64) for kind in KINDS}
    routed = np.zeros(n, bool)
    error = np.zeros((steps, n_l, m.n_heads_q), np.float32)

    def record(i: int, peak: int, transitions) -> None:
        cols["seq_len"][i] = length = p + i
        cols["bytes_used"][i], cols["bytes_peak"][i] = store.bytes_used(), peak
        cols["budget_bytes"][i] = store.budget_bytes()
        cols["full_bytes"][i] = 4 * n_l * h * length * d
        for name, units in store.occupancy().items():
            occ.setdefault(name, np.zeros(n, np.int64))[i] = units
        routed[i] = transitions is not None
        for kind, c in (transitions.counts() if transitions is not None else {}).items():
            moves[kind][i] = c
        if transitions is not None:
            rec.route([store.tiers(li).cpu().numpy() for li in range(n_l)])

    for li in range(n_l):
        store.append(li, k16[li][:, :p], v16[li][:, :p])
        store.observe(li, _prefill_signals(trace, li, p))
    peak = store.bytes_used()
    record(0, peak, store.after_prefill())

    for s in tqdm(range(steps), desc=policy.name, disable=not progress, leave=False):
        t = p + s + 1
        for li in range(n_l):
            store.append(li, k16[li][:, t - 1 : t], v16[li][:, t - 1 : t])
        peak = store.bytes_used()
        for li in range(n_l):
            kh, vh, kept = store.view(li)
            assert not kh[kept].isnan().any(), "the store returned NaN in a kept row"
            o, mass = attend(qs[li][s], kh, vh, kept, m.sm_scale)
            o_ref, mass_ref = attend(qs[li][s], k32[li][:, :t], v32[li][:, :t], None, m.sm_scale)
            error[s, li] = _relative_error(o, o_ref).numpy()
            full = kept & (store.tiers(li).repeat_interleave(size, dim=1)[:, :t] == 0)
            rec.step(li, s, mass_ref, ~kept, full)
            store.observe(li, Signals(attn=mass, colmass=None, obs_attn=None, qnorm=None))
        record(s + 1, peak, store.route(f"decode step {s}") if store.schedule_due(s) else None)

    return SimResult(
        policy=policy.name,
        description=policy.description,
        budget=str(budget or policy.budget),
        layers=m.layers,
        occupancy=occ,
        routed=routed,
        transitions=moves,
        error=error,
        diagnostics=rec.finish(),
        **cols,
    )
