"""From a policy to new tiers: budgets, spread, per-unit costs, rules, allocator calls.

Budget (bytes, at routing time): ``fraction`` of the full-precision bytes of every token cached
so far (2 bytes per element, K and V), absolute ``bytes``, or ``tokens`` x the full bytes of one
token over all layers and heads.

Paid first: *forced-full* units (protected sinks/recent, the partial trailing window, units a
``keep``/``promote`` rule holds) with any ledger copies they keep. The rest of the budget is
spread over (layer, KV head): ``uniform``; ``pyramid(ratio)`` (layer 0 gets ``ratio`` x the last
layer's share, linear in between, each layer's share split evenly over its heads);
``proportional(expr)`` (share proportional to the (layer, head) sum of ``expr`` over its units,
negative values count 0, uniform if the total is not positive). Each head's allocation spends at
most its share, so ``bytes_used <= budget`` after routing unless the forced units alone exceed the
budget, or no tier is cheap enough (no evict tier): then every routable unit gets its cheapest
option and the step is flagged ``over_budget`` (never silently).

Rules, in file order (a later rule wins on the same unit): ``evict`` forces evicted, ``keep`` and
``promote`` force the full tier, ``demote`` caps at the first quantized tier. Protected units are
always full; evicted units stay evicted (their data is gone).

Allocation sees forced units at cost 0 and overrides their tiers afterwards, so the allocator's
budget is exactly the routable share. Unit costs per tier (``cost[h, u, j]``) come from the codec:
full rows ``2 * 2 * W * d``, a quantized copy ``unit_nbytes``, evicted 0; with a write-once ledger
every copy the unit keeps is added (moving into a tier whose copy exists adds nothing new).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tiered_radix.policy.model import Budget, Evict, Keep, Policy, Quantize, Spread, Tier


class EngineConfigError(ValueError):
    """The policy asks for a layout the engine cannot store (e.g. a group that does not divide
    the window); the message says what to change."""


@dataclass(frozen=True)
class TierSet:
    """The engine's tiers: the policy's, with an implicit ``full`` tier first when the policy
    has no ``keep`` tier (protected units need one). Index 0 is always full precision."""

    tiers: tuple[Tier, ...]
    offset: int  # engine index = policy index + offset

    @classmethod
    def of(cls, policy: Policy) -> TierSet:
        keeps = [i for i, t in enumerate(policy.tiers) if isinstance(t.action, Keep)]
        if keeps and keeps != [0]:
            raise EngineConfigError(
                "the keep(...) tier must be the first (best) tier, and only "
                "one; list tiers best first: keep, quantize..., evict"
            )
        if keeps:
            return cls(policy.tiers, 0)
        return cls((Tier("full", Keep()), *policy.tiers), 1)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    @property
    def evict(self) -> int | None:
        return len(self.tiers) - 1 if isinstance(self.tiers[-1].action, Evict) else None

    @property
    def archive(self) -> int | None:
        """Engine index of the quantized tier whose copies evicted units keep
        (``evict(archive=...)``), or None."""
        ev = self.evict
        name = None if ev is None else self.tiers[ev].action.archive
        return None if name is None else self.names.index(name)

    @property
    def quantized(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if isinstance(t.action, Quantize)]

    @property
    def quantized_slice(self) -> slice:
        """The quantized tiers as a slice (they sit between full and evicted)."""
        q = self.quantized
        assert q == list(range(q[0], q[-1] + 1)) if q else True, "quantized tiers are contiguous"
        return slice(q[0], q[-1] + 1) if q else slice(0, 0)

    @property
    def first_quantized(self) -> int | None:
        q = self.quantized
        return q[0] if q else None


def full_token_bytes(n_heads: int, head_dim: int) -> int:
    """Bytes of one token's K and V rows at full precision in one layer."""
    return 2 * 2 * n_heads * head_dim


def total_budget(budget: Budget, tokens_per_layer: list[int], n_heads: int, head_dim: int) -> int:
    full = sum(tokens_per_layer) * full_token_bytes(n_heads, head_dim)
    if budget.kind == "fraction":
        return int(budget.value * full)
    if budget.kind == "bytes":
        return int(budget.value)
    return int(budget.value) * len(tokens_per_layer) * full_token_bytes(n_heads, head_dim)


def spread_shares(
    spread: Spread,
    n_layers: int,
    n_heads: int,
    totals: Tensor | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """float64 ``[L, H]`` shares summing to 1 on ``device`` (no host sync). ``totals[L, H]``
    for ``proportional``."""
    w = torch.ones(n_layers, dtype=torch.float64, device=device)
    if spread.kind == "pyramid" and n_layers > 1:
        pos = torch.arange(n_layers, device=device)
        w = (spread.ratio + (1 - spread.ratio) * pos / (n_layers - 1)).double()
    even = (w / w.sum())[:, None].expand(n_layers, n_heads) / n_heads
    if spread.kind != "proportional":
        return even
    assert totals is not None
    t = torch.nan_to_num(totals.double().to(device), nan=0.0, posinf=0.0).clamp(min=0)
    total = t.sum()
    return torch.where(total > 0, t / torch.where(total > 0, total, 1.0), even)


def to_device(values: list | Tensor, device) -> Tensor:
    """Host ``values`` (ints, nested lists of ints: int64; or a host tensor) on ``device``,
    copied from pinned memory on CUDA: no host sync, no wait for the device's stream."""
    t = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.long)
    if device is not None and torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def per_layer(values: list[int], device: torch.device | None = None) -> int | Tensor:
    """One int per layer, to broadcast against ``[G, H, U]``: the int itself when every layer
    has the same (the usual case, no copy), else int64 ``[G, 1, 1]`` on ``device`` (copied
    without a host sync on CUDA)."""
    if len(set(values)) == 1:
        return values[0]
    return to_device(values, device)[:, None, None]


def coupled_costs(tiers: TierSet, unit_bytes: Tensor, copies: Tensor | None) -> Tensor:
    """float64 ``[..., U, n_tiers]``. ``unit_bytes`` float64 ``[n_tiers]`` (on the device):
    bytes of one unit at each tier; ``copies[Q, ..., U]`` float64 (write-once ledger only):
    bytes of the copy a unit keeps at quantized tier ``tiers.quantized[q]``, 0 if none; without
    it the result is ``[n_tiers]`` (same for every unit)."""
    if copies is None:
        return unit_bytes
    cost = unit_bytes + copies.sum(0)[..., None]  # a unit pays every copy it keeps ...
    cost[..., tiers.quantized_slice] -= copies.movedim(0, -1)  # ... and its own tier's once
    if tiers.evict is not None:
        cost[..., tiers.evict] = 0.0
    return cost


@dataclass
class Constraints:
    """Per-unit constraints of a layer (``[H, U]``) or a group of layers (``[G, H, U]``), bool."""

    full: Tensor  # forced to tier 0
    evict: Tensor  # forced evicted (or to the cheapest tier when there is no evict tier)
    cap: Tensor | None  # at most the first quantized tier (None: no unit is capped)

    def apply(self, tier: Tensor, tiers: TierSet, cheapest: Tensor | int) -> Tensor:
        """Override allocated ``tier`` (engine indices); ``cheapest``: the evict tier, or per
        unit the cheapest tier for evictions in a policy without an evict tier."""
        q = tiers.first_quantized
        if q is not None and self.cap is not None:
            tier = torch.where(self.cap, tier.clamp(min=q), tier)
        tier = torch.where(self.evict, cheapest, tier)
        return torch.where(self.full, 0, tier)

    def __getitem__(self, i: int) -> Constraints:
        """Layer ``i`` of a group."""
        return Constraints(self.full[i], self.evict[i], None if self.cap is None else self.cap[i])


def rank_heads(
    score: Tensor,
    cost: Tensor,
    budget: Tensor,
    *,
    shares,
    previous: Tensor,
    hysteresis: float,
    has_evict: bool,
    rounds: int,
) -> Tensor:
    """Rank allocation for every row at once: ``score[..., U]`` (-inf: evict), ``cost[..., U,
    J]`` (policy tiers), ``budget[...]`` float64 bytes, ``previous[..., U]`` policy tier index
    of the last routing, ``J - 1`` (no evict tier: ``J``) for units never routed; ``...`` is
    ``[H]`` or ``[L, H]``. Without an evict tier a zero-cost column is appended for the
    allocator and the units it leaves there come back as ``J`` (the caller moves them to their
    cheapest tier). ``rounds``: see ``rank_allocate``. Returns int64 ``[..., U]`` policy tier
    indices; one allocator call, no host sync.
    """
    from .allocate_rank import rank_allocate

    if not has_evict:
        cost = torch.cat([cost, cost.new_zeros(*cost.shape[:-1], 1)], -1)
    tier = rank_allocate(
        score,
        cost,
        budget,
        shares=shares,
        previous=previous,
        hysteresis=hysteresis,
        rounds=rounds,
        validate=False,
    )
    return tier.long()
