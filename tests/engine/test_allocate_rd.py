"""RD allocator against exhaustive enumeration and an exact dynamic program."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_radix.engine.allocate_rd import (
    channel_costs,
    distortion_table,
    lagrangian_choice,
    rd_allocate,
    rd_allocate_kv,
    rd_choice_rows,
    token_costs,
)
from tiered_radix.formats.codecs import quantized_nbytes

BITS = (0, 2, 4, 8, 16)


def instance(n: int, seed: int, zero_frac: float = 0.0):
    """Random weights/spreads, integer costs; half the instances have RDKV-like increasing costs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g, dtype=torch.float64) ** 2
    s = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    w[torch.rand(n, generator=g) < zero_frac] = 0.0
    if seed % 2:
        cost = torch.randint(0, 12, (n, len(BITS)), generator=g).double()
    else:
        base = torch.tensor([0.0, 3, 5, 9, 16], dtype=torch.float64)
        cost = base + torch.randint(0, 2, (n, len(BITS)), generator=g) * (base > 0)
    return w, s, cost


def enumerate_all(dist: torch.Tensor, cost: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Total distortion and cost of every one of the J**n choices."""
    n, j = dist.shape
    combos = np.indices((j,) * n).reshape(n, -1).T
    rows = np.arange(n)
    return dist.numpy()[rows, combos].sum(1), cost.numpy()[rows, combos].sum(1)


def exhaustive(dist: torch.Tensor, cost: torch.Tensor, budget: float, lam: float, table=None):
    """(exact knapsack optimum or inf, min over all choices of sum D + lam * cost)."""
    d, c = enumerate_all(dist, cost) if table is None else table
    feasible = c <= budget
    opt = d[feasible].min() if feasible.any() else np.inf
    return float(opt), float((d + lam * c).min())


def dp_optimum(dist: torch.Tensor, cost: torch.Tensor, budget: int) -> float:
    """Exact multiple-choice knapsack by dynamic programming over integer bytes."""
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0  # best[b]: least distortion of the units so far using exactly b bytes
    for d_row, c_row in zip(dist.numpy(), cost.numpy().astype(int), strict=True):
        nxt = np.full(budget + 1, np.inf)
        for d, c in zip(d_row, c_row, strict=True):
            if c <= budget:
                nxt[c:] = np.minimum(nxt[c:], best[: budget + 1 - c] + d)
        best = nxt
    return float(best.min())


def unit_gap(dist: torch.Tensor, cost: torch.Tensor) -> float:
    """max over units of D at the cheapest option (lowest D among ties) minus the least D."""
    cheap = cost == cost.amin(1, keepdim=True)
    d_cheap = torch.where(cheap, dist, torch.inf).amin(1)
    return float((d_cheap - dist.amin(1)).max())


@pytest.mark.parametrize("seed", range(24))
def test_against_exhaustive_enumeration(seed):
    n = 3 + seed % 5  # 3..7 units, 5 choices
    w, s, cost = instance(n, seed, zero_frac=0.2 if seed % 3 == 0 else 0.0)
    dist = distortion_table(w, s, BITS)
    lo_cost, hi_cost = float(cost.amin(1).sum()), float(cost.amax(1).sum())
    table = enumerate_all(dist, cost)
    for budget in np.linspace(lo_cost, hi_cost, 7):
        r = rd_allocate(w, s, cost, BITS, float(budget))
        opt, lag_min = exhaustive(dist, cost, float(budget), r.lam, table)
        assert r.feasible and r.cost <= budget
        assert r.distortion == pytest.approx(float(dist[torch.arange(n), r.choice].sum()))
        # (a) the relaxation optimum at the returned multiplier
        assert r.lower_bound + r.lam * budget == pytest.approx(lag_min, rel=1e-9, abs=1e-12)
        relaxed = lagrangian_choice(dist, cost, r.lam)
        assert float(cost[torch.arange(n), relaxed].sum()) <= budget  # lam is feasible ...
        if r.lam > 0:  # ... and the smallest feasible multiplier
            below = lagrangian_choice(dist, cost, r.lam * (1 - 1e-7))
            assert float(cost[torch.arange(n), below].sum()) > budget
        # (b) lower_bound <= OPT <= distortion <= OPT + the largest single-unit gap
        assert r.lower_bound <= opt + 1e-12
        assert opt - 1e-12 <= r.distortion <= opt + unit_gap(dist, cost) + 1e-12


def hull_segments(dist: torch.Tensor, cost: torch.Tensor):
    """Loop reference: each unit's start option and its hull chain of single-step upgrades,
    as (drop per byte, unit, step, target option, extra bytes, distortion drop)."""
    d, c = dist.tolist(), cost.tolist()
    starts, segments = [], []
    for u, (du, cu) in enumerate(zip(d, c, strict=True)):
        cur = min(range(len(cu)), key=lambda j: (cu[j], du[j], j))
        starts.append(cur)
        for step in range(len(cu)):
            ups = [k for k in range(len(cu)) if cu[k] > cu[cur] and du[k] < du[cur]]
            if not ups:
                break
            nxt = max(ups, key=lambda k: ((du[cur] - du[k]) / (cu[k] - cu[cur]), -cu[k]))
            dc, dd = cu[nxt] - cu[cur], du[cur] - du[nxt]
            segments.append((dd / dc, u, step, nxt, dc, dd))
            cur = nxt
    return starts, segments


def sequential_greedy(dist: torch.Tensor, cost: torch.Tensor, budget: float) -> list[int]:
    """Loop reference of the documented greedy: segments by drop per byte, take a segment if it
    fits, else skip it and the rest of its unit's chain."""
    choice, segments = hull_segments(dist, cost)
    left = budget - sum(cost[u, j].item() for u, j in enumerate(choice))
    blocked = set()
    for _, u, _, nxt, dc, _ in sorted(segments, key=lambda t: (-t[0], t[1], t[2])):
        if u in blocked:
            continue
        if dc <= left:
            choice[u], left = nxt, left - dc
        else:
            blocked.add(u)
    return choice


@pytest.mark.parametrize("seed", range(12))
def test_matches_sequential_greedy_reference(seed):
    w, s, cost = instance(25, 300 + seed, zero_frac=0.1)
    lo_cost, hi_cost = float(cost.amin(1).sum()), float(cost.amax(1).sum())
    for frac in (0.0, 0.1, 0.35, 0.7, 1.0):
        budget = lo_cost + frac * (hi_cost - lo_cost)
        r = rd_allocate(w, s, cost, BITS, budget)
        assert r.choice.tolist() == sequential_greedy(distortion_table(w, s, BITS), cost, budget)


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_exhaustive(seed):
    w, s, cost = instance(5, seed)
    dist = distortion_table(w, s, BITS)
    for budget in (0, 7, 15, 30):
        assert dp_optimum(dist, cost, budget) == pytest.approx(exhaustive(dist, cost, budget, 0)[0])


@pytest.mark.parametrize("seed", range(8))
def test_against_dynamic_programming_n40(seed):
    w, s, cost = instance(40, 100 + seed)
    dist = distortion_table(w, s, BITS)
    lo_cost, hi_cost = float(cost.amin(1).sum()), float(cost.amax(1).sum())
    for frac in (0.05, 0.3, 0.6):
        budget = int(lo_cost + frac * (hi_cost - lo_cost))
        r = rd_allocate(w, s, cost, BITS, budget)
        opt = dp_optimum(dist, cost, budget)
        assert r.cost <= budget
        assert r.lower_bound <= opt + 1e-12 <= r.distortion + 2e-12
        max_drop = max(seg[5] for seg in hull_segments(dist, cost)[1])
        assert r.distortion <= r.lower_bound + max_drop + 1e-12
        assert max_drop <= unit_gap(dist, cost) + 1e-15


def test_infeasible_returns_all_cheapest():
    w, s, cost = instance(5, 0)
    cost = cost + 1.0  # every option now costs >= 1 byte
    r = rd_allocate(w, s, cost, BITS, 4.0)
    assert not r.feasible and r.lam == float("inf")
    assert torch.equal(r.choice, cost.argmin(1)) and r.cost == 5.0


def test_zero_weight_units_get_cheapest_and_hand_case():
    w = torch.tensor([1.0, 0.0, 2.0])
    s = torch.tensor([1.0, 5.0, 1.0])
    cost = torch.tensor([[0.0, 1, 2, 4, 8]] * 3)
    # D rows: [1, 1/4, 1/16, ...] and [2, 1/2, 1/8, ...]; with 2 bytes both weighted units take
    # 2 bits (drops 0.75 and 1.5 per byte beat any second step); the zero-weight unit stays at 0.
    r = rd_allocate(w, s, cost, BITS, 2.0)
    assert r.bits.tolist() == [2, 0, 2] and r.cost == 2.0
    assert r.distortion == pytest.approx(0.25 + 0.5)
    r = rd_allocate(w, s, cost, BITS, 1000.0)
    assert r.bits.tolist() == [16, 0, 16] and r.lam == 0.0


def test_rejects_bad_input():
    w, s, cost = instance(4, 0)
    with pytest.raises(ValueError, match="cost"):
        rd_allocate(w, s, cost[:, :3], BITS, 10.0)
    with pytest.raises(ValueError, match="weight"):
        rd_allocate(-w - 1, s, cost, BITS, 10.0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    seed=st.integers(0, 10_000),
    b1=st.floats(0, 1),
    b2=st.floats(0, 1),
)
def test_property_budget_and_monotone(n, seed, b1, b2):
    w, s, cost = instance(n, seed, zero_frac=0.1)
    lo_cost, hi_cost = float(cost.amin(1).sum()), float(cost.amax(1).sum())
    small, large = sorted((lo_cost + b1 * (hi_cost - lo_cost), lo_cost + b2 * (hi_cost - lo_cost)))
    r_small = rd_allocate(w, s, cost, BITS, small)
    r_large = rd_allocate(w, s, cost, BITS, large)
    for r, b in ((r_small, small), (r_large, large)):
        assert r.feasible and r.cost <= b
        assert r.lower_bound <= r.distortion + 1e-12
    assert r_large.distortion <= r_small.distortion + 1e-12


def test_kv_costs_by_hand():
    assert token_costs(128, BITS, 32) == [0, 48, 80, 144, 256]
    assert token_costs(128, BITS, 32)[1] == quantized_nbytes(128, 2, 32)
    # 40 kept tokens, group 32 -> 2 groups (8 metadata bytes)
    assert channel_costs(40, BITS, 32) == [0.0, 18.0, 28.0, 48.0, 80.0]


def test_rd_allocate_kv_pipeline():
    g = torch.Generator().manual_seed(7)
    t, d = 64, 128
    v_w = torch.rand(t, generator=g) ** 4
    v_w[:10] = 0.0  # tokens with no attention mass are evicted
    v_s, k_w, k_s = torch.rand(t, generator=g), torch.rand(d, generator=g), torch.rand(d)
    full = 2 * 2 * t * d
    out = rd_allocate_kv(v_w, v_s, k_w, k_s, 0.2 * full, group=32, v_share=0.5)
    assert out.v.cost <= 0.1 * full and out.cost <= 0.2 * full
    assert out.kept == int((out.v.bits > 0).sum()) and out.kept <= t - 10
    assert torch.all(out.v.bits[:10] == 0)
    # Stage two is exactly an RD allocation over channels with the kept-token cost table.
    k_cost = torch.tensor(channel_costs(out.kept, BITS, 32), dtype=torch.float64).expand(d, -1)
    ref = rd_allocate(k_w, k_s, k_cost, BITS, 0.2 * full - out.v.cost)
    assert torch.equal(out.k.choice, ref.choice) and out.k.cost == ref.cost
    with pytest.raises(ValueError, match="v_share"):
        rd_allocate_kv(v_w, v_s, k_w, k_s, 1.0, v_share=1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_cpu():
    w, s, cost = instance(200, 3)
    cpu = rd_allocate(w, s, cost, BITS, 500.0)
    gpu = rd_allocate(w.cuda(), s.cuda(), cost.cuda(), BITS, 500.0)
    assert torch.equal(gpu.choice.cpu(), cpu.choice) and gpu.distortion == pytest.approx(
        cpu.distortion
    )


def _rows_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    R, n, bits = 7, 40, [16, 8, 4, 2, 0]
    w = torch.rand(R, n, generator=g) ** 3 * (torch.rand(R, n, generator=g) > 0.1)
    s = torch.rand(R, n, generator=g) + 0.05
    per_row = [token_costs(64, bits, 32) if i % 2 else channel_costs(30 + i, bits, 32)
               for i in range(R)]  # fmt: skip
    cost = torch.tensor(per_row, dtype=torch.float64)[:, None, :].expand(R, n, -1)
    active = torch.rand(R, n, generator=g) > 0.25
    full = cost[:, 0, 0] * active.sum(1)
    budget = full * torch.tensor([0.1, 0.3, 0.5, 1.2, 0.0, 0.05, 0.2], dtype=torch.float64)
    return w, s, cost, bits, budget, active


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(3))
def test_rows_on_the_gpu_choose_as_on_the_cpu(seed):
    case = _rows_case(seed)
    want = rd_choice_rows(*case)
    w, s, cost, bits, budget, active = case
    got = rd_choice_rows(w.cuda(), s.cuda(), cost.cuda(), bits, budget.cuda(), active.cuda())
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("seed", range(6))
def test_rows_choose_what_each_row_alone_chooses(seed):
    """``rd_choice_rows`` over rows of different budgets (tight, loose, infeasible) with units
    left out (``active``), V-token and K-channel cost tables: each row's choices are those of
    ``rd_allocate`` over its active units alone, without a host sync."""
    w, s, cost, bits, budget, active = _rows_case(seed)
    R = w.shape[0]
    got = rd_choice_rows(w, s, cost, bits, budget, active)
    for i in range(R):
        a = active[i]
        want = rd_allocate(w[i][a], s[i][a], cost[i][a], bits, float(budget[i])).choice
        assert torch.equal(got[i][a], want), i
        assert not got[i][~a].any()
