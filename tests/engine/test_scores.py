"""Score evaluation semantics: state of cumulative(), aggregation levels, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_radix.engine.scores import ScoreEvaluator
from tiered_radix.engine.signals import CacheState, SignalError, Signals
from tiered_radix.engine.units import UnitLayout
from tiered_radix.policy import compile_text
from tiered_radix.policy.errors import Span
from tiered_radix.policy.transformer import parse

H, D = 2, 8


def policy(score: str, units: str = "window(size=4)"):
    return compile_text(
        f"budget: 10%\nunits: {units}\nscores:\n  s: {score}\n"
        "tiers: {full: keep(bf16), gone: evict}\nallocate: {method: rank, by: s}\n"
    )


def cache(t: int, seed: int = 0, kept=None) -> CacheState:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(H, t, D, generator=g), torch.randn(H, t, D, generator=g) + 1
    return CacheState(k, v, torch.ones(H, t, dtype=torch.bool) if kept is None else kept)


def expr(text: str):
    return parse(text, "expr", Span("<t>", 1, 1))


def test_cumulative_decay_over_growing_sequence_matches_float64():
    """Kept per window (read at unit level only) and per token (token units): both equal the
    float64 running sums, through growth, a step without attention, and separate layers."""
    per_unit = policy("cumulative(attn, decay=0.9)")
    per_token = policy("cumulative(attn, decay=0.9)", units="token")
    evaluators = [ScoreEvaluator(per_unit, 2, H), ScoreEvaluator(per_token, 2, H)]
    g = torch.Generator().manual_seed(1)
    ref = np.zeros((H, 0))
    t = 6
    for step in range(7):
        t += 1 if step else 0
        a = torch.rand(H, t, generator=g, dtype=torch.float64)
        for sc in evaluators:
            if step == 3:  # a step without attention accumulates nothing (not even decay)
                sc.update(0, Signals(), cache=cache(t))
            else:
                sc.update(0, Signals(attn=a.float()), cache=cache(t))
        if step != 3:
            ref = np.pad(ref, ((0, 0), (0, t - ref.shape[1]))) * 0.9 + a.numpy()
        ref = np.pad(ref, ((0, 0), (0, t - ref.shape[1])))
    lay = UnitLayout("window", 4, D)
    sc, tok_sc = evaluators
    assert sc._state[per_unit.score("s")].shape[-1] < t  # one sum per window, not per token
    got = sc.evaluate(0, per_unit.score("s"), lay, cache=cache(t)).double().numpy()
    want = np.stack([ref[:, i * 4 : (i + 1) * 4].sum(1) for i in range(-(-t // 4))], 1)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    tok = tok_sc.evaluate(0, per_token.score("s"), UnitLayout("token", 1, D), cache=cache(t))
    np.testing.assert_allclose(tok.double().numpy(), ref, rtol=1e-5)
    other = sc.evaluate(1, per_unit.score("s"), lay, cache=cache(t))  # layers keep separate state
    assert float(other.abs().sum()) == 0.0


@pytest.mark.parametrize(
    "score, grain, latest",
    [
        ("cumulative(attn, decay=0.99) + pool_max(obs_attn, size=7)", 4, set()),  # a memo
        ("cumulative(attn) + pool_max(obs_attn, size=7) * obs_attn", 4, {"obs_attn"}),
        ("pool_max(cumulative(attn), size=3)", 1, set()),  # read per token
        ("cumulative(cumulative(attn)) + attn", 4, {"attn"}),  # attn read outside
    ],
)
def test_held_state_keeps_sums_per_unit_and_only_the_signals_read_again(score, grain, latest):
    from tiered_radix.engine.scores import held_state

    pol = policy(score, units="window(size=4)")
    held = held_state(pol)
    outer = next(n for n in pol.score("s").walk() if getattr(n, "fn", "") == "cumulative")
    assert held.grain[outer] == grain
    assert held.signals == latest


def test_nonlinear_window_functions_work_per_token():
    pol = policy("attn")
    sc = ScoreEvaluator(pol, 1, H)
    a = torch.rand(H, 9, generator=torch.Generator().manual_seed(2)) + 0.1
    sc.update(0, Signals(attn=a), cache=cache(9))
    lay = UnitLayout("window", 3, D)
    got = sc.evaluate(0, expr("sum_window(log(attn))"), lay, cache=cache(9))
    want = a.log().reshape(H, 3, 3).sum(-1)
    torch.testing.assert_close(got, want)
    unit_level = sc.evaluate(0, expr("log(attn)"), lay, cache=cache(9))
    torch.testing.assert_close(unit_level, a.reshape(H, 3, 3).sum(-1).log())


def test_condition_returns_bool_and_quantile_splits_units():
    pol = policy("attn")
    sc = ScoreEvaluator(pol, 1, H)
    a = torch.rand(H, 40, generator=torch.Generator().manual_seed(3)) + 0.01
    sc.update(0, Signals(attn=a), cache=cache(40))
    m = sc.evaluate(
        0,
        expr("attn < quantile(attn, 0.5) and not position < 4"),
        UnitLayout("token", 1, D),
        cache=cache(40),
    )
    assert m.dtype == torch.bool
    below = a < a.quantile(0.5, dim=1, keepdim=True)
    below[:, :4] = False
    assert torch.equal(m, below)


def test_channel_signals_and_sigma_over_kept_tokens():
    kept = torch.ones(H, 12, dtype=torch.bool)
    kept[:, 5:8] = False
    c = cache(12, seed=4, kept=kept)
    pol = policy("attn")
    sc = ScoreEvaluator(pol, 1, H)
    q = torch.rand(H, D) + 0.5
    sc.update(0, Signals(qnorm=q), cache=c)
    chan = UnitLayout("channel", 1, D)
    got = sc.evaluate(0, expr("qnorm * knorm / sqrt(head_dim)"), chan, cache=c)
    k = c.k.double().numpy()[:, kept[0].numpy()]
    want = q.double().numpy() * np.linalg.norm(k, axis=1) / np.sqrt(D)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5)
    sig = sc.evaluate(0, expr("sigma"), chan, cache=c)
    np.testing.assert_allclose(sig.double().numpy(), k.std(1), rtol=1e-4)


def test_heads_reduction_broadcasts():
    pol = policy("attn")
    sc = ScoreEvaluator(pol, 1, H)
    a = torch.rand(H, 8, generator=torch.Generator().manual_seed(5))
    sc.update(0, Signals(attn=a), cache=cache(8))
    got = sc.evaluate(0, expr("max_heads(attn) - attn"), UnitLayout("token", 1, D), cache=cache(8))
    torch.testing.assert_close(got, a.max(0, keepdim=True).values - a)


def test_layers_reduction_reads_every_layer_and_broadcasts():
    """mean/max/sum_layers of a running score: per KV head over all layers, the same value in
    every layer whether one layer or a group is evaluated; layers of unequal length refuse."""
    L, t = 3, 12
    states = {li: cache(t, seed=li) for li in range(L)}
    pol = policy("mean_layers(cumulative(attn))")
    sc = ScoreEvaluator(pol, L, H, cache=lambda li: states[li])
    g = torch.Generator().manual_seed(6)
    a = torch.rand(L, H, t, generator=g)
    for li in range(L):
        sc.update(li, Signals(attn=a[li]))
    lay = UnitLayout("window", 4, D)
    per_unit = a.view(L, H, 3, 4).sum(-1)
    for fn, want in (
        ("mean", per_unit.mean(0)),
        ("max", per_unit.amax(0)),
        ("sum", per_unit.sum(0)),
    ):
        e = expr(f"{fn}_layers(cumulative(attn))")
        for li in range(L):
            torch.testing.assert_close(sc.evaluate(li, e, lay), want)
        got = sc.evaluate_layers([1, 2], e, lay)
        torch.testing.assert_close(got, want.expand(2, H, 3))
    torch.testing.assert_close(sc.evaluate(0, pol.score("s"), lay), per_unit.mean(0))
    states[2] = cache(t + 1, seed=2)
    with pytest.raises(SignalError, match="different numbers of tokens"):
        sc.evaluate(0, pol.score("s"), lay)


def test_model_wide_ranking_keeps_a_window_in_every_head_or_none():
    """Issue 18: with ``mean_heads(mean_layers(...))`` every (layer, KV head) routes its
    windows alike, so no window is kept in a scattered subset of heads; the same score per head
    scatters them (the comparison can fail)."""
    from tiered_radix.engine.store import TierStore

    text = (
        "budget: 30%\nunits: window(size=8)\nprotect: {sinks: 4, recent: 8}\n"
        "scores:\n  s: SCORE\ntiers:\n  full: keep(bf16)\n  int2: quantize(bits=2, group=8)\n"
        "  gone: evict\nallocate: {method: rank, by: s}\nledger: write_once\n"
    )
    L, t, g = 3, 96, torch.Generator().manual_seed(9)
    attn = torch.rand(L, H, t, generator=g) ** 4
    tiers = {}
    for name, score in (("model", "mean_heads(mean_layers(cumulative(attn)))"),
                        ("head", "cumulative(attn)")):  # fmt: skip
        store = TierStore(compile_text(text.replace("SCORE", score)), n_layers=L, n_heads=H,
                          head_dim=D)  # fmt: skip
        for li in range(L):
            store.append(li, torch.randn(H, t, D, generator=g), torch.randn(H, t, D, generator=g))
        store.observe_attn(attn)
        store.route("test")
        tiers[name] = torch.stack([store.tiers(li) for li in range(L)]).flatten(0, 1)
    model, head = tiers["model"], tiers["head"]
    assert torch.equal(model, model[:1].expand_as(model))
    assert (model == 2).any() and (model == 1).any()  # something evicted, something quantized
    assert not torch.equal(head, head[:1].expand_as(head))


def test_missing_signal_is_a_typed_error_and_wrong_shape_too():
    pol = policy("colmass")
    sc = ScoreEvaluator(pol, 1, H)
    with pytest.raises(SignalError, match="colmass"):
        sc.evaluate(0, pol.score("s"), UnitLayout("token", 1, D), cache=cache(5))
    with pytest.raises(SignalError, match="attn"):
        sc.update(0, Signals(attn=torch.rand(H, 9)), cache=cache(5))
    with pytest.raises(SignalError, match="per K channel"):
        sc.evaluate(0, expr("knorm"), UnitLayout("token", 1, D), cache=cache(5))


@pytest.mark.parametrize(
    ("score", "decay"),
    [
        ("cumulative(attn, decay=0.9)", 0.9),
        ("cumulative(attn)", 1.0),
        ("log(cumulative(attn, decay=0.5)) + colmass", 0.5),  # the state folds; the rest reads it
        ("cumulative(attn, decay=0.9) + cumulative(colmass, decay=0.2)", 0.9),  # prefill-only
        ("attn", None),  # the latest step itself
        ("cumulative(attn, decay=0.9) + attn", None),
        ("cumulative(attn * 2, decay=0.9)", None),  # not a sum of attn alone
        ("cumulative(attn, decay=0.9) + cumulative(attn, decay=0.5)", None),  # two decays
        ("cumulative(attn, decay=0.9) + cumulative(position, decay=0.5)", None),  # every call
        ("position", None),  # no attention at all
    ],
)
def test_attn_decay_says_when_decode_attention_can_be_folded(score, decay):
    assert ScoreEvaluator(policy(score), 1, H).attn_decay() == decay


@pytest.mark.parametrize("units", ["window(size=4)", "token"])
def test_a_fold_per_window_equals_the_fold_of_its_tokens(units):
    """A decode kernel's side output is a mass per window of 4 tokens: folded per window
    (``unit=4``) it leaves every state where the per-token tensor with each window's mass at
    its first token leaves it, whether the state is kept per window (window units: the mass is
    added as it is) or per token (token units)."""
    pol = policy("cumulative(attn, decay=0.9)", units)
    L, t, W = 2, 14, 4  # the last window holds 2 tokens
    g = torch.Generator().manual_seed(4)
    mass = torch.rand(L, H, -(-t // W), generator=g)
    tokens = torch.zeros(L, H, t)
    tokens[..., ::W] = mass
    per_window, per_token = ScoreEvaluator(pol, L, H), ScoreEvaluator(pol, L, H)
    for sc in (per_window, per_token):
        sc.update_attn(torch.rand(L, H, t, generator=torch.Generator().manual_seed(5)))
    per_window.fold_attn(mass, 3, unit=W, n_tokens=t)
    per_token.fold_attn(tokens, 3)
    assert per_window._state.keys() == per_token._state.keys() and per_window._state
    for key, x in per_token._state.items():
        assert torch.equal(per_window._state[key], x), key


def test_fold_attn_equals_one_update_per_step():
    """k steps of attention summed as acc = g * acc + attn and folded at once leave the state
    (and so every score) where k update_attn calls leave it."""
    pol = policy("cumulative(attn, decay=0.9) + colmass")
    L, t = 2, 12
    steps, fold = ScoreEvaluator(pol, L, H), ScoreEvaluator(pol, L, H)
    g = torch.Generator().manual_seed(2)
    first = torch.rand(L, H, t, generator=g)
    for sc in (steps, fold):
        sc.update_attn(first)
    acc = torch.zeros(L, H, t)
    for _ in range(5):
        a = torch.rand(L, H, t, generator=g)
        steps.update_attn(a)
        acc = 0.9 * acc + a
    fold.fold_attn(acc, 5)
    (node,) = steps._state
    torch.testing.assert_close(fold._state[node], steps._state[node], rtol=1e-6, atol=1e-6)
    with pytest.raises(SignalError, match="cannot be folded"):
        ScoreEvaluator(policy("attn"), L, H).fold_attn(acc, 5)


def _reference(fn: str, f, s: np.ndarray, T: int, W: int, size: int = 7) -> np.ndarray:
    """float64 ``fn(f(signal))`` at unit level, the signal ``s [H, T_obs]`` padded with zeros to
    ``T`` tokens (what it is after the prompt): pool_max over the tokens that exist, summed per
    window; the *_window functions over each window's tokens."""
    x = f(np.pad(s, ((0, 0), (0, T - s.shape[1]))))
    left, right = size // 2, size - 1 - size // 2
    if fn == "pool_max":
        x = np.stack([x[:, max(0, t - left) : t + right + 1].max(1) for t in range(T)], 1)
    how = {"pool_max": np.sum, "sum_window": np.sum, "max_window": np.max,
           "mean_window": np.mean}[fn]  # fmt: skip
    return np.stack([how(x[:, u : u + W], 1) for u in range(0, T, W)], 1)


MEMO_CASES = [
    *[("pool_max", "obs_attn", "obs_attn", lambda s: s, k) for k in (7, 4, 1)],
    *[("pool_max", "-obs_attn", "obs_attn", lambda s: -s, k) for k in (7, 4)],  # the boundary
    ("pool_max", "exp(colmass) * 2", "colmass", lambda s: np.exp(s) * 2, 5),  # not 0 after
    ("max_window", "obs_attn - 1", "obs_attn", lambda s: s - 1, 0),
    ("mean_window", "colmass", "colmass", lambda s: s, 0),
    ("sum_window", "abs(obs_attn - 0.5)", "obs_attn", lambda s: np.abs(s - 0.5), 0),
]


@pytest.mark.parametrize("fn, arg, name, f, size", MEMO_CASES)
def test_a_memo_of_a_prompt_signal_equals_the_signal_kept_whole(fn, arg, name, f, size):
    """A token-level function of one prompt signal read per window is kept as its windows'
    values and the signal's tail, not the signal (held_state.memos), and gives at every later
    length what the whole signal would: prompts of 1-40 tokens, observed twice (a second chunk
    replaces the first), evaluated as tokens are generated after them."""
    call = f"pool_max({arg}, size={size})" if fn == "pool_max" else f"{fn}({arg})"
    pol = policy(f"{call} + cumulative(attn)")
    from tiered_radix.engine.scores import held_state

    assert list(held_state(pol).memos.values()) == [name]
    g = np.random.default_rng(size)
    for t_obs in [1, 2, 5, 8, 13, 21, 40]:
        sc = ScoreEvaluator(pol, 1, H)
        first = g.random((H, max(1, t_obs - 3)))
        sc.update(0, Signals(**{name: torch.tensor(first).float()}), cache=cache(first.shape[1]))
        x = g.random((H, t_obs)) * 2
        sc.update(0, Signals(**{name: torch.tensor(x).float()}), cache=cache(t_obs))
        assert sc.held_bytes()["signals"] == 0  # the signal itself is not kept
        for extra in [0, 1, 2, 3, 5, 9, 30]:
            T = t_obs + extra
            e = parse(call, "expr", Span("<t>", 1, 1))
            got = sc.evaluate(0, e, UnitLayout("window", 4, D), cache=cache(T)).double().numpy()
            want = _reference(fn, f, x.astype(np.float32).astype(np.float64), T, 4, size or 7)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{t_obs} {T}")


def test_memos_from_all_layers_at_once_equal_layer_by_layer():
    """update_layers (a prefill chunk's signals of every layer, stacked) memoizes each layer's
    slice as update does it layer by layer, and keeps no view of the stacked signal."""
    pol = policy("pool_max(obs_attn, size=7) + cumulative(attn)")
    obs = torch.rand(3, H, 23, generator=torch.Generator().manual_seed(4))
    one, every = ScoreEvaluator(pol, 3, H, cache=lambda li: cache(23)), None
    for li in range(3):
        one.update(li, Signals(obs_attn=obs[li]))
    every = ScoreEvaluator(pol, 3, H, cache=lambda li: cache(23))
    every.update_layers(Signals(obs_attn=obs))
    assert every.held_bytes()["signals"] == 0
    lay = UnitLayout("window", 4, D)
    for T in (23, 24, 30):
        a = one.evaluate_layers([0, 1, 2], pol.score("s"), lay, caches=[cache(T)] * 3)
        b = every.evaluate_layers([0, 1, 2], pol.score("s"), lay, caches=[cache(T)] * 3)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(a[0], a[1])  # each layer its own
    for layers in ([1, 2], [0, 2], [2]):  # a run of layers, a pick of them: slices of the stack
        a = one.evaluate_layers(layers, pol.score("s"), lay, caches=[cache(30)] * len(layers))
        b = every.evaluate_layers(layers, pol.score("s"), lay, caches=[cache(30)] * len(layers))
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a layer observed alone later: its own memo, the others' from the stacked pass
    again = obs[1].flip(-1)
    one.update(1, Signals(obs_attn=again))
    every.update(1, Signals(obs_attn=again))
    for T in (23, 30):
        a = one.evaluate_layers([0, 1, 2], pol.score("s"), lay, caches=[cache(T)] * 3)
        b = every.evaluate_layers([0, 1, 2], pol.score("s"), lay, caches=[cache(T)] * 3)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
