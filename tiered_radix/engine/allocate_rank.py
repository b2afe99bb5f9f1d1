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
   (it already holds tier k or better, so routing does not flap), else ``score``, computed in the
   score's dtype (float32 scores, the planner's, rank in float32); each unit that
   still fits ``C_k`` takes tier ``k``, one that does not is left for the next tier.
3. Units left after the last quantized tier are evicted; so are units with score ``-inf`` or NaN
   (callers use ``-inf`` for units whose data is gone).

The visit in step 2 is vectorised over a batch of rows: one sort and a cumulative sum per tier
take the longest prefix that fits; units costing more than the room left are then dropped and the
prefix is repeated. Units costing 0 always fit, wherever they fall in the order: they are taken
before the rounds. A round that stops early retires every cost value >= the unit it stopped at,
so a tier needs at most ``V`` rounds when its cost column holds ``V`` distinct positive values
(one round when a tier's cost is equal across units). ``rounds=None`` repeats until done (one
host sync per round); ``rounds=R`` runs exactly ``R`` rounds per tier with no host sync (extra
rounds are no-ops), equal to the sequential loop whenever ``R`` is that large. When there is no
hysteresis and each tier's cost is equal across units the result also equals the unit-by-unit
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
    t = cost.shape[-1]
    per_tier = score.dim() == cost.dim() and score.dim() >= 2
    b = score.shape[:-1] if per_tier else score.shape
    if (
        score.dim() < 1
        or cost.shape != (*b, t)
        or t < 2
        or len(shares) != t - 1
        or (per_tier and score.shape[-1] != t - 1)
    ):
        raise ValueError(
            f"expected score [..., n] (or [..., n, n_tiers - 1]: a ranking per kept tier), cost "
            f"[..., n, n_tiers >= 2], len(shares) == n_tiers - 1; got {list(score.shape)}, "
            f"{list(cost.shape)}, {len(shares)} shares"
        )
    if min(shares) < 0 or sum(shares) > 1 + 1e-9:
        raise ValueError(f"shares must be >= 0 and sum to <= 1, got {list(shares)}")
    if not bool(((cost >= 0) & cost.isfinite()).all()) or bool((cost[..., -1] != 0).any()):
        raise ValueError("cost must be finite and >= 0, and the evicted (last) tier must cost 0")
    if previous is not None and (
        previous.shape != b or bool(((previous < 0) | (previous >= t)).any())
    ):
        raise ValueError(f"previous must be {list(b)} tier indices in [0, {t})")
    if protected is not None and (protected.shape != b or protected.dtype != torch.bool):
        raise ValueError(f"protected must be a bool {list(b)} mask")
    if hysteresis < 0:
        raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")


def rank_allocate(
    score: Tensor,
    cost: Tensor,
    budget: float | Tensor,
    *,
    shares: Sequence[float],
    protected: Tensor | None = None,
    previous: Tensor | None = None,
    hysteresis: float = 0.0,
    rounds: int | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> Tensor:
    """Route ``n`` units into tiers, independently per batch row (see the module docstring).

    score: float ``[..., n]``, or ``[..., n, n_tiers - 1]`` for a ranking per kept tier (tier
    ``k`` fills from column ``k``; a unit is placeable there where it is finite); cost: float
    ``[..., n, n_tiers]`` bytes per unit per tier (the
    caller adds ledger copies; last column 0); budget: bytes, a float or a float ``[...]`` tensor
    (one per row); shares: ``n_tiers - 1`` fractions of ``budget``; protected: bool ``[..., n]``;
    previous: integer ``[..., n]`` tiers of the last routing. rounds: None (exact for any costs,
    syncs once per round) or a fixed count (no host sync; exact when each tier's cost column
    holds at most ``rounds`` distinct positive values per row). validate=False skips the
    argument checks and the :class:`BudgetError` check, which read tensors on the host.
    impl: ``"auto"`` runs the Triton kernel (``tiered_radix.kernels.rank``, one launch, equal
    bit for bit) for float32 scores on CUDA with a fixed ``rounds`` and at most
    ``kernels.rank.MAX_UNITS`` units a row, this PyTorch code otherwise; ``"torch"`` always
    this code; ``"triton"`` always the kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    Returns int8 ``[..., n]`` tier per unit, on ``score.device``. Row bytes <= its budget.

    Raises:
        BudgetError: the protected units of a row alone exceed its budget.
        ValueError: inconsistent shapes, shares, costs or hysteresis.
    """
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if validate:
        _check(score, cost, shares, previous, protected, hysteresis)
        _check_paid(cost, budget, protected)
    if impl == "triton" or (impl == "auto" and score.is_cuda and _kernel_fits(score, cost, rounds)):
        from tiered_radix.kernels.rank import rank_allocate_rows

        return rank_allocate_rows(
            score, cost, budget, shares=shares, protected=protected, previous=previous,
            hysteresis=hysteresis, rounds=rounds,
        )  # fmt: skip
    n_tiers, dev = cost.shape[-1], score.device
    per_tier = score.dim() == cost.dim()
    rows = score.shape[:-2] if per_tier else score.shape[:-1]
    cost = cost.double()
    budget = torch.as_tensor(budget, dtype=torch.float64, device=dev).expand(rows)
    if protected is None:
        protected = torch.zeros(cost.shape[:-1], dtype=torch.bool, device=dev)
    paid = torch.where(protected, cost[..., 0], 0.0).sum(-1)
    tier = torch.where(protected, 0, n_tiers - 1).to(torch.int8)
    score = score if score.dtype in (torch.float32, torch.float64) else score.float()
    placeable = score > -torch.inf  # NaN compares False: never placed
    free = ~protected if per_tier else ~protected & placeable
    used, cum = paid, 0.0  # cumulative shares on the host: no host-to-device copy
    bonus = hysteresis * score.abs() if previous is not None and hysteresis else None
    for k in range(n_tiers - 1):
        s, ok = (score[..., k], free & placeable[..., k]) if per_tier else (score, free)
        cum += shares[k]
        cap = torch.minimum(torch.maximum(budget * cum, paid), budget)
        if bonus is not None:
            s = torch.where(previous <= k, s + (bonus[..., k] if per_tier else bonus), s)
        order = torch.sort(torch.where(ok, s, -torch.inf), dim=-1, descending=True, stable=True)
        order = order.indices
        take, used = _fill(cost[..., k].gather(-1, order), ok.gather(-1, order), cap, used, rounds)
        take = torch.zeros_like(take).scatter_(-1, order, take)  # back to unit order
        tier = torch.where(take, k, tier)
        free = free & ~take
    return tier


def _kernel_fits(score: Tensor, cost: Tensor, rounds: int | None) -> bool:
    from tiered_radix.kernels.rank import fits

    return fits(score, cost, rounds)


def _check_paid(cost: Tensor, budget: float | Tensor, protected: Tensor | None) -> None:
    if protected is None:
        return
    paid = torch.where(protected, cost[..., 0].double(), 0.0).sum(-1)
    budget = torch.as_tensor(budget, dtype=torch.float64, device=paid.device).expand_as(paid)
    if bool((paid > budget).any()):
        r = int((paid - budget).flatten().argmax())
        raise BudgetError(float(paid.flatten()[r]), float(budget.flatten()[r]))


def _fill(
    c: Tensor, free: Tensor, cap: Tensor, used: Tensor, rounds: int | None
) -> tuple[Tensor, Tensor]:
    """Sequential 'take if it fits' along the last dim of ``c`` (sorted), vectorised in rounds.
    Returns the taken mask and the updated bytes per row. Units costing 0 fit whatever the room
    (it never goes below 0): taken at once, so the rounds are left with positive costs only.
    Costs are >= 0, so the running sum never decreases and the units before the first overflow
    are those whose running sum fits (exactly so for integer byte costs; on a parallel-scan
    device other costs may differ by the rounding of that sum)."""
    rest, room = free & (c != 0), cap - used
    r = 0
    while rounds is None or r < rounds:
        live = rest & (c <= room[..., None])  # costing more than the room: never fits
        if rounds is None and not bool(live.any()):
            break
        now = live & (torch.cumsum(c * live, -1) <= room[..., None])
        spent = (c * now).sum(-1)
        rest, room, used = rest ^ now, room - spent, used + spent
        r += 1
    return free & ~rest, used
