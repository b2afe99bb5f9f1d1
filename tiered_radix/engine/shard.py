"""``HeadShard``: the slice of the KV heads one tier engine holds under tensor parallelism.

With ``--tp N`` rank ``r`` holds KV heads ``[r * H / N, (r + 1) * H / N)`` of every layer and
runs its own :class:`~tiered_radix.engine.store.TierStore` over them. Per-head work (ranking
within a head's budget, rate-distortion per head, scores) needs nothing from other ranks; what
the routing step computes over *all* heads does, and every rank computes it from the same
gathered inputs in the same order as one engine over all heads, so rank ``r``'s tiers equal that
engine's tiers of its heads bit for bit and ranks never drift apart.

Collectives (``world > 1`` only; ``HeadShard.single`` never communicates):

- ``plan_route``: one all-gather of float64 ``[P, L, H_local]``: the bytes forced-full units
  hold (for the budget left after them) and, with ``spread: proportional``, the (layer, head)
  totals of the spread expression (for the shares, normalised over all heads).
- ``apply``: one all-reduce of the int64 bytes held, so each step's record (``bytes_used``,
  ``over_budget``) is the whole model's, equal on every rank.
- ``schedule_due``: one all-reduce of the int64 bytes held when ``on_pressure`` is checked.
- ``sum_heads``/``mean_heads``/``max_heads`` in a score: one all-gather of the reduced value's
  argument per evaluation (:class:`~.scores.ScoreEvaluator`'s ``gather_heads``), so the
  reduction runs over every head in head order, as one engine's does.

Every rank must make these calls in the same order (route and ask ``schedule_due`` at the same
steps), as it does when all ranks run the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class HeadShard:
    """Rank ``rank`` of ``world`` holds the contiguous heads ``[start, start + heads_local)`` of
    ``heads_total``; collectives run on ``group`` (``None``: the default process group).

    Raises:
        ValueError: ``world < 1``, ``rank`` outside ``[0, world)``, or ``heads_total`` not a
            positive multiple of ``world``.
    """

    rank: int
    world: int
    heads_total: int
    group: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(
                f"HeadShard needs 0 <= rank < world, got rank={self.rank}, world={self.world}"
            )
        if self.heads_total < self.world or self.heads_total % self.world:
            raise ValueError(
                f"{self.heads_total} KV heads cannot be split evenly over {self.world} ranks; "
                "the tier engine needs each rank to hold heads_total / world distinct heads "
                "(replicated KV heads, tp > num_kv_heads, are not supported)"
            )

    @classmethod
    def single(cls, heads: int) -> HeadShard:
        """All ``heads`` in one engine: no communication."""
        return cls(0, 1, heads)

    @classmethod
    def of_group(cls, heads_total: int, group=None) -> HeadShard:
        """This process's shard of ``heads_total`` KV heads in ``group`` (an initialised
        ``torch.distributed`` process group; ``None``: the default one), ranked by group rank."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("HeadShard.of_group needs torch.distributed initialised")
        return cls(dist.get_rank(group), dist.get_world_size(group), heads_total, group)

    @property
    def heads_local(self) -> int:
        return self.heads_total // self.world

    @property
    def start(self) -> int:
        return self.rank * self.heads_local

    @property
    def heads(self) -> slice:
        """This rank's heads as a slice of the ``heads_total`` axis."""
        return slice(self.start, self.start + self.heads_local)

    def local(self, t: Tensor, dim: int) -> Tensor:
        """This rank's heads of ``t`` (``heads_total`` along ``dim``): a view; ``t`` itself
        when ``world == 1``."""
        return t if self.world == 1 else t.narrow(dim, self.start, self.heads_local)

    def sum(self, t: Tensor) -> Tensor:
        """A new tensor: ``t`` summed over the ranks (all-reduce; integer and float64 sums of
        integer values are exact, so every rank gets the same bits)."""
        out = t.clone()
        if self.world > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def least(self, t: Tensor) -> Tensor:
        """A new tensor: the elementwise minimum of ``t`` over the ranks (all-reduce), so that
        a choice made from a per-rank reading (e.g. free device memory) is every rank's."""
        out = t.clone()
        if self.world > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MIN, group=self.group)
        return out

    def gather_heads(self, t: Tensor, dim: int) -> Tensor:
        """Every rank's ``t`` (``heads_local`` along ``dim``, same shape and dtype on every
        rank) concatenated in rank order along ``dim`` (all-gather): ``heads_total`` along
        ``dim``. ``t`` itself when ``world == 1``."""
        if self.world == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim)
