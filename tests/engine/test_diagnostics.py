"""Diagnostics on hand-computed cases and against plain loop references."""

from __future__ import annotations

import pytest
import torch

from tiered_radix.engine.diagnostics import (
    churn,
    future_missed_mass,
    global_lir,
    jaccard_churn,
    missed_mass_by_tier,
    oracle_active,
)

ATTN = torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.625, 0.25]])  # exact in binary


def test_fmm_and_mass_by_tier_by_hand():
    evicted = torch.tensor([[False, False, True], [True, False, True]])
    # missed 0.25 + 0.125 + 0.25 = 0.625 of a total mass 2.0
    assert future_missed_mass(ATTN, evicted) == 0.3125
    tier = torch.tensor([[0, 1, 2], [2, 0, 2]])
    # tier 0: 0.5 + 0.625, tier 1: 0.25, tier 2: 0.25 + 0.125 + 0.25 (out of 2.0)
    assert missed_mass_by_tier(ATTN, tier, 3).tolist() == [0.5625, 0.125, 0.3125]
    assert future_missed_mass(torch.zeros(2, 3), evicted) == 0.0
    assert missed_mass_by_tier(torch.zeros(2, 3), tier, 3).tolist() == [0.0, 0.0, 0.0]


def test_oracle_active_by_hand():
    # row 0: 0.5 then 0.25 (tie: lower index) reach 0.75 >= 0.7; row 1: 0.625 then 0.25
    assert oracle_active(ATTN, 0.7).tolist() == [[True, True, False], [False, True, True]]
    assert oracle_active(ATTN, 0.75).tolist() == [[True, True, False], [False, True, True]]
    assert oracle_active(ATTN, 0.5).tolist() == [[True, False, False], [False, True, False]]
    assert oracle_active(torch.zeros(1, 3), 0.9).tolist() == [[False, False, False]]
    with pytest.raises(ValueError, match="mass"):
        oracle_active(ATTN, 0.0)


def test_global_lir_by_hand():
    active = torch.tensor(
        [
            [1, 1, 0, 0],
            [1, 0, 0, 1],
            [0, 0, 1, 0],  # unit 0 leaves here, unit 3 too
            [0, 0, 1, 1],  # unit 3 is back
            [1, 0, 1, 0],  # unit 0 is back; unit 1 left at step 1 and never returns
        ],
        dtype=torch.bool,
    )  # unit 2 never leaves: not counted
    assert global_lir(active) == pytest.approx(2 / 3)
    assert global_lir(torch.ones(4, 3, dtype=torch.bool)) == 0.0


def test_churn_by_hand():
    tiers = torch.tensor([[0, 1, 2, 2], [0, 2, 2, 1], [0, 2, 2, 1]])
    assert churn(tiers).tolist() == [0.5, 0.0]
    active = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    # |{1}| / |{0, 1, 2}|; identical; everything leaves; both empty
    out = jaccard_churn(active.bool())
    assert out.tolist() == pytest.approx([2 / 3, 0.0, 1.0, 0.0])


def random_attn(seed, steps=12, n=30):
    g = torch.Generator().manual_seed(seed)
    attn = torch.rand(steps, n, generator=g) ** 4
    attn[torch.rand(steps, n, generator=g) < 0.1] = 0.0
    return attn / attn.sum(-1, keepdim=True)


@pytest.mark.parametrize("seed", range(8))
def test_against_loop_references(seed):
    attn = random_attn(seed)
    steps, n = attn.shape
    g = torch.Generator().manual_seed(100 + seed)
    tier = torch.randint(0, 3, (steps, n), generator=g)
    a = attn.tolist()
    t = tier.tolist()

    fmm = sum(a[s][u] for s in range(steps) for u in range(n) if t[s][u] == 2)
    assert future_missed_mass(attn, tier == 2) == pytest.approx(fmm / sum(map(sum, a)))
    ref_by_tier = [
        sum(a[s][u] for s in range(steps) for u in range(n) if t[s][u] == k) for k in range(3)
    ]
    total = sum(ref_by_tier)
    assert missed_mass_by_tier(attn, tier, 3).tolist() == pytest.approx(
        [m / total for m in ref_by_tier]
    )

    active = oracle_active(attn, 0.8)
    for s in range(steps):
        ranked = sorted(range(n), key=lambda u: (-a[s][u], u))
        acc, chosen = 0.0, set()
        for u in ranked:
            if acc >= 0.8 * sum(a[s]):
                break
            chosen.add(u)
            acc += a[s][u]
        assert {u for u in range(n) if active[s, u]} == chosen

    act = active.tolist()
    left = reentered = 0
    for u in range(n):
        col = [act[s][u] for s in range(steps)]
        leave = next((s for s in range(1, steps) if col[s - 1] and not col[s]), None)
        if leave is not None:
            left += 1
            reentered += any(col[leave + 1 :])
    assert global_lir(active) == pytest.approx(reentered / left if left else 0.0)

    for s in range(1, steps):
        assert float(churn(tier)[s - 1]) == pytest.approx(
            sum(t[s][u] != t[s - 1][u] for u in range(n)) / n
        )
        cur, prev = {u for u in range(n) if act[s][u]}, {u for u in range(n) if act[s - 1][u]}
        expect = 1 - len(cur & prev) / len(cur | prev) if cur | prev else 0.0
        assert float(jaccard_churn(active)[s - 1]) == pytest.approx(expect)


def test_lir_counts_units_once_and_needs_a_return():
    # unit 0 flaps many times (counted once), unit 1 leaves at the last step (cannot return)
    active = torch.tensor([[1, 1], [0, 1], [1, 1], [0, 1], [1, 0]], dtype=torch.bool)
    assert global_lir(active) == pytest.approx(1 / 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_cpu():
    attn = random_attn(0)
    act = oracle_active(attn)
    assert torch.equal(oracle_active(attn.cuda()).cpu(), act)
    assert global_lir(act.cuda()) == global_lir(act)
    assert future_missed_mass(attn.cuda(), ~act.cuda()) == pytest.approx(
        future_missed_mass(attn, ~act)
    )
