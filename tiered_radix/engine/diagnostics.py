"""QEvict decoding-time diagnostics, independent of any policy.

Inputs are per routing step and per unit (window, token or channel): ``attn[steps, n]`` is the
attention mass each unit receives at a step (summed over the unit's tokens, heads as the caller
chooses), ``tier[steps, n]`` / ``evicted`` / ``active`` the state a policy or oracle assigned.
Nothing here builds a ``[tokens, tokens]`` matrix. All functions work on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor


def future_missed_mass(attn: Tensor, evicted: Tensor) -> float:
    """FMM: share of all attention mass that lands on units evicted at that step.

    attn: float ``[steps, n]`` (>= 0); evicted: bool ``[steps, n]``. Mass is summed over steps
    before dividing; no mass at all gives 0.0.
    """
    total = attn.double().sum()
    missed = (attn.double() * evicted).sum()
    return float(missed / total) if total > 0 else 0.0


def missed_mass_by_tier(attn: Tensor, tier: Tensor, n_tiers: int) -> Tensor:
    """Share of all attention mass landing on each tier: float64 ``[n_tiers]``, summing to 1
    (zeros when there is no mass). The last entry is the FMM when the last tier is evicted.

    attn: float ``[steps, n]``; tier: integer ``[steps, n]`` in ``[0, n_tiers)``.
    """
    mass = torch.zeros(n_tiers, dtype=torch.float64, device=attn.device)
    mass.scatter_add_(0, tier.reshape(-1).long(), attn.reshape(-1).double())
    total = mass.sum()
    return mass / total if total > 0 else mass


def oracle_active(attn: Tensor, mass: float = 0.9) -> Tensor:
    """Per step, the smallest set of units whose attention covers ``mass`` of the step's total.

    attn: float ``[steps, n]``; returns bool ``[steps, n]``. Units are taken by descending
    attention (ties: lower index first) while the mass taken before them is < ``mass * total``;
    a step without mass has an empty set.

    Raises:
        ValueError: ``mass`` outside (0, 1].
    """
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    a = attn.double()
    vals, idx = torch.sort(a, dim=-1, descending=True, stable=True)
    before = torch.cumsum(vals, -1) - vals
    keep = before < mass * a.sum(-1, keepdim=True)
    return torch.zeros_like(keep).scatter(-1, idx, keep)


def global_lir(active: Tensor) -> float:
    """Global LIR: among units that leave the active set at some step, the fraction that are
    active again at a later step (each unit counted once; no unit ever leaving gives 0.0).

    active: bool ``[steps, n]``.
    """
    steps = active.shape[0]
    if steps < 3:
        return 0.0
    leave = active[:-1] & ~active[1:]  # leave[i]: inactive at step i + 1 after active at i
    left = leave.any(0)
    first = leave.int().argmax(0)  # first departure happens at step first + 1
    # later[t] = active at some step >= t; padded so that index ``steps`` is False.
    later = active.flip(0).int().cummax(0).values.flip(0).bool()
    later = torch.cat([later, torch.zeros_like(later[:1])])
    back = later.gather(0, (first + 2).clamp(max=steps)[None])[0]
    n_left = int(left.sum())
    return int((left & back).sum()) / n_left if n_left else 0.0


def churn(tiers: Tensor) -> Tensor:
    """Selection churn: fraction of units whose tier changed between consecutive routing steps.

    tiers: integer ``[steps, n]``; returns float32 ``[steps - 1]`` (zeros when ``n == 0``).
    """
    changed = (tiers[1:] != tiers[:-1]).float()
    return changed.mean(-1) if tiers.shape[-1] else changed.sum(-1)


def jaccard_churn(active: Tensor) -> Tensor:
    """``1 - |A_t & A_{t-1}| / |A_t | A_{t-1}|`` per step: float32 ``[steps - 1]``; 0 when both
    sets are empty.

    active: bool ``[steps, n]``.
    """
    inter = (active[1:] & active[:-1]).sum(-1).float()
    union = (active[1:] | active[:-1]).sum(-1).float()
    return torch.where(union > 0, 1 - inter / union.clamp(min=1), 0.0)
