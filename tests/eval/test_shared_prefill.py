"""Shared prefill + seeded decode against independent adapter runs, on a tiny random Llama."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_llama import tiny_llama, tokens  # noqa: E402

from tiered_radix.adapters.transformers import ChatSession  # noqa: E402
from tiered_radix.eval.prefill import PREFILL_SIGNALS, capture  # noqa: E402
from tiered_radix.eval.probes import DecodeProbe  # noqa: E402
from tiered_radix.eval.seeded import _decode_attend, run_seeded  # noqa: E402
from tiered_radix.policy import load_policy  # noqa: E402
from tiered_radix.sim.simulate import parse_budget  # noqa: E402

POLICIES = sorted(Path(__file__).parents[2].joinpath("policies").glob("*.yaml"))
EOS = frozenset({0})  # never produced by this model in 40 steps (checked by new_tokens below)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def policy(path: Path):
    p = load_policy(str(path))
    return p if p.name in ("full", "kivi") else dataclasses.replace(p, budget=parse_budget("30%"))


def independent(model, ids, pol, steps):
    s = ChatSession(model, None, pol, max_new_tokens=steps, eos_ids=EOS)
    turn = s.ask_ids(ids)
    return list(turn.ids), s.cache, turn


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.stem)
def test_shared_prefill_equals_independent_runs(model, path):
    """Every shipped policy, 300 prompt tokens, 34 decoded (kivi and qevict route during decode
    too): ids, tiers, bytes, routing steps."""
    ids, steps, pol = tokens(300, 1), 34, policy(path)
    want_ids, want_cache, turn = independent(model, ids, pol, steps)
    pre = capture(model, ids, PREFILL_SIGNALS)
    got_ids, cache, stats = run_seeded(model, pre, pol, steps, EOS)
    assert got_ids == want_ids and len(got_ids) == steps
    a, b = want_cache.store, cache.store
    assert [(s.reason, s.bytes_used, len(s.transitions)) for s in a.events.steps] == [
        (s.reason, s.bytes_used, len(s.transitions)) for s in b.events.steps
    ]
    assert len(b.events.steps) >= 2 or pol.name in ("snapkv", "rdkv", "full")
    for li in range(a.n_layers):
        assert torch.equal(a.tiers(li), b.tiers(li))
    for key in ("occupancy", "bytes_used", "full_bytes", "budget_bytes", "over_budget"):
        mine = getattr(turn, key)
        if key == "occupancy":
            assert {f"occupancy.{k}": v for k, v in mine.items()} == {
                k: v for k, v in stats.items() if k.startswith("occupancy.")
            }
        else:
            assert stats[key] == mine, key


def test_one_prefill_serves_many_policies(model):
    """The same Prefill object decoded under several policies in a row gives each policy's
    independent answer (seeding never writes into the shared tensors)."""
    ids = tokens(200, 2)
    pre = capture(model, ids, PREFILL_SIGNALS)
    before = [k.clone() for k in pre.keys]
    for path in [p for p in POLICIES if p.stem in ("qevict", "rdkv", "snapkv")]:
        pol = policy(path)
        got, _, _ = run_seeded(model, pre, pol, 6, EOS)
        assert got == independent(model, ids, pol, 6)[0], path.stem
    assert all(torch.equal(a, b) for a, b in zip(before, pre.keys, strict=True))


def test_fast_prefill_matches_exact(model):
    ids = tokens(150, 3)
    exact = capture(model, ids, PREFILL_SIGNALS)
    fast = capture(model, ids, PREFILL_SIGNALS, fast=True)
    torch.testing.assert_close(fast.logits, exact.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(exact.signals, fast.signals, strict=True):
        for name in ("attn", "colmass", "obs_attn", "qnorm"):
            torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-4, atol=1e-5)
    assert float(exact.signals[0].colmass.sum()) == pytest.approx(150 * 4, rel=1e-5)


def test_fast_decode_attention_against_float64():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(*s, generator=g) for s in ((6, 1, 16), (2, 50, 16), (2, 50, 16)))
    kept = torch.rand(2, 50, generator=g) > 0.4
    kept[:, -1] = True
    out, sig = _decode_attend(q, k.masked_fill(~kept[..., None], 0), v, kept, 0.25)
    for i in range(6):
        h = i // 3
        s = (q[i, 0].double() @ k[h].double().T) * 0.25
        p = torch.softmax(s.masked_fill(~kept[h], float("-inf")), -1)
        torch.testing.assert_close(out[i, 0].double(), p @ v[h].double(), rtol=1e-5, atol=1e-6)
    p_ref = torch.stack(
        [
            sum(torch.softmax((q[i, 0] @ k[h].T * 0.25).masked_fill(~kept[h], -1e30), -1)
                for i in range(3 * h, 3 * h + 3))
            for h in range(2)
        ]
    )  # fmt: skip
    torch.testing.assert_close(sig.attn, p_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["qevict", "h2o", "rdkv", "kivi"])
def test_fast_decode_keeps_the_store_view(model, name):
    """Fast mode: cached views equal the store's at every step (verify=True) and the greedy
    answer matches exact mode on this model."""
    ids = tokens(260, 5)
    pol = policy(POLICIES[[p.stem for p in POLICIES].index(name)])
    pre = capture(model, ids, PREFILL_SIGNALS)
    steps = 34 if name == "kivi" else 18  # past a decode routing step of each
    exact, _, _ = run_seeded(model, pre, pol, steps, EOS)
    fast, _, _ = run_seeded(model, pre, pol, steps, EOS, fast=True, verify=True)
    assert fast == exact


def test_probe_fmm_against_float64(model, monkeypatch):
    """One decode step under snapkv: the probe's FMM equals the float64 share of the full-key
    attention that lands on evicted tokens, from the queries and masks attention really saw."""
    import tiered_radix.eval.seeded as seeded

    seen = []

    def spy(q, k, v, kept, scale, **kw):
        seen.append((q.clone(), k[:, -1].clone(), kept.clone(), scale))
        return seeded_attend(q, k, v, kept, scale, **kw)

    seeded_attend = seeded.attend
    monkeypatch.setattr(seeded, "attend", spy)
    ids = tokens(256, 6)
    pre = capture(model, ids, PREFILL_SIGNALS)
    keys = [k.float() for k in pre.keys]
    pol = policy(POLICIES[[p.stem for p in POLICIES].index("snapkv")])
    _, _, st = run_seeded(model, pre, pol, 1, EOS, probe=DecodeProbe(keys, 2))
    assert len(seen) == 2  # one decode step (the answer's only token is fed) x 2 layers
    missed = total = 0.0
    for li, (q, k_new, kept, scale) in enumerate(seen):
        k_full = torch.cat([pre.keys[li].double(), k_new[:, None].double()], 1)  # [H, T, d]
        for i in range(q.shape[0]):
            h = i // (q.shape[0] // k_full.shape[0])
            p = torch.softmax(q[i, 0].double() @ k_full[h].T * scale, -1)
            missed, total = missed + float(p[~kept[h]].sum()), total + 1
    assert 0.0 < st["fmm"] < 1.0
    assert st["fmm"] == pytest.approx(missed / total, rel=1e-5)
    assert st["churn"] is None and st["lir"] is None  # routes once; one step has no LIR
    _, _, full = run_seeded(model, pre, load_policy("full"), 1, EOS, probe=DecodeProbe(keys, 2))
    assert full["fmm"] == 0.0
