"""One routing step's decisions (``TierStore.plan``): constraints, budgets, allocator calls.

Layers holding the same number of tokens (all of them, except mid-step) are planned together as
``[G, H, U]`` tensors, so the number of device ops does not grow with the layer count and the
rank path never waits for the device. Order: forced masks (protected units, rules, units
already evicted) and the bytes the forced-full units hold; then the budget left after those is
spread over (layer, head) (see :mod:`.routing`; a tensor-parallel rank gathers the forced
bytes and spread totals of all heads, see :mod:`.shard`); then allocation: rank allocation over
``allocate.by`` (one call for a group of layers), or rate-distortion per layer and head (coupled
units: one RD over the units; RDKV: V tokens over ``v_share`` of the head's share, then K
channels over the kept tokens with the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tiered_radix.policy.model import Demote, Evict, Keep, Promote, RankAllocation, RateDistortion

from .allocate_rd import rd_allocate, rd_choice_rows
from .decoupled import channel_cost, set_counts
from .routing import (
    Constraints,
    coupled_costs,
    per_layer,
    rank_heads,
    spread_shares,
    to_device,
    total_budget,
)
from .units import UnitLayout


@dataclass
class Plan:
    """New tiers: ``tiers`` int64 ``[L, H, U]`` (``U`` the most units of any layer; a layer's
    units past its own ``units[l]`` keep their tier), ``v[l]`` its ``[H, units[l]]`` view;
    decoupled policies also ``k[l]`` int64 ``[H, d]`` channel tiers and ``k_set[l]`` bool
    ``[H, T]``. ``over`` is a 0-d bool device tensor (forced bytes exceed the budget); reading
    ``over_budget`` syncs."""

    tiers: Tensor
    units: list[int]
    k: list[Tensor]
    k_set: list[Tensor]
    over: Tensor

    @property
    def v(self) -> list[Tensor]:
        return [self.tiers[li, :, :u] for li, u in enumerate(self.units)]

    @property
    def over_budget(self) -> bool:
        return bool(self.over)


@dataclass
class _Group:
    """Layers with the same token count; ``sel`` indexes them in ``[L, ...]`` tensors."""

    layers: list[int]
    sel: slice | list[int]
    n_tokens: int
    n_units: int
    copies: Tensor | None = None  # float64 [Q, G, H, U]: bytes of each kept ledger copy


def _copies(store, g: _Group) -> Tensor | None:
    held = store.stack.held(g.sel, g.n_units)
    return None if held is None else held * store.stack.copy_bytes_t.view(-1, 1, 1, 1)


def _groups(store) -> list[_Group]:
    by: dict[int, list[int]] = {}
    for li, t in enumerate(store.stack.n_tokens):
        by.setdefault(t, []).append(li)
    out = []
    for t, ls in by.items():
        sel = slice(ls[0], ls[-1] + 1) if ls == list(range(ls[0], ls[-1] + 1)) else ls
        g = _Group(ls, sel, t, store.layout.n_units(t))
        g.copies = _copies(store, g)
        out.append(g)
    return out


def _merge(parts: list[Tensor], groups: list[_Group]) -> Tensor:
    """Per-group ``[G, ...]`` -> ``[L, ...]`` in layer order."""
    if len(groups) == 1:
        return parts[0]
    order = [li for g in groups for li in g.layers]
    inv = sorted(range(len(order)), key=order.__getitem__)
    return torch.cat(parts)[inv]


def _constraints(store, g: _Group) -> Constraints:
    protected = store.layout.protected(g.n_tokens, store.policy.protect, store.device)
    masks = [
        store.scores.evaluate_layers(g.layers, r.when, store.layout) for r in store.policy.rules
    ]
    return _fold(store, protected, store.stack.tier[g.sel, :, : g.n_units], masks)


def _fold(store, protected: Tensor, tier: Tensor, masks: list[Tensor]) -> Constraints:
    """Constraints from the protected units, the tiers held (``[..., H, U]``; evicted units
    stay evicted) and each rule's mask, the later rules winning."""
    ts = store.tier_set
    gone = tier == ts.evict if ts.evict is not None else torch.zeros_like(tier, dtype=torch.bool)
    if not store.policy.rules:
        return Constraints(full=protected & ~gone, evict=gone, cap=None)
    full = torch.zeros_like(gone)
    evict, cap = torch.zeros_like(full), torch.zeros_like(full)
    for rule, m in zip(store.policy.rules, masks, strict=True):
        m = m.bool()
        if isinstance(rule.then, Evict):
            evict, full, cap = evict | m, full & ~m, cap & ~m
        elif isinstance(rule.then, Keep | Promote):
            full, evict, cap = full | m, evict & ~m, cap & ~m
        elif isinstance(rule.then, Demote):
            cap, full, evict = cap | m, full & ~m, evict & ~m
    full = (full | protected) & ~gone
    return Constraints(full=full, evict=(evict & ~protected) | gone, cap=cap & ~full)


def _forced_bytes(store, g: _Group, c: Constraints) -> Tensor:
    """float64 ``[G, H]``: bytes the forced-full units hold after routing (rows + kept copies)."""
    return _forced(store, store.stack.unit_tokens(g.sel, g.n_units), g.copies, c)


def _forced(store, tokens: Tensor, copies: Tensor | None, c: Constraints) -> Tensor:
    rows = (c.full * tokens).sum(-1) * (4.0 * store.head_dim)
    if copies is not None:
        rows = rows + (copies.sum(0) * c.full).sum(-1)
    return rows


def _costs(store, g: _Group) -> Tensor:
    """float64 ``[G, H, U, J]`` engine-tier costs."""
    return _cost_table(store, g.copies, len(g.layers), g.n_units)


def _cost_table(store, copies: Tensor | None, rows: int, n_units: int) -> Tensor:
    """float64 ``[rows, H, n_units, J]`` engine-tier costs of units keeping ``copies``."""
    cost = coupled_costs(store.tier_set, store.stack.unit_bytes_t, copies)
    return cost.expand(rows, store.n_heads, n_units, -1) if cost.dim() == 1 else cost


def _all_heads(shard, forced: Tensor, totals: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``forced`` float64 and ``totals`` ``[L, H_local]`` -> ``[L, H_total]``, every rank's heads
    in rank order: one all-gather of both stacked (float64 holds the float32 totals exactly).
    Every rank then derives the budget left and the shares as one engine over all heads does."""
    if shard.world == 1:
        return forced, totals
    parts = forced[None] if totals is None else torch.stack([forced, totals.double()])
    full = shard.gather_heads(parts, 2)
    return full[0], None if totals is None else full[1]


def plan_route(store) -> Plan:
    return _planned(store, *_budgets(store))


def _planned(store, groups, cons, head_budget: Tensor, out: Plan) -> Plan:
    """:func:`plan_route` once :func:`_budgets` gave its groups, constraints and budgets."""
    pol, st = store.policy, store.stack
    if isinstance(pol.allocate, RankAllocation):
        out.tiers = _place(
            st,
            [_rank(store, g, c, head_budget[g.sel]) for g, c in zip(groups, cons, strict=True)],
            groups,
        )
        return out
    if not store.coupled and all(g.copies is None for g in groups):
        return _rd_decoupled_groups(store, groups, cons, head_budget, out)
    head_budget = head_budget.tolist()
    v, k, k_set = {}, {}, {}
    for g, c in zip(groups, cons, strict=True):
        cost = _costs(store, g)
        for i, li in enumerate(g.layers):
            ci = c[i]
            if store.coupled:
                v[li] = _rd_coupled(store, li, ci, cost[i], head_budget[li])
            else:
                v[li], k[li], k_set[li] = _rd_decoupled(store, li, ci, cost[i], head_budget[li])
    layers = range(store.n_layers)
    out.k, out.k_set = [k[li] for li in layers if k], [k_set[li] for li in layers if k_set]
    units = out.units
    one = [_Group([li], slice(li, li + 1), 0, units[li]) for li in layers]
    out.tiers = _place(st, [v[li][None] for li in layers], one)
    return out


def plan_routes(stores: list) -> list[Plan]:
    """:func:`plan_route` of several stores of one policy and model shape (the requests a
    server routes at one step). Under rank allocation, where each store's layers hold one token
    count, the stores' layers are stacked (``[B * L, H, U]``, units padded to the longest: a
    padding unit is evicted or scores ``-inf``, holds nothing and costs nothing, so it is never
    placed, and rows never see each other) and planned together: constraints, budgets and
    one allocator call for all of them, the op count not growing with the stores but for each
    one's scores and inputs (in passes of stores of like lengths, each pass's tables within
    :data:`_RANK_TABLE_BYTES`: :func:`_rank_passes`); under RDKV's decoupled allocation
    likewise where every layer of every store holds one token count (:func:`_rd_stores`); else
    one by one. Equal to one :func:`plan_route` per store."""
    pol = stores[0].policy if stores else None
    if len(stores) > 1 and isinstance(pol.allocate, RateDistortion):
        plans = _rd_stores(stores)
        if plans is not None:
            return plans
    if (
        len(stores) < 2
        or not isinstance(pol.allocate, RankAllocation)
        or any(len(set(s.stack.n_tokens)) > 1 for s in stores)
    ):
        return [plan_route(s) for s in stores]
    plans: list[Plan | None] = [None] * len(stores)
    for part in _rank_passes(stores):
        some = [stores[i] for i in part]
        got = _rank_stacked(some) if len(some) > 1 else [plan_route(some[0])]
        for i, plan in zip(part, got, strict=True):
            plans[i] = plan
    return plans


# the rank allocator's tables over several stores' rows at most this size a pass (float64
# [rows, units, J] costs, a few tables of that shape live at once): a step that routes many
# long token-unit requests goes in parts (bench/routing_memory.py: 32 h2o requests of 1K-30K
# tokens at Qwen-0.5B's shape peak at 3.6 GiB in one pass, 0.85 GiB in passes)
_RANK_TABLE_BYTES = 1 << 27


def _rank_passes(stores: list) -> list[list[int]]:
    """Indices of ``stores`` in the passes :func:`plan_routes` stacks: by length, each pass's
    stores padded to its longest within :data:`_RANK_TABLE_BYTES` (one store at least)."""
    s0 = stores[0]
    per_unit = s0.n_layers * s0.n_heads * len(s0.tier_set.names) * 8
    order = sorted(range(len(stores)), key=lambda i: stores[i].stack.n_units(0))
    passes: list[list[int]] = []
    for i in order:  # ascending: the store joining a pass is its longest
        grown = passes[-1] + [i] if passes else [i]
        if passes and len(grown) * per_unit * stores[i].stack.n_units(0) <= _RANK_TABLE_BYTES:
            passes[-1] = grown
        else:
            passes.append([i])
    return passes


def _rank_stacked(stores: list) -> list[Plan]:
    """:func:`plan_routes`' one pass over ``stores`` (two or more, every layer of each holding
    one token count) under rank allocation."""
    pol = stores[0].policy
    s0, B, L = stores[0], len(stores), stores[0].n_layers
    ts, dev, layers = s0.tier_set, s0.device, list(range(L))
    us = [s.stack.n_units(0) for s in stores]
    u = max(us)

    def cat(parts: list[Tensor], value: float, after: int = 0, dim: int = 0) -> Tensor:
        return torch.cat([_pad(x, u, value, after) for x in parts], dim)

    memo: dict[tuple, Tensor] = {}  # inputs that depend on the lengths alone, made once each

    def once(key: tuple, make) -> Tensor:
        if key not in memo:
            memo[key] = make()
        return memo[key]

    gone = ts.evict if ts.evict is not None else 0  # a padding unit holds nothing
    tier = cat([s.stack.tier[:, :, :n] for s, n in zip(stores, us, strict=True)], gone)
    prot = [
        once(("protected", t), lambda t=t: s0.layout.protected(t, pol.protect, dev))
        for t in (s.stack.n_tokens[0] for s in stores)
    ]
    prot = cat([p.expand(L, 1, -1) for p in prot], False)  # [B*L, 1, U]
    masks = [
        cat([s.scores.evaluate_layers(layers, r.when, s.layout) for s in stores], 0)
        for r in pol.rules
    ]
    c = _fold(s0, prot, tier, masks)
    tokens = [
        once(
            ("tokens", tuple(s.stack.n_tokens)),
            lambda s=s, n=n: s.stack.unit_tokens(slice(None), n),
        )
        for s, n in zip(stores, us, strict=True)
    ]
    tokens = cat([t.expand(L, 1, -1) for t in tokens], 0)
    copies = _copies_stacked(stores, us)  # [Q, B*L, H, U]
    forced = _forced(s0, tokens, copies, c)  # [B*L, H]
    totals = None
    if pol.spread.kind == "proportional":
        spread = [s.scores.evaluate_layers(layers, pol.spread.by, s.layout) for s in stores]
        totals = torch.cat([x.float().sum(-1) for x in spread])
    forced, totals = _all_heads(s0.shard, forced, totals)  # [B*L, H_total]
    budget = [
        total_budget(s.budget, s.stack.n_tokens, s.shard.heads_total, s.head_dim) for s in stores
    ]
    rest = to_device(torch.tensor(budget, dtype=torch.float64), dev)  # the host's exact budgets
    rest = rest - forced.view(B, -1).sum(1)
    if totals is None:
        shares = s0.shares.expand(B, *s0.shares.shape)
    else:  # each store's own spread over its layers and heads
        shares = torch.stack([
            s0.shard.local(spread_shares(pol.spread, L, t.shape[1], t, dev), 1)
            for t in totals.view(B, L, -1)
        ])  # fmt: skip
    head_budget = torch.floor(shares * rest.clamp(min=0.0).view(B, 1, 1)).flatten(0, 1)
    cost_p = _cost_table(s0, copies, B * L, u)[..., ts.offset :]
    by = [_ranking(s, layers) for s in stores]
    score = cat(by, -torch.inf, after=by[0].dim() - 3)
    routed = [s.stack.routed_units[li] for s in stores for li in layers]
    score, cost, prev = _rank_tensors(s0, score, tier, c, cost_p, routed)
    tier_p = _allocate(pol, ts, score, cost, head_budget, prev)
    tiers = _rank_finish(s0, tier_p, cost_p, c)
    over = rest < 0
    return [
        Plan(tiers[b * L : (b + 1) * L, :, :n], [n] * L, [], [], over[b]) for b, n in enumerate(us)
    ]


def _copies_stacked(stores: list, us: list[int]) -> Tensor | None:
    """float64 ``[Q, B * L, H, U]``: :func:`_copies` of every store's layers, stacked (units
    padded to the longest; one ``cat`` per quantized tier where every store holds ``U``)."""
    s0, u = stores[0], max(us)
    if not s0.stack.write_once or not s0.stack.stores:  # no copies kept (CoupledStack.held)
        return None
    if len(set(us)) > 1:
        held = [_copies(s, _Group([], slice(None), 0, n)) for s, n in zip(stores, us, strict=True)]
        return torch.cat([_pad(x, u, 0.0) for x in held], 1)
    held = torch.stack([
        torch.cat([s.stack.stores[j].present[:, :, :u] for s in stores])
        for j in s0.stack.stores
    ])  # fmt: skip
    if s0.stack.tiers.archive is not None:  # archived copies are not the requests' (own())
        held = held & torch.cat([s.stack.attended(slice(None), u) for s in stores])
    return held * s0.stack.copy_bytes_t.view(-1, 1, 1, 1)


def _pad(x: Tensor, u: int, value: float, after: int = 0) -> Tensor:
    """``x`` with its units dim (``after`` dims from the end after it) padded to ``u``."""
    n = x.shape[-1 - after]
    return x if n == u else F.pad(x, (0, 0) * after + (0, u - n), value=value)


def _budgets(store) -> tuple[list[_Group], list[Constraints], Tensor, Plan]:
    """Groups of layers, their constraints, each (layer, head)'s budget (float64 ``[L, H]``)
    and the plan to fill (tiers as they are)."""
    pol, dev, st = store.policy, store.device, store.stack
    groups = _groups(store)
    cons = [_constraints(store, g) for g in groups]
    forced = _merge(
        [_forced_bytes(store, g, c) for g, c in zip(groups, cons, strict=True)], groups
    )  # [L, H]
    totals = None
    if pol.spread.kind == "proportional":
        totals = _merge(
            [
                store.scores.evaluate_layers(g.layers, pol.spread.by, store.layout).float().sum(-1)
                for g in groups
            ],
            groups,
        )
    forced, totals = _all_heads(store.shard, forced, totals)  # [L, H_total]
    budget = total_budget(store.budget, st.n_tokens, store.shard.heads_total, store.head_dim)
    rest = budget - forced.sum()  # float64 0-d, on device
    shares = (
        store.shares
        if totals is None
        else store.shard.local(spread_shares(pol.spread, *totals.shape, totals, dev), 1)
    )
    head_budget = torch.floor(shares * rest.clamp(min=0.0))  # float64 [L, H]
    units = [st.n_units(li) for li in range(store.n_layers)]
    return groups, cons, head_budget, Plan(st.tier[..., : max(units)], units, [], [], rest < 0)


def _place(st, parts: list[Tensor], groups: list[_Group]) -> Tensor:
    """Per-group tiers ``[G, H, U_g]`` -> ``[L, H, U]`` (units a layer lacks keep theirs)."""
    u = max(g.n_units for g in groups)
    if len(groups) == 1 and groups[0].n_units == u:
        return parts[0]
    out = st.tier[..., :u].clone()
    for g, t in zip(groups, parts, strict=True):
        out[g.sel, :, : g.n_units] = t
    return out


def _finish(store, tier_p: Tensor, cost_p: Tensor, c: Constraints) -> Tensor:
    ts = store.tier_set
    cheapest = cost_p.argmin(-1) + ts.offset if ts.evict is None else ts.evict
    return c.apply(tier_p + ts.offset, ts, cheapest)


def _rank(store, g: _Group, c: Constraints, budgets: Tensor) -> Tensor:
    """Rank allocation of a group of layers in one allocator call; ``budgets`` float64
    ``[G, H]``. Allocator inputs: score ``[G, H, U]``, cost ``[G, H, U, J]``, previous tier
    (:func:`_rank_tensors`)."""
    cost_p = _costs(store, g)[..., store.tier_set.offset :]
    score = _ranking(store, g.layers)
    tier = store.stack.tier[g.sel, :, : g.n_units]
    routed = [store.stack.routed_units[li] for li in g.layers]
    score, cost, prev = _rank_tensors(store, score, tier, c, cost_p, routed)
    tier_p = _allocate(store.policy, store.tier_set, score, cost, budgets, prev)
    return _rank_finish(store, tier_p, cost_p, c)


def _ranking(store, layers) -> Tensor:
    """float32 ``[G, H, U]``: ``allocate.by`` over ``layers``; with a ranking per kept tier
    (``by_tier``) ``[G, H, U, K]``, tier ``k``'s in column ``k`` (the layers' rows read once)."""
    exprs = store.policy.allocate.rankings()
    caches = store.scores.caches(layers) if len(exprs) > 1 else None
    xs = [store.scores.evaluate_layers(layers, e, store.layout, caches=caches).float()
          for e in exprs]  # fmt: skip
    return xs[0] if len(xs) == 1 else torch.stack(xs, -1)


def _rank_tensors(store, score, tier, c: Constraints, cost_p, routed: list[int]):
    """Score with evicted units at -inf, costs with forced units at 0, and the previous policy
    tier (the implicit full tier (-1) and units never routed, past ``routed[l]``, map to the
    allocator's last column, like the old code's "no previous tier") of ``[..., H, U]`` units."""
    ts = store.tier_set
    evict = c.evict if score.dim() == c.evict.dim() else c.evict[..., None]  # per-tier columns
    score = torch.where(evict, -torch.inf, torch.nan_to_num(score, nan=-torch.inf))
    last = cost_p.shape[-1] - (0 if ts.evict is None else 1)
    prev = (tier - ts.offset).remainder_(last + 1)
    if len(set(routed)) == 1:
        prev[..., routed[0] :] = last
    else:
        new = torch.arange(tier.shape[-1], device=tier.device) >= per_layer(routed, tier.device)
        prev = torch.where(new, last, prev)
    return score, torch.where((c.full | c.evict)[..., None], 0.0, cost_p), prev


def _allocate(pol, ts, score: Tensor, cost: Tensor, budgets: Tensor, prev: Tensor) -> Tensor:
    a: RankAllocation = pol.allocate
    # the allocator is exact with as many rounds as distinct positive costs per tier column: a
    # unit's cost is its tier's bytes plus the copies it keeps, one of 2**Q values with Q
    # quantized tiers under a write-once ledger, a single value otherwise (forced units cost 0
    # and take no round)
    rounds = 2 ** len(ts.quantized) if pol.ledger.write_once else 1
    return rank_heads(
        score, cost, budgets, shares=a.shares, previous=prev, hysteresis=a.hysteresis,
        has_evict=ts.evict is not None, rounds=rounds,
    )  # fmt: skip


def _rank_finish(store, tier_p: Tensor, cost_p: Tensor, c: Constraints) -> Tensor:
    if store.tier_set.evict is None:  # left by the allocator: the cheapest tier (flagged)
        tier_p = torch.where(tier_p == cost_p.shape[-1], cost_p.argmin(-1), tier_p)
    return _finish(store, tier_p, cost_p, c)


def _weights(store, li: int, expr, layout: UnitLayout) -> Tensor:
    w = store.scores.evaluate(li, expr, layout).double()
    return torch.nan_to_num(w, nan=0.0, posinf=1e300, neginf=0.0).clamp(min=0)


def _rd_coupled(store, li: int, c: Constraints, cost: Tensor, budgets: list[float]) -> Tensor:
    """``cost`` float64 ``[H, U, J]`` engine-tier costs of layer ``li``."""
    a: RateDistortion = store.policy.allocate
    ts = store.tier_set
    cost_p = cost[..., ts.offset :]
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


def _rd_decoupled(store, li: int, c: Constraints, cost: Tensor, budgets: list[float]):
    a: RateDistortion = store.policy.allocate
    ts, lay = store.tier_set, store.layers[li]
    v_tier = _rd_coupled(store, li, c, cost, [a.v_share * b for b in budgets])
    ev = -1 if ts.evict is None else ts.evict
    k_set = (v_tier != ev) & ~c.full
    n_set = set_counts(v_tier, k_set, len(ts.names))
    chan = UnitLayout("channel", 1, store.head_dim)
    kw, ks = _weights(store, li, a.k_weight, chan), _weights(store, li, a.sigma, chan)
    k_cost = channel_cost(n_set, lay.k.bits, a.group)[:, ts.offset :]
    v_cost = cost.gather(-1, v_tier[..., None])[..., 0]
    v_spent = torch.where(c.full | c.evict, 0.0, v_cost).sum(1).tolist()
    k_tier = torch.zeros(store.n_heads, store.head_dim, dtype=torch.long, device=store.device)
    for h in range(store.n_heads):
        cost_h = k_cost[h].expand(store.head_dim, -1)
        res = rd_allocate(kw[h], ks[h], cost_h, a.bits, max(budgets[h] - v_spent[h], 0.0))
        k_tier[h] = res.choice + ts.offset
    return v_tier, k_tier, store.layout.token_mask(k_set, lay.v.n_tokens)


def _rd_decoupled_groups(store, groups, cons, head_budget: Tensor, out: Plan) -> Plan:
    """RDKV's plan as device tensor ops, no host sync: per group of layers one batched
    allocation of V tokens over every (layer, head), then one of K channels over the kept
    tokens (:func:`~.allocate_rd.rd_choice_rows`; what :func:`_rd_decoupled` decides per layer
    and head). Rows share one cost table (no ledger copies), so the allocator's fixed rounds
    are exact."""
    v, k, k_set = [None] * store.n_layers, [None] * store.n_layers, [None] * store.n_layers
    for g, c in zip(groups, cons, strict=True):
        vt, kt, ks = _rd_decoupled_group(store, g, c, _costs(store, g), head_budget[g.sel])
        for i, li in enumerate(g.layers):
            v[li], k[li], k_set[li] = vt[i], kt[i], ks[i]
    out.k, out.k_set = k, k_set
    one = [_Group([li], slice(li, li + 1), 0, out.units[li]) for li in range(store.n_layers)]
    out.tiers = _place(store.stack, [x[None] for x in v], one)
    return out


# the allocator's tables over several stores' rows at most this size a pass (float64
# [rows, units, J], a few of them live at once): long prompts at a large batch go in parts
_RD_TABLE_BYTES = 1 << 27


def _rd_stores(stores: list) -> list[Plan] | None:
    """RDKV's plan of several stores of one decoupled policy whose layers all hold one token
    count and keep no ledger copies: each store's constraints, budgets and weights, then one
    V allocation and one K allocation over every store's (layer, head) rows stacked
    (``[B * L, H, ...]``); rows never see each other, so each store's plan is the one
    :func:`_rd_decoupled_groups` makes. None where the stores do not fit."""
    s0 = stores[0]
    if s0.coupled or len({tuple(s.stack.n_tokens) for s in stores}) > 1:
        return None
    parts = [_budgets(s) for s in stores]  # (groups, constraints, head budgets, plan)
    if len(parts[0][0]) > 1 or any(p[0][0].copies is not None for p in parts):
        return [_planned(s, *p) for s, p in zip(stores, parts, strict=True)]
    g, J = parts[0][0][0], len(s0.tier_set.names)
    per = s0.n_layers * s0.n_heads * g.n_units * J * 8  # a store's float64 [L, H, U, J] table
    n = max(1, _RD_TABLE_BYTES // per)
    plans = []
    for b in range(0, len(stores), n):
        plans += _rd_stacked(stores[b : b + n], parts[b : b + n], g)
    return plans


def _rd_stacked(stores: list, parts: list, g: _Group) -> list[Plan]:
    """:func:`_rd_stores`' one pass over ``stores`` (``parts``: their :func:`_budgets`)."""
    s0, L, B = stores[0], stores[0].n_layers, len(stores)
    cons = [p[1][0] for p in parts]
    cap = None if cons[0].cap is None else torch.cat([c.cap for c in cons])
    c = Constraints(torch.cat([c.full for c in cons]), torch.cat([c.evict for c in cons]), cap)
    budgets = torch.cat([p[2][g.sel] for p in parts])  # [B * L, H]
    weights = [torch.cat(x) for x in zip(*(_rd_weights(s, g) for s in stores), strict=True)]
    cost = _cost_table(s0, None, B * L, g.n_units)
    vt, kt, ks = _rd_decoupled_group(s0, g, c, cost, budgets, weights)
    plans = []
    for b, (s, p) in enumerate(zip(stores, parts, strict=True)):
        rows, out = slice(b * L, (b + 1) * L), p[3]
        out.k, out.k_set = list(kt[rows]), list(ks[rows])
        out.tiers = _place(s.stack, [vt[rows]], [g])
        plans.append(out)
    return plans


def _rd_weights(store, g: _Group) -> list[Tensor]:
    """float64 V weights and spreads ``[G, H, U]``, K weights and spreads ``[G, H, d]`` of a
    group's layers (each layer's rows read once for all four)."""
    a: RateDistortion = store.policy.allocate
    caches = store.scores.caches(g.layers)
    chan = UnitLayout("channel", 1, store.head_dim)
    return [
        _weights_layers(store, g, a.v_weight, store.layout, caches),
        _weights_layers(store, g, a.sigma, store.layout, caches),
        _weights_layers(store, g, a.k_weight, chan, caches),
        _weights_layers(store, g, a.sigma, chan, caches),
    ]


def _rd_decoupled_group(
    store, g: _Group, c: Constraints, cost: Tensor, budgets: Tensor, weights=None
):
    """``cost`` float64 ``[G, H, U, J]``, ``budgets`` float64 ``[G, H]``: V tiers ``[G, H, U]``,
    K channel tiers ``[G, H, d]`` and the channel set ``[G, H, T]``. ``G`` rows of ``g``'s
    layers (several stores' stacked: ``weights``, :func:`_rd_weights` of them all)."""
    a: RateDistortion = store.policy.allocate
    ts, H, d = store.tier_set, store.n_heads, store.head_dim
    G, U = budgets.shape[0], g.n_units
    cost_p = cost[..., ts.offset :]
    J = cost_p.shape[-1]
    w, sig, kw, ks = weights if weights is not None else _rd_weights(store, g)
    active = ~(c.full | c.evict)
    R = G * H  # one allocator row per (layer, head)
    v_budget = (a.v_share * budgets).reshape(R)
    choice = rd_choice_rows(
        w.reshape(R, U), sig.reshape(R, U), cost_p.reshape(R, U, J), a.bits, v_budget,
        active.reshape(R, U),
    )  # fmt: skip
    v_tier = _finish(store, choice.view(G, H, U), cost_p, c)
    ev = -1 if ts.evict is None else ts.evict
    in_set = (v_tier != ev) & ~c.full
    n_set = set_counts(v_tier, in_set, len(ts.names))
    bits = store.layers[g.layers[0]].k.bits
    k_cost = channel_cost(n_set.view(R, -1), bits, a.group)[:, ts.offset :]
    v_cost = cost.gather(-1, v_tier[..., None])[..., 0]
    v_spent = torch.where(c.full | c.evict, 0.0, v_cost).sum(-1)
    k_budget = (budgets - v_spent).clamp(min=0.0).reshape(R)
    every = torch.ones(R, d, dtype=torch.bool, device=store.device)
    k_choice = rd_choice_rows(
        kw.reshape(R, d), ks.reshape(R, d), k_cost[:, None, :].expand(R, d, J), a.bits,
        k_budget, every,
    )  # fmt: skip
    k_tier = k_choice.view(G, H, d) + ts.offset
    return v_tier, k_tier, store.layout.token_mask(in_set, g.n_tokens)


def _weights_layers(store, g: _Group, expr, layout: UnitLayout, caches=None) -> Tensor:
    """:func:`_weights` of a group's layers, ``[G, H, X]`` (``caches``: theirs, shared)."""
    w = store.scores.evaluate_layers(g.layers, expr, layout, caches=caches).double()
    return torch.nan_to_num(w, nan=0.0, posinf=1e300, neginf=0.0).clamp(min=0)
