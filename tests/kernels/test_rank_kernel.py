"""The Triton rank allocation against its PyTorch twin (``engine.allocate_rank``), bit for bit.

On CPU the kernel runs under ``TRITON_INTERPRET=1``; on CUDA at the planner's sizes too.
"""

from __future__ import annotations

import pytest
import torch
from triton_guard import CUDA, require_triton  # noqa: E402

require_triton()

from tiered_radix.kernels.rank import MAX_UNITS, fits, rank_allocate_rows  # noqa: E402

from tiered_radix.engine.allocate_rank import rank_allocate  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def case(seed, rows=(3, 2), n=37, n_tiers=3, n_values=2, ties=False, per_tier=False):
    """Integer byte costs with ``n_values`` distinct positive values per kept tier, some forced
    units at cost 0, -inf / NaN / +-0.0 scores, budgets from protected-only to everything."""
    g = torch.Generator().manual_seed(seed)
    shape = (*rows, n, n_tiers - 1) if per_tier else (*rows, n)
    score = torch.randn(shape, generator=g)
    if ties:  # few distinct values: the order among equal scores decides
        score = score.round()
        score[score == 0] = -0.0 * (torch.rand(score[score == 0].shape, generator=g) < 0.5)
    score[torch.rand(shape, generator=g) < 0.05] = -float("inf")
    score[torch.rand(shape, generator=g) < 0.02] = float("nan")
    values = torch.randint(1, 40, (n_tiers - 1, n_values), generator=g).double()
    pick = torch.randint(0, n_values, (*rows, n, n_tiers - 1), generator=g)
    cost = torch.cat([values[torch.arange(n_tiers - 1), pick], torch.zeros(*rows, n, 1)], -1)
    cost[torch.rand(*rows, n, generator=g) < 0.1] = 0.0
    protected = torch.rand(*rows, n, generator=g) < 0.08
    previous = torch.randint(0, n_tiers, (*rows, n), generator=g)
    paid = torch.where(protected, cost[..., 0], 0.0).sum(-1)
    budget = paid + torch.rand(rows, generator=g, dtype=torch.float64) * cost[..., 0].sum(-1)
    raw = torch.rand(n_tiers - 1, generator=g) + 0.05
    shares = (raw / raw.sum() * 0.97).tolist()
    return score, cost, budget.floor(), shares, protected, previous


def both(score, cost, budget, shares, protected, previous, h, rounds):
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    kw = dict(shares=shares, hysteresis=h, rounds=rounds)
    twin = rank_allocate(score, cost, budget, protected=protected, previous=previous,
                         validate=False, impl="torch", **kw)  # fmt: skip
    got = rank_allocate_rows(dev(score), dev(cost), dev(budget), protected=dev(protected),
                             previous=dev(previous), **kw)  # fmt: skip
    assert got.dtype == torch.int8 and got.shape == twin.shape
    return got.cpu(), twin


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN scores
@pytest.mark.parametrize(("n_tiers", "n_values"), ((2, 1), (3, 2), (3, 4), (5, 2)))
@pytest.mark.parametrize("ties", (False, True), ids=("distinct", "ties"))
def test_kernel_equals_twin(n_tiers, n_values, ties):
    for seed in range(2):  # the interpreter takes ~0.1 s a sort: few rows on CPU
        score, cost, budget, shares, prot, prev = case(
            seed, rows=(3, 2) if CUDA else (2,), n_tiers=n_tiers, n_values=n_values, ties=ties
        )
        for h, p, q in ((0.0, None, None), (0.1, prev, prot), (0.3, prev, None)):
            got, twin = both(score, cost, budget, shares, q, p, h, rounds=n_values)
            assert torch.equal(got, twin), (seed, h)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN scores
@pytest.mark.parametrize("n", (1, 16, 100, 1000))
def test_kernel_equals_twin_at_row_lengths(n):
    score, cost, budget, shares, prot, prev = case(7, rows=(2,), n=n, n_values=2, ties=True)
    got, twin = both(score, cost, budget, shares, prot, prev, 0.1, rounds=2)
    assert torch.equal(got, twin)
    spent = cost.gather(-1, got.long()[..., None])[..., 0].sum(-1)
    assert bool((spent <= budget).all())  # a real case: within budget, and not trivially so
    assert 0 < int((got == cost.shape[-1] - 1).sum()) < got.numel()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN scores
def test_kernel_equals_twin_with_a_ranking_per_tier():
    for seed in range(2):
        score, cost, budget, shares, prot, prev = case(seed, n_tiers=4, n_values=3,
                                                       per_tier=True)  # fmt: skip
        got, twin = both(score, cost, budget, shares, prot, prev, 0.1 + seed, rounds=3)
        assert torch.equal(got, twin), seed


def test_the_planners_shapes_dispatch_to_the_kernel_on_cuda_only():
    score, cost, budget, shares, _, prev = case(3, rows=(4, 2), n=64)
    assert fits(score, cost, rounds=2)
    assert not fits(score, cost, rounds=None)  # the twin syncs once a round; the kernel can't
    assert not fits(score.double(), cost, rounds=2)
    long = torch.zeros(1, MAX_UNITS + 1)
    assert not fits(long, torch.zeros(1, MAX_UNITS + 1, 3), rounds=2)
    with pytest.raises(ValueError, match="rank_allocate_rows takes float32"):
        rank_allocate_rows(long, torch.zeros(1, MAX_UNITS + 1, 3), 1.0, shares=(0.5, 0.5),
                           rounds=2)  # fmt: skip
    auto = rank_allocate(score.to(DEVICE), cost.to(DEVICE), budget.to(DEVICE), shares=shares,
                         previous=prev.to(DEVICE), hysteresis=0.1, rounds=2)  # fmt: skip
    twin = rank_allocate(score, cost, budget, shares=shares, previous=prev, hysteresis=0.1,
                         rounds=2, impl="torch")  # fmt: skip
    assert torch.equal(auto.cpu(), twin)
