"""The recorder on a tiny random Llama (no downloads), checked against transformers' eager path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiered_radix.sim.record import record_from_model  # noqa: E402
from tiered_radix.sim.trace import OBS_WINDOW, Trace, TraceError  # noqa: E402

P, STEPS = 40, 10


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        attn_implementation="eager",
    )  # fmt: skip
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen attention so a wrong query cannot pass as "nearly uniform"
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return m


@pytest.fixture(scope="module")
def prompt():
    return [int(x) for x in torch.randint(3, 101, (P,), generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module")
def trace(model, prompt):
    return record_from_model(model, prompt, steps=STEPS, layers=[0, 1], progress=False)


@pytest.fixture(scope="module")
def reference(model, trace, prompt):
    """One eager forward over prompt + generated tokens: attentions, o_proj inputs, caches."""
    ids = torch.tensor([prompt + list(trace.meta.generated_ids)])
    captured = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda mod, args, i=i: captured.__setitem__(i, args[0][0].detach())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return out, captured


def test_greedy_tokens_match_uncached_argmax(model, trace, prompt):
    assert model.config._attn_implementation == "eager"  # the recorder restored it
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert trace.meta.generated_ids == tuple(ids[P:])
    assert trace.meta.steps == STEPS and trace.meta.prompt_len == P


def test_keys_values_are_the_models_post_rope_cache(trace, reference):
    out, _ = reference
    for li, layer in enumerate(trace.meta.layers):
        cache = out.past_key_values.layers[layer]
        k, v = cache.keys[0].numpy(), cache.values[0].numpy()  # [H_kv, T, d]
        np.testing.assert_allclose(trace.k[li], k, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(trace.v[li], v, rtol=2e-3, atol=2e-3)


def test_colmass_matches_dense_eager_attention(trace, reference):
    out, _ = reference
    m = trace.meta
    for li, layer in enumerate(m.layers):
        att = out.attentions[layer][0, :, :P, :P].double()  # [H_q, P, P] prompt rows
        want = att.reshape(m.n_heads_kv, m.group, P, P).sum(dim=(1, 2)).numpy()
        np.testing.assert_allclose(trace.colmass[li], want, rtol=1e-4, atol=1e-5)
        assert want.max() > 3 * want.mean()  # attention is far from uniform


def test_obs_attn_matches_last_prompt_rows_of_eager_attention(trace, reference):
    out, _ = reference
    m = trace.meta
    assert P > OBS_WINDOW  # the window is a strict suffix of the prompt rows
    for li, layer in enumerate(m.layers):
        att = out.attentions[layer][0, :, P - OBS_WINDOW : P, :P].double()  # [H_q, 32, P]
        want = att.reshape(m.n_heads_kv, m.group, OBS_WINDOW, P).sum(dim=(1, 2)).numpy()
        np.testing.assert_allclose(trace.obs_attn[li], want, rtol=1e-4, atol=1e-5)
        assert np.abs(trace.obs_attn[li] - trace.colmass[li]).max() > 1.0  # not all the rows


def test_qnorm_matches_model_queries(model, trace, prompt):
    m = trace.meta
    captured = {}

    def grab(mod, args, kwargs, output):
        captured["q"] = output[0].detach()

    attn = model.model.layers[1].self_attn
    h = attn.q_proj.register_forward_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([prompt]))
    h.remove()
    # rebuild the post-RoPE prompt queries from the model's own q_proj output and rotary table
    q = captured["q"].view(P, m.n_heads_q, m.head_dim).transpose(0, 1)[None]  # [1, H_q, P, d]
    cos, sin = model.model.rotary_emb(q, torch.arange(P)[None])
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q_rot, _ = apply_rotary_pos_emb(q, q, cos, sin)
    qn = q_rot[0].double().reshape(m.n_heads_kv, m.group, P, m.head_dim).norm(dim=(1, 2))
    np.testing.assert_allclose(trace.qnorm[trace.index(1)], qn.numpy(), rtol=1e-4)


def test_decode_queries_reproduce_attention_output(trace, reference):
    _, captured = reference
    m = trace.meta
    for li, layer in enumerate(m.layers):
        k = np.repeat(trace.k[li].astype(np.float64), m.group, axis=0)
        v = np.repeat(trace.v[li].astype(np.float64), m.group, axis=0)
        for s in range(m.steps):
            n = P + s + 1  # decode step s sees keys 0 .. P + s
            logits = np.einsum("hd,htd->ht", trace.q[li][s].astype(np.float64), k[:, :n])
            p = np.exp(logits * m.sm_scale - (logits * m.sm_scale).max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            ours = np.einsum("ht,htd->hd", p, v[:, :n])
            want = captured[layer][P + s].view(m.n_heads_q, m.head_dim).double().numpy()
            np.testing.assert_allclose(ours, want, rtol=2e-2, atol=5e-3)
            wrong = np.einsum("ht,htd->hd", np.full_like(p, 1.0 / n), v[:, :n])
            assert np.abs(wrong - want).max() > 10 * np.abs(ours - want).max()


def test_saved_trace_loads(trace, tmp_path):
    back = Trace.load(trace.save(tmp_path / "tiny.npz"))
    assert back.meta == trace.meta and np.array_equal(back.q[1], trace.q[1])


def test_layer_subset_and_eos(model, prompt, trace):
    first = trace.meta.generated_ids[3]
    sub = record_from_model(model, prompt, steps=STEPS, layers=[1], eos_ids=[first], progress=False)
    assert sub.meta.layers == (1,)
    assert (
        sub.meta.generated_ids == trace.meta.generated_ids[: trace.meta.generated_ids.index(first)]
    )
    np.testing.assert_array_equal(sub.q[0], trace.q[1][: sub.meta.steps])


def test_bad_layers(model, prompt):
    with pytest.raises(TraceError, match=r"layers: expected indices in \[0, 2\)"):
        record_from_model(model, prompt, steps=2, layers=[2], progress=False)


def test_one_token_prompt(model):
    tr = record_from_model(model, [5], steps=3, layers=[0], progress=False)
    assert tr.meta.prompt_len == 1 and tr.meta.steps == 3 and tr.q[0].shape == (3, 4, 16)
    np.testing.assert_allclose(tr.colmass[0], [[2.0], [2.0]], rtol=1e-6)  # G * P, all on token 0
    np.testing.assert_allclose(tr.obs_attn[0], [[2.0], [2.0]], rtol=1e-6)  # the window is P = 1
