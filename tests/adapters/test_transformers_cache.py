"""The transformers adapter on a tiny random Llama (no downloads), against plain transformers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiered_radix.kernels.colmass_ref import column_mass_ref  # noqa: E402
from tiny_llama import tiny_llama, tokens  # noqa: E402

from tiered_radix.adapters.transformers import (  # noqa: E402
    AdapterError,
    ChatSession,
    TieredCache,
    attend,
    tiered_attention_on,
)
from tiered_radix.engine.attention import attend_sdpa  # noqa: E402

POLICIES = sorted(Path(__file__).parents[2].joinpath("policies").glob("*.yaml"))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def plain_greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own path (sdpa, DynamicCache): generated ids and each step's logits."""
    cache = transformers.DynamicCache(config=model.config)
    out, logits, x = [], [], torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            lg = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
            logits.append(lg)
            out.append(int(lg.argmax()))
            x = torch.tensor([[out[-1]]])
    return out, logits


# -- the attention function against dense float64 references --------------------------------
def dense(q, k, v, kept, scale):
    hq, tq, _ = q.shape
    h, t, _ = k.shape
    g = hq // h
    k64 = torch.nan_to_num(k.double()).repeat_interleave(g, 0)
    v64 = torch.nan_to_num(v.double()).repeat_interleave(g, 0)
    s = q.double() @ k64.transpose(1, 2) * scale
    allowed = torch.ones(tq, t, dtype=torch.bool).tril(t - tq)[None]
    if kept is not None:
        allowed = allowed & kept.repeat_interleave(g, 0)[:, None, :]
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
    return p @ v64, p.reshape(h, g, tq, t).sum(1)  # out [Hq, tq, d], mass [H, tq, T]


@pytest.mark.parametrize("evict", [False, True])
def test_attend_matches_dense_reference_and_colmass_ref(evict):
    g = torch.Generator().manual_seed(3)
    hq, h, tq, t, d = 6, 2, 45, 60, 16
    q, k, v = (torch.randn(*s, generator=g) for s in ((hq, tq, d), (h, t, d), (h, t, d)))
    kept = None
    if evict:  # evict some cached tokens (not the chunk's own), poisoned like the store does
        kept = torch.rand(h, t, generator=g) > 0.4
        kept[:, t - tq :] = True
        k, v = k.masked_fill(~kept[..., None], math.nan), v.masked_fill(~kept[..., None], math.nan)
    need = frozenset({"colmass", "obs_attn", "qnorm"})
    out, sig = attend(q, k, v, kept, 0.3, need=need, chunk_elems=hq * t * 7)  # 7-row chunks
    ref, mass = dense(q, k, v, kept, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sig.attn.double(), mass[:, -1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sig.colmass.double(), mass.sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sig.obs_attn.double(), mass[:, -32:].sum(1), rtol=1e-5, atol=1e-5)
    qn = q.double().reshape(h, hq // h, tq, d).norm(dim=(1, 2))
    torch.testing.assert_close(sig.qnorm.double(), qn, rtol=1e-5, atol=1e-5)
    if evict:
        assert (sig.attn[~kept] == 0).all() and (sig.colmass[~kept] == 0).all()
    else:  # the engine's chunked reference twin agrees
        cm = column_mass_ref(q.transpose(0, 1), k.transpose(0, 1), scale=0.3, q_offset=t - tq)
        torch.testing.assert_close(sig.colmass, cm, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tq", [1, 45, 60])  # 60: the whole prompt (no mask)
@pytest.mark.parametrize("evict", [False, True])
def test_attend_sdpa_matches_dense_reference(evict, tq, dtype):
    """The fused-kernel variant (SGLang's extend on CUDA): outputs in the inputs' dtype, row
    chunks bounded by chunk_elems, evicted rows NaN-poisoned; signals as attend's."""
    g = torch.Generator().manual_seed(4)
    hq, h, t, d = 6, 2, 60, 16
    q, k, v = (torch.randn(*s, generator=g) for s in ((hq, tq, d), (h, t, d), (h, t, d)))
    kept = None
    if evict:
        kept = torch.rand(h, t, generator=g) > 0.4
        kept[:, t - tq :] = True
        k, v = k.masked_fill(~kept[..., None], math.nan), v.masked_fill(~kept[..., None], math.nan)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    need = frozenset({"obs_attn", "qnorm"})
    out, sig = attend_sdpa(q, k, v, kept, 0.3, need=need, chunk_elems=hq * t * 7)
    ref, mass = dense(q, k, v, kept, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == torch.float32 and out.isfinite().all()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(sig.attn.double(), mass[:, -1], rtol=tol, atol=1e-3 * tol)
    torch.testing.assert_close(sig.obs_attn.double(), mass[:, -32:].sum(1), rtol=tol, atol=tol)
    torch.testing.assert_close(sig.qnorm, attend(q, k, v, kept, 0.3, need=need)[1].qnorm)
    assert sig.colmass is None
    with_cm = attend_sdpa(q, k, v, kept, 0.3, need=need | {"colmass"})[1]  # falls back to attend
    torch.testing.assert_close(with_cm.colmass.double(), mass.sum(1), rtol=tol, atol=tol)


# -- (a) the full policy is the model itself ---------------------------------------------------
def test_full_policy_reproduces_plain_logits_and_tokens(model):
    prompt = tokens(50, 1)
    ref_ids, ref_logits = plain_greedy(model, prompt, 12)
    cache = TieredCache("full", model.config)
    x, ids = torch.tensor([prompt]), []
    with torch.no_grad(), tiered_attention_on(model):
        for ref in ref_logits:
            lg = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(lg, ref, rtol=1e-4, atol=1e-4)
            ids.append(int(lg.argmax()))
            x = torch.tensor([[ids[-1]]])
    assert ids == ref_ids and len(set(ids)) > 1
    assert model.config._attn_implementation == "sdpa"  # restored
    session = ChatSession(model, None, "full", max_new_tokens=12, eos_ids=())
    assert list(session.ask_ids(prompt).ids) == ref_ids


def test_model_generate_runs_on_the_tiered_cache(model):
    prompt = torch.tensor([tokens(40, 2)])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = model.generate(prompt, **kw)
    with tiered_attention_on(model):
        got = model.generate(prompt, past_key_values=TieredCache("full", model.config), **kw)
    assert torch.equal(got, want)


# -- (b) qevict under a small budget -----------------------------------------------------------
def test_qevict_meets_budget_uses_three_tiers_and_attends_what_the_store_keeps(model):
    session = ChatSession(model, None, "qevict", budget="25%", max_new_tokens=20, eos_ids=())
    turn = session.ask_ids(tokens(700, 4))
    cache = session.cache
    steps = cache.store.events.steps
    assert len(steps) == 2  # after prefill, after decode step 15
    for s in steps:
        assert not s.over_budget and 0 < s.bytes_used <= s.budget
    assert all(n > 0 for n in turn.occupancy.values()), turn.occupancy
    assert turn.bytes_used < 0.3 * turn.full_bytes

    # The next step's logits equal transformers' eager attention over the store's view with the
    # evicted tokens masked per KV head (an independent attention implementation).
    views = [cache.store.view(li) for li in range(cache.n_layers)]
    assert all((~kept).any() for _, _, kept in views)
    token = torch.tensor([[turn.ids[-1]]])
    with torch.no_grad(), tiered_attention_on(model):
        got = model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1]
    want = eager_over_views(model, views, token)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def eager_over_views(model, views, token) -> torch.Tensor:
    ref = transformers.DynamicCache(config=model.config)
    masks = []
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    for li, (k, v, kept) in enumerate(views):
        ref.update(torch.nan_to_num(k)[None], torch.nan_to_num(v)[None], li)
        allowed = torch.cat([kept, torch.ones(kept.shape[0], 1, dtype=torch.bool)], 1)
        add = torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
        masks.append(add.repeat_interleave(g, 0)[None, :, None, :])  # [1, Hq, 1, T + 1]

    def hook(module, args, kwargs):
        kwargs["attention_mask"] = masks[module.layer_idx]
        return args, kwargs

    hooks = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
        for layer in model.model.layers
    ]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(input_ids=token, past_key_values=ref, use_cache=True).logits[0, -1]
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()


# -- (c) multi-turn prefix reuse ---------------------------------------------------------------
def test_second_turn_prefills_only_its_tokens_and_matches_a_fresh_run(model):
    p1, p2 = tokens(60, 5), tokens(25, 6)
    session = ChatSession(model, None, "full", max_new_tokens=10, eos_ids=())
    t1 = session.ask_ids(p1)
    t2 = session.ask_ids(p2)
    assert (t1.prefill_tokens, t1.reused_tokens) == (60, 0)
    assert (t2.prefill_tokens, t2.reused_tokens) == (25, 60 + 10)
    assert session.cache.n_tokens() == 60 + 10 + 25 + 10
    fresh, _ = plain_greedy(model, p1 + list(t1.ids) + p2, 10)
    assert list(t2.ids) == fresh
    # one more token on the reused cache: its logits equal one uncached pass over everything
    everything = p1 + list(t1.ids) + p2 + list(t2.ids) + [7]
    with torch.no_grad():
        want = model(torch.tensor([everything])).logits[0, -1]
        with tiered_attention_on(model):
            got = model(torch.tensor([[7]]), past_key_values=session.cache).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [7, 16, 49])
def test_chunked_prefill_routes_after_each_chunk_and_full_matches_one_forward(model, n):
    prompt = tokens(50, 1)
    ref = ChatSession(model, None, "full", max_new_tokens=6, eos_ids=()).ask_ids(prompt)
    session = ChatSession(model, None, "full", max_new_tokens=6, eos_ids=(), prefill_chunk=n)
    assert session.ask_ids(prompt).ids == ref.ids
    chunks = math.ceil(50 / n) - (50 % n == 1)  # a last chunk of one token joins the one before
    reasons = [s.reason for s in session.cache.store.events.steps]
    assert reasons == [f"after prefill {i}" for i in range(1, chunks + 1)]
    with pytest.raises(ValueError, match="prefill_chunk"):
        ChatSession(model, None, "full", prefill_chunk=1)


def test_deferred_policy_routes_once_after_a_chunked_prompt(model, tmp_path):
    """``after_prefill(defer=true)``: the chunks of a prompt do not route; the first decode step
    does, once per turn, and meets the budget (qevict before issue 18 routed after every
    chunk)."""
    src = tmp_path / "deferred.yaml"
    src.write_text(
        f"extends: {Path(__file__).parents[2] / 'policies' / 'qevict.yaml'}\n"
        "schedule: after_prefill(defer=true), every(16)\n"
    )
    session = ChatSession(
        model, None, str(src), budget="50%", max_new_tokens=3, eos_ids=(), prefill_chunk=64
    )
    t1 = session.ask_ids(tokens(300, 3))
    t2 = session.ask_ids(tokens(100, 4))
    steps = session.cache.store.events.steps
    assert [s.reason for s in steps] == ["decode step 0", "decode step 3"]
    assert not t1.over_budget and not t2.over_budget and t2.occupancy["int2"] > 0
    v1 = Path(__file__).parents[2] / "examples" / "qevict_v1.yaml"  # routes after every chunk
    eager = ChatSession(model, None, str(v1), budget="50%", max_new_tokens=3, eos_ids=(),
                        prefill_chunk=64)  # fmt: skip
    eager.ask_ids(tokens(300, 3))
    assert [s.reason for s in eager.cache.store.events.steps][:5] == [
        f"after prefill {i}" for i in range(1, 6)
    ]


def test_qevict_second_turn_keeps_the_store(model):
    session = ChatSession(model, None, "qevict", budget="30%", max_new_tokens=4, eos_ids=())
    t1 = session.ask_ids(tokens(400, 7))
    store = session.cache.store
    writes = store.events.counters["ledger_write"]
    t2 = session.ask_ids(tokens(30, 8))
    assert session.cache.store is store and t2.reused_tokens == 404 and t2.prefill_tokens == 30
    assert t1.occupancy.get("int2", 0) > 0 and writes > 0
    assert store.events.counters["ledger_write"] >= writes  # write-once copies were not redone
    assert t2.occupancy["evicted"] > 0 and not t2.over_budget


def test_archived_windows_come_back_at_the_next_turn(model, tmp_path):
    """``evict(archive=int2)``: turn 1 answers as without the archive; turn 2 starts with the
    evicted windows at INT2, attends to them, and its routing meets the budget again."""
    text = Path(__file__).parents[2].joinpath("policies", "qevict.yaml").read_text()
    archive = tmp_path / "archive.yaml"
    archive.write_text(text.replace("evicted: evict", "evicted: evict(archive=int2)"))
    plain = ChatSession(model, None, "qevict", budget="30%", max_new_tokens=4, eos_ids=())
    session = ChatSession(model, None, str(archive), budget="30%", max_new_tokens=4, eos_ids=())
    p1, t1 = plain.ask_ids(tokens(400, 7)), session.ask_ids(tokens(400, 7))
    assert t1.ids == p1.ids and t1.bytes_used == p1.bytes_used and t1.recalled == 0
    assert p1.archived_bytes == 0 and t1.archived_bytes > 0
    evicted = t1.occupancy["evicted"]
    t2 = session.ask_ids(tokens(30, 8))
    assert t2.recalled == evicted > 0
    store = session.cache.store
    assert store.events.steps[-1].bytes_used <= store.events.steps[-1].budget
    assert t2.bytes_used <= t2.budget_bytes and not t2.over_budget


# -- every shipped policy runs ----------------------------------------------------------------
@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.stem)
def test_every_shipped_policy_runs_two_turns(model, path):
    session = ChatSession(model, None, str(path), budget="30%", max_new_tokens=3, eos_ids=())
    session.ask_ids(tokens(300, 9))
    t2 = session.ask_ids(tokens(20, 10))
    assert t2.reused_tokens == 303 and session.cache.n_tokens() == 326
    for s in session.cache.store.events.steps:
        assert s.over_budget or s.bytes_used <= s.budget


def test_rejects_batches_and_windowed_layers(model):
    with pytest.raises(AdapterError, match="batch 1"), torch.no_grad():
        with tiered_attention_on(model):
            model(
                torch.tensor([tokens(5, 1)] * 2), past_key_values=TieredCache("full", model.config)
            )
    cfg = transformers.MistralConfig(num_hidden_layers=2, layer_types=["sliding_attention"] * 2)
    with pytest.raises(AdapterError, match="full_attention"):
        TieredCache("full", cfg)
    with pytest.raises(ValueError, match="at least 1"):
        ChatSession(model, None, "full", max_new_tokens=0)
