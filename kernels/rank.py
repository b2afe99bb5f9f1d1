"""Rank allocation in one launch: every (layer, head) row of a routing sorted and filled at once.

The definition and PyTorch twin is ``tiered_radix.engine.allocate_rank.rank_allocate`` (its
module docstring states the rule); this kernel equals it bit for bit for float32 scores, integer
byte costs and a fixed round count, which is what the planner passes. On a GPU the twin costs
~90 launching ops a routing (a sort, gathers, a scatter and ``rounds`` cumulative sums per tier);
here one program per row keeps its units in registers: the ranking is one ``tl.sort`` of int64
keys (the float32 effective score's order bits above the unit index), the fill is the twin's
rounds over the sorted lanes, and the tier map in global memory carries the state from one tier
to the next.

Shapes: ``R`` rows (any leading shape, flattened), ``U <= MAX_UNITS`` units a row, ``T`` tiers
(last: evicted, cost 0).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton

from ._device import triton_runs_on
from ._rank_kernels import _rank_allocate_kernel

MAX_UNITS = 4096  # one program sorts a row in registers; longer rows take the twin


def fits(score: torch.Tensor, cost: torch.Tensor, rounds: int | None) -> bool:
    """Whether :func:`rank_allocate_rows` takes these arguments (the twin takes any)."""
    n = cost.shape[-2]
    return rounds is not None and score.dtype == torch.float32 and 0 < n <= MAX_UNITS


@functools.lru_cache(maxsize=64)
def _cumulative(shares: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """float64 ``[T - 1]`` running sums of ``shares``, summed on the host as the twin does; one
    copy to the device per policy."""
    out, acc = [], 0.0
    for s in shares:
        acc += s
        out.append(acc)
    return torch.tensor(out, dtype=torch.float64, device=device)


def rank_allocate_rows(
    score: torch.Tensor,
    cost: torch.Tensor,
    budget: torch.Tensor | float,
    *,
    shares: Sequence[float],
    protected: torch.Tensor | None = None,
    previous: torch.Tensor | None = None,
    hysteresis: float = 0.0,
    rounds: int,
) -> torch.Tensor:
    """Tier per unit, int8 ``[..., U]``, as ``rank_allocate(..., rounds=rounds)``.

    Args:
        score: float32 ``[..., U]``, or ``[..., U, T - 1]`` for a ranking per kept tier.
        cost: ``[..., U, T]`` bytes (converted to float64); last column 0.
        budget: bytes per row, a float or a ``[...]`` tensor.
        shares: ``T - 1`` fractions of the budget.
        protected: bool ``[..., U]`` units forced to tier 0 and paid first.
        previous: integer ``[..., U]`` tiers of the last routing (hysteresis).
        rounds: fill rounds per tier (exact with as many as distinct positive costs a column).

    No argument checks beyond shapes: the twin's ``validate`` does those.
    """
    if not (triton_runs_on(score) and fits(score, cost, rounds)):
        raise ValueError(
            f"rank_allocate_rows takes float32 scores with 1..{MAX_UNITS} units on CUDA (CPU "
            f"under TRITON_INTERPRET=1) and a fixed round count; got {score.dtype} with "
            f"{cost.shape[-2]} units on {score.device}, rounds={rounds}. Use "
            "tiered_radix.engine.allocate_rank.rank_allocate (the same result for any input)."
        )
    n, n_tiers = cost.shape[-2], cost.shape[-1]
    per_tier = score.dim() == cost.dim()
    lead = cost.shape[:-2]
    dev = score.device
    rows = lead.numel()
    tier = torch.empty(lead + (n,), dtype=torch.int8, device=dev)
    if rows == 0:
        return tier
    budget = torch.as_tensor(budget, dtype=torch.float64, device=dev).expand(lead).contiguous()
    dummy = tier  # never read when its flag is off
    _rank_allocate_kernel[(rows,)](
        score.contiguous(),
        cost.to(torch.float64).contiguous(),
        budget,
        _cumulative(tuple(float(s) for s in shares), dev),
        dummy if previous is None else previous.to(torch.int64).contiguous(),
        dummy if protected is None else protected.contiguous().view(torch.uint8),
        tier,
        n,
        float(hysteresis),
        T=n_tiers,
        ROUNDS=int(rounds),
        BLOCK=max(16, triton.next_power_of_2(n)),
        PER_TIER=per_tier,
        HAS_PREV=previous is not None and hysteresis != 0,  # the twin adds no bonus at 0
        HAS_PROT=protected is not None,
        num_warps=4 if n <= 1024 else 8,
    )
    return tier
