"""Every name the policy language offers (vocabulary.py) is implemented by the score evaluator,
and each one computes what its documentation says (checked against float64 numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_radix.engine.scores import (
    IMPLEMENTED_CONSTANTS,
    IMPLEMENTED_FUNCTIONS,
    IMPLEMENTED_SIGNALS,
    ScoreEvaluator,
)
from tiered_radix.engine.signals import CacheState, Signals
from tiered_radix.engine.units import UnitLayout
from tiered_radix.policy import compile_text
from tiered_radix.policy.errors import Span
from tiered_radix.policy.transformer import parse
from tiered_radix.policy.vocabulary import CONSTANTS, FUNCTIONS, SIGNALS

H, T, D, W = 2, 10, 8, 4  # 10 tokens: windows of 4, 4 and a partial 2

g = torch.Generator().manual_seed(3)
K = torch.randn(H, T, D, generator=g, dtype=torch.float64)
V = torch.randn(H, T, D, generator=g, dtype=torch.float64)
ATTN = torch.rand(H, T, generator=g, dtype=torch.float64) + 0.1
COLMASS = torch.rand(H, T, generator=g, dtype=torch.float64) + 0.1
OBS = torch.rand(H, T, generator=g, dtype=torch.float64) + 0.1
QNORM = torch.rand(H, D, generator=g, dtype=torch.float64) + 0.1
WIN = UnitLayout("window", W, D)
CHAN = UnitLayout("channel", 1, D)
BOUNDS = [(0, 4), (4, 8), (8, 10)]
# the evaluator keeps the latest token signals its policy reads (scores.held_state): the test
# policies read them all, so any expression over them can be evaluated
READS_EVERY_SIGNAL = "\n  seen: attn + colmass + obs_attn"


def units(x: np.ndarray, how=np.sum) -> np.ndarray:
    """[H, T] per token -> [H, 3] per window."""
    return np.stack([how(x[:, a:b], axis=1) for a, b in BOUNDS], 1)


def ev(text: str, layout: UnitLayout = WIN, policy_scores: str = "") -> np.ndarray:
    policy = compile_text(
        "budget: 10%\nunits: window(size=4)\nscores:\n  s: "
        + (policy_scores or "attn")
        + READS_EVERY_SIGNAL
        + "\ntiers: {full: keep(bf16), gone: evict}\nallocate: {method: rank, by: s}\n"
    )
    e = parse(text, "expr", Span("<test>", 1, 1))
    sc = ScoreEvaluator(policy, 1, H)
    cache = CacheState(K.float(), V.float(), torch.ones(H, T, dtype=torch.bool))
    sc.update(
        0,
        Signals(
            attn=ATTN.float(), colmass=COLMASS.float(), obs_attn=OBS.float(), qnorm=QNORM.float()
        ),
        cache=cache,
    )
    return sc.evaluate(0, e, layout, cache=cache).double().numpy()


a, c, o = ATTN.numpy(), COLMASS.numpy(), OBS.numpy()
k, v = K.numpy(), V.numpy()
pos = np.arange(T, dtype=np.float64)

SIGNAL_CASES = {
    "attn": ("attn", WIN, units(a)),
    "colmass": ("colmass", WIN, units(c)),
    "obs_attn": ("obs_attn", WIN, units(o)),
    "key_norm": ("key_norm", WIN, units(np.linalg.norm(k, axis=-1))),
    "sigma": ("sigma", WIN, np.stack([v[:, a_:b].reshape(H, -1).std(1) for a_, b in BOUNDS], 1)),
    "recency": ("recency", WIN, np.broadcast_to([[T - 4.0, T - 8.0, 0.0]], (H, 3))),
    "position": ("position", WIN, np.broadcast_to([[0.0, 4.0, 8.0]], (H, 3))),
    "qnorm": ("qnorm", CHAN, QNORM.numpy()),
    "knorm": ("knorm", CHAN, np.linalg.norm(k, axis=1)),
}
CONSTANT_CASES = {
    "head_dim": ("head_dim + 0 * attn", np.full((H, 3), float(D))),
    "seq_len": ("seq_len + 0 * attn", np.full((H, 3), float(T))),
}


def pool(x: np.ndarray, size: int) -> np.ndarray:
    r = size // 2
    return np.stack([x[:, max(0, t - r) : t + r + 1].max(1) for t in range(T)], 1)


ua = units(a)
FUNCTION_CASES = {
    "cumulative": ("cumulative(attn, decay=0.5)", units(a), "cumulative(attn, decay=0.5)"),
    "sum_heads": ("sum_heads(attn)", np.broadcast_to(ua.sum(0), (H, 3)), ""),
    "mean_heads": ("mean_heads(attn)", np.broadcast_to(ua.mean(0), (H, 3)), ""),
    "max_heads": ("max_heads(attn)", np.broadcast_to(ua.max(0), (H, 3)), ""),
    # one layer here: a layer reduction is the identity (tests/engine/test_scores.py: several)
    "sum_layers": ("sum_layers(attn)", ua, ""),
    "mean_layers": ("mean_layers(attn)", ua, ""),
    "max_layers": ("max_layers(attn)", ua, ""),
    "sum_window": ("sum_window(attn * attn)", units(a * a), ""),
    "mean_window": ("mean_window(attn)", units(a, np.mean), ""),
    "max_window": ("max_window(attn)", units(a, np.max), ""),
    "pool_max": ("pool_max(attn, size=3)", units(pool(a, 3)), ""),
    "quantile": (
        "quantile(attn, 0.25)",
        np.repeat(np.quantile(ua, 0.25, axis=1)[:, None], 3, 1),
        "",
    ),
    "min": ("min(attn, colmass)", np.minimum(ua, units(c)), ""),
    "max": ("max(attn, colmass)", np.maximum(ua, units(c)), ""),
    "clip": ("clip(attn, 1, 2)", np.clip(ua, 1, 2), ""),
    "log": ("log(attn)", np.log(ua), ""),
    "exp": ("exp(attn)", np.exp(ua), ""),
    "sqrt": ("sqrt(attn - 1)", np.sqrt(np.maximum(ua - 1, 0)), ""),
    "abs": ("abs(attn - 2)", np.abs(ua - 2), ""),
}


def test_the_engine_lists_exactly_the_vocabulary():
    assert IMPLEMENTED_SIGNALS == set(SIGNALS)
    assert IMPLEMENTED_FUNCTIONS == set(FUNCTIONS)
    assert IMPLEMENTED_CONSTANTS == set(CONSTANTS)
    assert set(SIGNAL_CASES) == set(SIGNALS)
    assert set(FUNCTION_CASES) == set(FUNCTIONS)
    assert set(CONSTANT_CASES) == set(CONSTANTS)


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_signal(name):
    text, layout, want = SIGNAL_CASES[name]
    np.testing.assert_allclose(ev(text, layout), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_constant(name):
    text, want = CONSTANT_CASES[name]
    np.testing.assert_allclose(ev(text), want, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function(name):
    text, want, scores = FUNCTION_CASES[name]
    np.testing.assert_allclose(ev(text, policy_scores=scores), want, rtol=1e-5, atol=1e-6)


CASES = {
    **{n: (t, lay, w, "") for n, (t, lay, w) in SIGNAL_CASES.items()},
    **{n: (t, WIN, w, "") for n, (t, w) in CONSTANT_CASES.items()},
    **{n: (t, WIN, w, s) for n, (t, w, s) in FUNCTION_CASES.items()},
}


@pytest.mark.parametrize("name", sorted(n for n in CASES if not n.endswith("_layers")))
def test_evaluate_layers_equals_each_layer_alone(name):
    """The planner's batched ``evaluate_layers`` over layers holding different data (layer 1
    has its heads swapped) gives every layer its own float64 reference values (every name but
    the layer reductions, whose value is by definition not a layer's own: test_scores.py)."""
    text, layout, want, scores = CASES[name]
    policy = compile_text(
        "budget: 10%\nunits: window(size=4)\nscores:\n  s: "
        + (scores or "attn")
        + READS_EVERY_SIGNAL
        + "\ntiers: {full: keep(bf16), gone: evict}\nallocate: {method: rank, by: s}\n"
    )
    flips = [False, True, False]

    def f(x: torch.Tensor, flip: bool) -> torch.Tensor:
        return x.flip(0).float() if flip else x.float()

    caches = [CacheState(f(K, fl), f(V, fl), torch.ones(H, T, dtype=torch.bool)) for fl in flips]
    sc = ScoreEvaluator(policy, 3, H, cache=lambda li: caches[li])
    for li, fl in enumerate(flips):
        obs = {"attn": ATTN, "colmass": COLMASS, "obs_attn": OBS, "qnorm": QNORM}
        sc.update(li, Signals(**{n: f(x, fl) for n, x in obs.items()}))
    e = parse(text, "expr", Span("<test>", 1, 1))
    for layers in ([0, 1, 2], [1, 2], [0, 2]):
        got = sc.evaluate_layers(layers, e, layout).double().numpy()
        assert got.shape == (len(layers), *want.shape)
        for i, li in enumerate(layers):
            ref = want[::-1] if flips[li] else want
            np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-6)


def test_cumulative_never_updated_is_zero_per_unit():
    policy = compile_text(
        "budget: 10%\nunits: window(size=4)\nscores:\n  s: cumulative(obs_attn)\n"
        "tiers: {full: keep(bf16), gone: evict}\nallocate: {method: rank, by: s}\n"
    )
    cache = CacheState(K.float(), V.float(), torch.ones(H, T, dtype=torch.bool))
    sc = ScoreEvaluator(policy, 2, H, cache=lambda li: cache)
    sc.update(0, Signals(attn=ATTN.float()))  # no obs_attn observed: nothing accumulates
    assert torch.equal(sc.evaluate(0, policy.score("s"), WIN), torch.zeros(H, 3))
    assert torch.equal(sc.evaluate_layers([0, 1], policy.score("s"), WIN), torch.zeros(2, H, 3))
