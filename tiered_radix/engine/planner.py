"""One routing step's decisions (``TierStore.plan``): constraints, budgets, allocator calls.

Order: per layer, forced masks (protected units, rules, units already evicted) and the bytes the
forced-full units hold; then the budget left after those is spread over (layer, head) (see
:mod:`.routing`); then each layer is allocated: rank allocation over ``allocate.by``, or
rate-distortion per head (coupled units: one RD over the units; RDKV: V tokens over
``v_share`` of the head's share, then K channels over the kept tokens with the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.policy.model import Demote, Evict, Keep, Promote, RankAllocation, RateDistortion

from .allocate_rd import rd_allocate
from .decoupled import channel_cost
from .routing import Constraints, coupled_costs, rank_heads, spread_shares, total_budget
from .units import UnitLayout


@dataclass
class Plan:
    """New tiers: ``v[l]`` int64 ``[H, U]`` per layer (all units); decoupled policies also
    ``k[l]`` int64 ``[H, d]`` channel tiers and ``k_set[l]`` bool ``[H, T]``. ``over`` is a
    0-d bool device tensor (forced bytes exceed the budget); reading ``over_budget`` syncs."""

    v: list[Tensor]
    k: list[Tensor]
    k_set: list[Tensor]
    over: Tensor

    @property
    def over_budget(self) -> bool:
        return bool(self.over)


def _constraints(store, li: int) -> Constraints:
    lay, ts = store.layers[li].v, store.tier_set
    h, u, t = store.n_heads, lay.n_units, lay.n_tokens
    protected = store.layout.protected(t, store.policy.protect, store.device)[None].expand(h, u)
    full = torch.zeros(h, u, dtype=torch.bool, device=store.device)
    evict, cap = torch.zeros_like(full), torch.zeros_like(full)
    for rule in store.policy.rules:
        m = store.scores.evaluate(li, rule.when, store.layout).bool()
        if isinstance(rule.then, Evict):
            evict, full, cap = evict | m, full & ~m, cap & ~m
        elif isinstance(rule.then, Keep | Promote):
            full, evict, cap = full | m, evict & ~m, cap & ~m
        elif isinstance(rule.then, Demote):
            cap, full, evict = cap | m, full & ~m, evict & ~m
    gone = lay.tier[:, :u] == (-1 if ts.evict is None else ts.evict)
    full = (full | protected) & ~gone
    return Constraints(full=full, evict=(evict & ~protected) | gone, cap=cap & ~full)


def _forced_bytes(store, li: int, c: Constraints) -> Tensor:
    """float64 ``[H]``: bytes the forced-full units hold after routing (rows + kept copies)."""
    lay = store.layers[li].v
    rows = (c.full.double() * lay.unit_tokens()).sum(1) * (2 * 2 * store.head_dim)
    held = lay.held()
    if held is not None:
        nb = torch.tensor(
            [lay.stores[j].unit_nbytes for j in store.tier_set.quantized],
            dtype=torch.float64,
            device=store.device,
        )
        rows = rows + (held.double() * c.full * nb[:, None, None]).sum((0, 2))
    return rows


def plan_route(store) -> Plan:
    pol, dev = store.policy, store.device
    cons = [_constraints(store, li) for li in range(store.n_layers)]
    forced = torch.stack([_forced_bytes(store, li, c) for li, c in enumerate(cons)])  # [L, H]
    totals = None
    if pol.spread.kind == "proportional":
        totals = torch.stack(
            [
                store.scores.evaluate(li, pol.spread.by, store.layout).float().sum(1)
                for li in range(store.n_layers)
            ]
        )
    budget = total_budget(
        store.budget, [lay.v.n_tokens for lay in store.layers], store.n_heads, store.head_dim
    )
    rest = budget - forced.sum()  # float64 0-d, on device
    shares = spread_shares(pol.spread, store.n_layers, store.n_heads, totals, dev)
    head_budget = torch.floor(shares * rest.clamp(min=0.0))  # float64 [L, H]
    out = Plan([], [], [], over=rest < 0)
    if isinstance(pol.allocate, RankAllocation):
        out.v.extend(_rank_all(store, cons, head_budget))
        return out
    head_budget = head_budget.tolist()
    for li, c in enumerate(cons):
        if store.coupled:
            out.v.append(_rd_coupled(store, li, c, head_budget[li]))
        else:
            v, k, kset = _rd_decoupled(store, li, c, head_budget[li])
            out.v.append(v)
            out.k.append(k)
            out.k_set.append(kset)
    return out


def _costs(store, li: int) -> Tensor:
    lay = store.layers[li].v
    cost = coupled_costs(store.tier_set, lay.unit_bytes(), lay.held(), store.device)
    return cost.expand(store.n_heads, lay.n_units, -1) if cost.dim() == 1 else cost


def _finish(store, tier_p: Tensor, cost_p: Tensor, c: Constraints) -> Tensor:
    ts = store.tier_set
    cheapest = (
        cost_p.argmin(-1) + ts.offset if ts.evict is None else torch.full_like(tier_p, ts.evict)
    )
    return c.apply(tier_p + ts.offset, ts, cheapest)


def _rank_inputs(store, li: int, c: Constraints) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Allocator inputs of one layer: score ``[H, U]``, cost ``[H, U, J]`` (forced units cost
    0), previous policy tier ``[H, U]`` (-1: never routed); and the unmasked cost."""
    a: RankAllocation = store.policy.allocate
    ts, lay = store.tier_set, store.layers[li].v
    cost_p = _costs(store, li)[..., ts.offset :]
    score = store.scores.evaluate(li, a.by, store.layout).float()
    u = lay.n_units
    prev = lay.tier[:, :u] - ts.offset
    routed = torch.arange(u, device=store.device) < lay.routed_units
    prev = torch.where(routed & (prev >= 0), prev, -1)
    score = torch.where(c.evict, -torch.inf, torch.nan_to_num(score, nan=-torch.inf))
    return score, torch.where((c.full | c.evict)[..., None], 0.0, cost_p), prev, cost_p


def _rank_all(store, cons: list[Constraints], budgets: Tensor) -> list[Tensor]:
    """Rank allocation of every layer, stacked into one allocator call when the layers hold
    the same number of units (else one call per layer); ``budgets`` float64 ``[L, H]``."""
    a: RankAllocation = store.policy.allocate
    ts = store.tier_set
    # the allocator is exact with rounds > distinct positive costs per tier column: a unit's
    # cost is its tier's bytes plus the copies it keeps, one of 2**Q values with Q quantized
    # tiers under a write-once ledger, a single value otherwise (forced units cost 0)
    rounds = (2 ** len(ts.quantized) if store.policy.ledger.write_once else 1) + 1
    inputs = [_rank_inputs(store, li, c) for li, c in enumerate(cons)]
    groups = [list(range(store.n_layers))]
    if len({x[0].shape[-1] for x in inputs}) > 1:
        groups = [[li] for li in range(store.n_layers)]
    out = []
    for g in groups:
        score, cost, prev = (torch.stack([inputs[li][i] for li in g]) for i in range(3))
        tier_p = rank_heads(
            score,
            cost,
            budgets[g],
            shares=a.shares,
            previous=prev,
            hysteresis=a.hysteresis,
            has_evict=ts.evict is not None,
            rounds=rounds,
        )
        for i, li in enumerate(g):
            cost_p, t = inputs[li][3], tier_p[i]
            if ts.evict is None:  # left by the allocator: the cheapest tier (over budget, flagged)
                t = torch.where(t == cost_p.shape[-1], cost_p.argmin(-1), t)
            out.append(_finish(store, t, cost_p, cons[li]))
    return out


def _weights(store, li: int, expr, layout: UnitLayout) -> Tensor:
    w = store.scores.evaluate(li, expr, layout).double()
    return torch.nan_to_num(w, nan=0.0, posinf=1e300, neginf=0.0).clamp(min=0)


def _rd_coupled(store, li: int, c: Constraints, budgets: list[float]) -> Tensor:
    a: RateDistortion = store.policy.allocate
    ts = store.tier_set
    cost_p = _costs(store, li)[..., ts.offset :]
    w, sig = (
        _weights(store, li, a.v_weight, store.layout),
        _weights(store, li, a.sigma, store.layout),
    )
    tier_p = torch.zeros_like(c.full, dtype=torch.long)
    for h in range(store.n_heads):
        r = ~(c.full[h] | c.evict[h])
        res = rd_allocate(w[h][r], sig[h][r], cost_p[h][r], a.bits, budgets[h])
        tier_p[h][r] = res.choice
    return _finish(store, tier_p, cost_p, c)


def _rd_decoupled(store, li: int, c: Constraints, budgets: list[float]):
    a: RateDistortion = store.policy.allocate
    ts, lay = store.tier_set, store.layers[li]
    v_tier = _rd_coupled(store, li, c, [a.v_share * b for b in budgets])
    ev = -1 if ts.evict is None else ts.evict
    k_set = (v_tier != ev) & ~c.full
    n_set = k_set.sum(1)
    chan = UnitLayout("channel", 1, store.head_dim)
    kw, ks = _weights(store, li, a.k_weight, chan), _weights(store, li, a.sigma, chan)
    k_cost = channel_cost(n_set, lay.k.bits, a.group)[:, ts.offset :]
    v_cost = _costs(store, li).gather(-1, v_tier[..., None])[..., 0]
    v_spent = torch.where(c.full | c.evict, 0.0, v_cost).sum(1).tolist()
    k_tier = torch.zeros(store.n_heads, store.head_dim, dtype=torch.long, device=store.device)
    for h in range(store.n_heads):
        cost_h = k_cost[h].expand(store.head_dim, -1)
        res = rd_allocate(kw[h], ks[h], cost_h, a.bits, max(budgets[h] - v_spent[h], 0.0))
        k_tier[h] = res.choice + ts.offset
    return v_tier, k_tier, store.layout.token_mask(k_set, lay.v.n_tokens)
