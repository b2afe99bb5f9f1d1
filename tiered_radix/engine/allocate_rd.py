"""Rate-distortion bit allocation (RDKV): a multiple-choice knapsack over a discrete bit set.

Each unit ``u`` (a token's V row, or a K channel) picks one width ``bits[j]`` at ``cost[u, j]``
bytes and distortion ``D[u, j] = weight[u] * spread[u] * 2**-bits[j]`` (0 bits = evicted costs the
full ``w * sigma``). We minimise ``sum_u D[u, j_u]`` subject to ``sum_u cost[u, j_u] <= budget``.

Method. Each unit's efficient options form its lower convex hull in the (cost, D) plane, walked
from its cheapest option by single-step upgrades ("segments"), whose drop per byte decreases along
the chain. All segments of all units are sorted once by drop per byte (stable, so each unit's
chain stays in order) and taken greedily: a segment is taken when it fits the remaining bytes,
otherwise it and the rest of its unit's chain are skipped. This is computed in a few vectorised
rounds (one per distinct skipped segment size), never a Python loop over units.

Lagrangian. ``lam`` is the smallest multiplier whose relaxed choice ``argmin_j D + lam * cost``
(ties to the cheaper option) fits the budget: exactly the drop per byte of the first segment that
overflows the sorted prefix (the limit of bisection on ``lam``, found without iterating).

Guarantee (tested against exhaustive search and an exact DP). ``OPT`` is the exact knapsack
optimum and ``lower_bound = sum_u min_j (D + lam * cost) - lam * budget`` the dual value, which
equals the optimum of the LP relaxation (convex hulls, one fractional segment). Then::

    lower_bound <= OPT <= distortion <= lower_bound + max_e drop_e
                                     <= OPT + max_u (D[u, cheapest] - min_j D[u, j])

Proof of the middle step: let ``e`` be the first segment the greedy skips and ``r_e < dc_e`` the
bytes left when it is met (no skip: the unconstrained optimum fits and equals the bound). Every
segment before ``e`` in the sorted order is taken; the LP takes the same ones and then at most
``r_e`` bytes at drop per byte ``<= rho_e``, i.e. less than ``rho_e * dc_e = drop_e`` more. The
last step holds because one hull segment's drop is at most its unit's whole chain.

Monotone: more budget never increases the distortion. At the first segment where two budgets
decide differently, the larger takes it (drop ``rho * dc``) and the smaller can still buy less
than ``dc`` bytes, all at drop per byte ``<= rho``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.formats.codecs import unit_nbytes


@dataclass(frozen=True)
class RDResult:
    """Allocation of ``n`` units.

    choice: int64 ``[n]`` index into ``bits``; bits: int64 ``[n]`` the chosen widths.
    cost: total bytes; distortion: total distortion of ``choice``.
    lam: the Lagrange multiplier (0.0 when the unconstrained optimum fits; inf when infeasible).
    lower_bound: dual bound, ``<=`` the exact optimum (inf when infeasible).
    feasible: False when even the cheapest option of every unit exceeds the budget; ``choice``
    is then all-cheapest.
    """

    choice: Tensor
    bits: Tensor
    cost: float
    distortion: float
    lam: float
    lower_bound: float
    feasible: bool


def distortion_table(weight: Tensor, spread: Tensor, bits: Sequence[int]) -> Tensor:
    """``D[u, j] = weight[u] * spread[u] * 2**-bits[j]`` as float64 ``[n, len(bits)]``."""
    b = torch.as_tensor(bits, dtype=torch.float64, device=weight.device)
    return (weight.double() * spread.double()).unsqueeze(1) * torch.exp2(-b)


def lagrangian_choice(dist: Tensor, cost: Tensor, lam: float, *, rtol: float = 1e-12) -> Tensor:
    """Per unit ``argmin_j dist + lam * cost``; near-ties (``rtol``) go to the cheaper option.

    dist, cost: ``[n, J]``. Returns int64 ``[n]``.
    """
    key = dist.double() + lam * cost.double()
    best = key.amin(1, keepdim=True)
    tie = key <= best + rtol * best.abs().clamp(min=1e-300)
    c = torch.where(tie, cost.double(), torch.inf)
    return torch.where(tie & (c == c.amin(1, keepdim=True)), dist.double(), torch.inf).argmin(1)


def _chains(dist: Tensor, cost: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Start vertex ``[n]`` and hull segments ``[n, J-1]``: target index, bytes, drop, valid."""
    cheapest = cost == cost.amin(1, keepdim=True)
    cur = torch.where(cheapest, dist, torch.inf).argmin(1)
    start, steps = cur, []
    for _ in range(cost.shape[1] - 1):
        c0, d0 = cost.gather(1, cur[:, None]), dist.gather(1, cur[:, None])
        up = (cost > c0) & (dist < d0)
        ratio = torch.where(up, (d0 - dist) / (cost - c0), -torch.inf)
        best = ratio.amax(1, keepdim=True)
        # Among equally steep options take the nearest: single steps keep the greedy fine-grained.
        nxt = torch.where(up & (ratio == best), cost, torch.inf).argmin(1)
        has = up.any(1)
        nxt = torch.where(has, nxt, cur)
        dc = cost.gather(1, nxt[:, None])[:, 0] - c0[:, 0]
        steps.append((nxt, dc, d0[:, 0] - dist.gather(1, nxt[:, None])[:, 0], has))
        cur = nxt
    empty = cost.new_zeros(cost.shape[0], 0)
    to, dc, dd, ok = (
        (torch.stack(t, 1) for t in zip(*steps, strict=True))
        if steps
        else (empty.long(), empty, empty, empty.bool())
    )
    return start, to, dc, dd, ok


def _vertex(start: Tensor, to: Tensor, depth: Tensor) -> Tensor:
    """The option reached after the first ``depth[u]`` segments of each chain."""
    if to.shape[1] == 0:
        return start
    return torch.where(depth > 0, to.gather(1, (depth - 1).clamp(min=0)[:, None])[:, 0], start)


def rd_allocate(
    weight: Tensor, spread: Tensor, cost: Tensor, bits: Sequence[int], budget: float
) -> RDResult:
    """Allocate bit widths to ``n`` units under a byte budget (see the module docstring).

    weight, spread: float ``[n]`` (>= 0); cost: float ``[n, len(bits)]`` bytes per unit per width
    (the caller includes metadata; 0 for 0 bits); budget: total bytes. Any device (float64 math).

    Raises:
        ValueError: shapes disagree, or weights, spreads or costs negative or not finite.
    """
    n, nb = weight.shape[0], len(bits)
    if weight.dim() != 1 or spread.shape != (n,) or cost.shape != (n, nb) or nb == 0:
        raise ValueError(
            f"expected weight [n], spread [n], cost [n, {nb}] with len(bits) >= 1; got "
            f"{list(weight.shape)}, {list(spread.shape)}, {list(cost.shape)}"
        )
    for name, t in (("weight", weight), ("spread", spread), ("cost", cost)):
        if not bool(((t >= 0) & t.isfinite()).all()):
            raise ValueError(f"{name} must be finite and >= 0")
    dist, cost = distortion_table(weight, spread, bits), cost.double()
    start, to, dc, dd, ok = _chains(dist, cost)
    slack = budget - float(cost.gather(1, start[:, None]).sum())
    if slack < 0:
        return _result(dist, cost, start, bits, budget, torch.inf, start)

    # Sorted by drop per byte; cummin keeps each chain non-increasing despite rounding.
    rho = torch.where(ok, dd / dc.clamp(min=1e-300), -torch.inf).cummin(1).values
    order = torch.sort(rho.flatten(), descending=True, stable=True).indices
    dc_s, ok_s = dc.flatten()[order], ok.flatten()[order]
    over = ok_s & (torch.cumsum(torch.where(ok_s, dc_s, 0.0), 0) > slack)
    lam = float(rho.flatten()[order][over.int().argmax()]) if over.any() else 0.0
    relaxed = _vertex(start, to, (rho > lam).sum(1))

    taken, dead, r = torch.zeros_like(ok), ~ok, slack
    for _ in range(ok.numel() + 1):  # rounds; each one retires >= 1 distinct segment size
        dead = (dead | (~taken & (dc > r))).int().cummax(1).values.bool() if ok.numel() else dead
        elig = (~taken & ~dead).flatten()[order]
        if not elig.any():
            break
        csum = torch.cumsum(torch.where(elig, dc_s, 0.0), 0)
        stop = elig & (csum > r)
        f = int(stop.int().argmax()) if stop.any() else elig.numel()
        take = elig & (torch.arange(elig.numel(), device=elig.device) < f)
        taken.view(-1)[order[take]] = True
        r -= float(torch.where(take, dc_s, 0.0).sum())
        if f == elig.numel():
            break
    return _result(dist, cost, _vertex(start, to, taken.sum(1)), bits, budget, lam, relaxed)


def rd_choice_rows(
    weight: Tensor,
    spread: Tensor,
    cost: Tensor,
    bits: Sequence[int],
    budget: Tensor,
    active: Tensor,
    rounds: int | None = None,
) -> Tensor:
    """:func:`rd_allocate`'s choices for ``R`` independent rows at once, as device tensor ops
    with no host sync: row ``i`` allocates its ``active[i]`` units under ``budget[i]``.

    weight, spread: float ``[R, n]`` (finite, >= 0: not checked, that would sync); cost:
    float ``[R, n, J]``; budget: float64 ``[R]``; active: bool ``[R, n]``. Returns int64
    ``[R, n]`` (0 for inactive units: they take no part, as if removed). The greedy's rounds
    run a fixed ``rounds`` times (default ``J (J - 1) / 2 + 1``): a round retires at least one
    distinct segment size of its row, and a row whose units share one cost table has at most
    ``J (J - 1) / 2`` of them, so the default is exact for such rows (pass more otherwise).
    """
    R, n, J = cost.shape
    rounds = J * (J - 1) // 2 + 1 if rounds is None else rounds
    on = active[..., None]
    dist = torch.where(on, distortion_table(weight.reshape(-1), spread.reshape(-1), bits)
                       .view(R, n, J), 0.0)  # fmt: skip
    cost = torch.where(on, cost.double(), 0.0)  # inactive: one option, no segment
    start, to, dc, dd, ok = _chains(dist.view(R * n, J), cost.view(R * n, J))
    S = to.shape[1]
    start = start.view(R, n)
    slack = budget.double() - cost.gather(2, start[..., None]).sum((1, 2))
    if S == 0:
        return start
    to, dc, dd, ok = (x.view(R, n, S) for x in (to, dc, dd, ok))
    rho = torch.where(ok, dd / dc.clamp(min=1e-300), -torch.inf).cummin(2).values
    order = torch.sort(rho.flatten(1), dim=1, descending=True, stable=True).indices
    dc_s = dc.flatten(1).gather(1, order)
    pos = torch.arange(n * S, device=cost.device)
    taken, dead, r = torch.zeros_like(ok), ~ok, slack
    for _ in range(rounds):  # a round with nothing left to take changes nothing
        dead = (dead | (~taken & (dc > r[:, None, None]))).int().cummax(2).values.bool()
        elig = (~taken & ~dead).flatten(1).gather(1, order)
        csum = torch.cumsum(torch.where(elig, dc_s, 0.0), 1)
        stop = elig & (csum > r[:, None])
        f = torch.where(stop.any(1), stop.int().argmax(1), n * S)
        take = elig & (pos < f[:, None])
        flat = taken.view(R, n * S)
        flat.scatter_(1, order, flat.gather(1, order) | take)
        r = r - torch.where(take, dc_s, 0.0).sum(1)
    choice = _vertex(start.view(-1), to.view(R * n, S), taken.sum(2).view(-1)).view(R, n)
    choice = torch.where(slack[:, None] < 0, start, choice)  # infeasible: all cheapest
    return torch.where(active, choice, 0)


def _result(dist, cost, choice, bits, budget, lam, relaxed) -> RDResult:
    def total(t: Tensor, idx: Tensor) -> float:
        return float(t.gather(1, idx[:, None]).sum())

    feasible = lam != torch.inf
    lower = total(dist + lam * cost, relaxed) - lam * budget if feasible else torch.inf
    return RDResult(
        choice=choice,
        bits=torch.as_tensor(bits, dtype=torch.long, device=choice.device)[choice],
        cost=total(cost, choice),
        distortion=total(dist, choice),
        lam=float(lam),
        lower_bound=float(lower),
        feasible=feasible,
    )


@dataclass(frozen=True)
class KVAllocation:
    """RDKV result: ``v`` per token, ``k`` per channel, ``kept`` tokens with V bits > 0."""

    v: RDResult
    k: RDResult
    kept: int

    @property
    def cost(self) -> float:
        return self.v.cost + self.k.cost


def token_costs(head_dim: int, bits: Sequence[int], group: int) -> list[int]:
    """Bytes of one V row of ``head_dim`` elements at each width (groups along the row)."""
    return [unit_nbytes(head_dim, b, group) for b in bits]


def channel_costs(kept: int, bits: Sequence[int], group: int) -> list[float]:
    """Bytes of one K channel over ``kept`` tokens: ``kept * b / 8`` plus 4 bytes per group
    (``ceil(kept / group)`` groups along the tokens) for quantized widths; ``2 * kept`` at 16."""
    meta = 4 * -(-kept // group)
    return [0.0 if b == 0 else 2.0 * kept if b == 16 else kept * b / 8 + meta for b in bits]


def rd_allocate_kv(
    v_weight: Tensor,
    v_spread: Tensor,
    k_weight: Tensor,
    k_spread: Tensor,
    budget: float,
    *,
    bits: Sequence[int] = (0, 2, 4, 8, 16),
    group: int = 32,
    v_share: float = 0.5,
) -> KVAllocation:
    """RDKV pipeline for one head: V tokens first, then K channels over the kept tokens.

    v_weight, v_spread: float ``[t]`` (per token: received attention mass, V-row spread);
    k_weight, k_spread: float ``[d]`` (per channel: ``||Q_c|| ||K_c|| / sqrt(d)``, K spread).
    budget: bytes for this head's K and V together.

    1. V: units are tokens, a V row of ``d`` elements at width b costs ``unit_nbytes(d, b, group)``
       (0 bits = the token is evicted); budget ``v_share * budget``.
    2. K: units are channels over the ``kept`` tokens whose V width is > 0; costs from
       :func:`channel_costs`; budget ``budget - v.cost`` (V's unspent share flows to K). K widths
       are independent of each token's V width; 0 bits drops the channel for every kept token.
    ``v_share`` defaults to 0.5, the share V has in a full fp16 cache.

    Raises:
        ValueError: ``v_share`` outside [0, 1], or bad shapes (from :func:`rd_allocate`).
    """
    if not 0.0 <= v_share <= 1.0:
        raise ValueError(f"v_share must be in [0, 1], got {v_share}")
    d, t = k_weight.shape[0], v_weight.shape[0]
    v_cost = torch.tensor(token_costs(d, bits, group), dtype=torch.float64, device=v_weight.device)
    v = rd_allocate(v_weight, v_spread, v_cost.expand(t, -1), bits, v_share * budget)
    kept = int((v.bits > 0).sum())
    k_cost = torch.tensor(channel_costs(kept, bits, group), dtype=torch.float64)
    k = rd_allocate(
        k_weight, k_spread, k_cost.to(k_weight.device).expand(d, -1), bits, budget - v.cost
    )
    return KVAllocation(v=v, k=k, kept=kept)
