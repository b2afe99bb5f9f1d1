"""QEvict-style rank allocation: units ranked by score fill tiers best-first under byte shares.

Tiers are indexed best-first: 0 = full precision, 1..T-2 = quantized levels, T-1 = evicted (0
bytes). Tier ``k < T-1`` may use ``shares[k] * budget`` bytes, and whatever a better tier leaves
unused flows down, i.e. tiers ``0..k`` together use at most ``C_k = budget * sum(shares[:k+1])``.

Semantics (what :func:`rank_allocate` computes, exactly):

1. Protected units take tier 0 and are paid first (``P`` bytes); ``P > budget`` raises
   :class:`BudgetError`. Protected bytes count as tier-0 spending: ``C_k`` becomes
   ``max(C_k, P)``, so the total never exceeds ``max(budget * sum(shares), P) <= budget``.
2. Tiers are filled in order ``k = 0, 1, ...``: the unplaced units are visited by descending
   effective score ``score + hysteresis * |score|`` if the unit's ``previous`` tier is ``<= k``
   (it already holds tier k or better, so routing does not flap), else ``score``; each unit that
   still fits ``C_k`` takes tier ``k``, one that does not is left for the next tier.
3. Units left after the last quantized tier are evicted; so are units with score ``-inf`` or NaN
   (callers use ``-inf`` for units whose data is gone).

The visit in step 2 is vectorised: one sort and a cumulative sum per tier take the longest
prefix that fits; units costing more than the room left are then dropped and the prefix is
repeated, so each round retires at least one distinct cost value (one or two rounds when
per-tier costs are equal across units). The result equals the sequential loop above. When there
is no hysteresis and each tier's cost is equal across units it also equals the unit-by-unit
greedy "each unit in rank order takes the best tier with room"; with unequal costs the two can
differ (tier-by-tier fills a better tier first even if a higher-ranked unit then misses a worse
tier).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class BudgetError(ValueError):
    """The protected units alone need more bytes than the budget."""

    def __init__(self, needed: float, available: float) -> None:
        super().__init__(
            f"protected units (sinks, recent window) need {needed:.0f} bytes but the budget is "
            f"{available:.0f} bytes; raise the budget or protect fewer tokens"
        )
        self.needed, self.available = needed, available


def _check(
    score: Tensor,
    cost: Tensor,
    shares: Sequence[float],
    previous: Tensor | None,
    protected: Tensor | None,
    hysteresis: float,
) -> None:
    n, t = score.shape[0], cost.shape[-1]
    if score.dim() != 1 or cost.shape != (n, t) or t < 2 or len(shares) != t - 1:
        raise ValueError(
            f"expected score [n], cost [n, n_tiers >= 2], len(shares) == n_tiers - 1; got "
            f"{list(score.shape)}, {list(cost.shape)}, {len(shares)} shares"
        )
    if min(shares) < 0 or sum(shares) > 1 + 1e-9:
        raise ValueError(f"shares must be >= 0 and sum to <= 1, got {list(shares)}")
    if not bool(((cost >= 0) & cost.isfinite()).all()) or bool((cost[:, -1] != 0).any()):
        raise ValueError("cost must be finite and >= 0, and the evicted (last) tier must cost 0")
    if previous is not None and (
        previous.shape != (n,) or bool(((previous < 0) | (previous >= t)).any())
    ):
        raise ValueError(f"previous must be [n] tier indices in [0, {t})")
    if protected is not None and (protected.shape != (n,) or protected.dtype != torch.bool):
        raise ValueError("protected must be a bool [n] mask")
    if hysteresis < 0:
        raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")


def rank_allocate(
    score: Tensor,
    cost: Tensor,
    budget: float,
    *,
    shares: Sequence[float],
    protected: Tensor | None = None,
    previous: Tensor | None = None,
    hysteresis: float = 0.0,
) -> Tensor:
    """Route ``n`` units into tiers (see the module docstring for the exact rule).

    score: float ``[n]``; cost: float ``[n, n_tiers]`` bytes per unit per tier (the caller adds
    ledger copies; last column 0); budget: bytes; shares: ``n_tiers - 1`` fractions of
    ``budget``; protected: bool ``[n]``; previous: integer ``[n]`` tiers of the last routing.
    Returns int8 ``[n]`` tier per unit, on ``score.device``. Total bytes <= ``budget``.

    Raises:
        BudgetError: the protected units alone exceed ``budget``.
        ValueError: inconsistent shapes, shares, costs or hysteresis.
    """
    _check(score, cost, shares, previous, protected, hysteresis)
    n, n_tiers, dev = score.shape[0], cost.shape[1], score.device
    cost = cost.double()
    protected = torch.zeros(n, dtype=torch.bool, device=dev) if protected is None else protected
    paid = float(cost[protected, 0].sum())
    if paid > budget:
        raise BudgetError(paid, budget)
    cum = torch.tensor(shares, dtype=torch.float64).cumsum(0).tolist()
    caps = [min(max(budget * c, paid), budget) for c in cum]
    tier = torch.full((n,), n_tiers - 1, dtype=torch.int8, device=dev)
    tier[protected] = 0
    score = score.double()
    free = ~protected & (score > -torch.inf)  # NaN compares False: never placed
    used = paid
    for k in range(n_tiers - 1):
        eff = score
        if previous is not None and hysteresis:
            eff = score + hysteresis * score.abs() * (previous <= k)
        order = torch.sort(torch.where(free, eff, -torch.inf), descending=True, stable=True).indices
        take, used = _fill(cost[order, k], free[order], caps[k] - used, used)
        tier[order[take]] = k
        free[order[take]] = False
    return tier


def _fill(c: Tensor, free: Tensor, room: float, used: float) -> tuple[Tensor, float]:
    """Sequential 'take if it fits' over ``c`` (sorted), vectorised in rounds. Returns the taken
    mask and the updated byte count."""
    take = torch.zeros_like(free)
    idx = torch.arange(c.numel(), device=c.device)
    while True:
        live = free & ~take & (c <= room)  # a unit costing more than the room never fits again
        if not bool(live.any()):
            return take, used
        csum = torch.cumsum(torch.where(live, c, 0.0), 0)
        over = live & (csum > room)
        stop = int(over.int().argmax()) if bool(over.any()) else c.numel()
        now = live & (idx < stop)
        spent = float(torch.where(now, c, 0.0).sum())
        take, room, used = take | now, room - spent, used + spent
        if stop == c.numel():
            return take, used
