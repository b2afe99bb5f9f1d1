"""kvpress side by side: budget mapping, prompt split, byte accounting and the row schema run
everywhere; the press fan-out is checked against kvpress's own hooks where kvpress imports
(its own venv: bench/kvpress_env.sh)."""

from __future__ import annotations

import contextlib
import importlib.util
import types

import pytest
import torch

from tiered_radix.eval import report, runner
from tiered_radix.eval.engines import Reply
from tiered_radix.eval.kvpress_engine import KVPressRunError, cache_bytes, kv_bytes, split_prompt
from tiered_radix.eval.kvpress_run import FULL, Config, compression_ratio, configurations, record
from tiered_radix.eval.tasks import make_sample
from tiered_radix.policy import load_policy


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize(("label", "ratio"), [("10%", 0.9), ("20%", 0.8), ("5%", 0.95),
                                              ("100%", 0.0), ("12.5%", 0.875)])  # fmt: skip
def test_budget_label_is_fraction_kept(label, ratio):
    assert compression_ratio(label) == pytest.approx(ratio, abs=1e-9)


@pytest.mark.parametrize("label", ["0%", "120%", "64 MiB", "2048 tokens", "ten%"])
def test_budget_without_press_equivalent_is_refused(label):
    with pytest.raises(KVPressRunError, match="kept fraction"):
        compression_ratio(label)


def test_configurations_reference_first_kivi_once_and_typo_hint():
    cs = configurations(["snapkv", "kivi2"], ["10%", "20%"], in_context=False)
    assert cs[0] == Config(FULL, "100%", None, 0.0)
    assert [(c.policy, c.label, c.ratio) for c in cs[1:]] == [
        ("kvpress-snapkv", "10%", 0.9), ("kvpress-snapkv", "20%", 0.8),
        ("kvpress-kivi2", "100%", 0.0),
    ]  # fmt: skip
    assert configurations(["knorm"], ["10%"], in_context=True)[1].policy == "kvpress-knorm+q"
    with pytest.raises(KVPressRunError, match="Did you mean 'snapkv'"):
        configurations(["snapkvv"], ["10%"], in_context=False)


@pytest.mark.parametrize("task", ["niah_single", "needle", "niah_multikey", "vt", "cwe", "fwe"])
def test_split_keeps_the_whole_prompt_and_holds_back_the_question(task):
    s = make_sample(task, 300, 0, words, seed=0)
    context, question = split_prompt(s.prompt)
    assert context + question == s.prompt
    assert "\n" not in question and question.rstrip().endswith(("only.", "number only."))
    assert all(a not in question for a in s.answers)  # the answers stay in the context


def test_cache_bytes_counts_tensors_and_kivi_codes():
    g = torch.Generator().manual_seed(0)
    layers = [types.SimpleNamespace(keys=torch.randn(1, 3, n, 64, generator=g),
                                    values=torch.randn(1, 3, n, 64, generator=g))
              for n in (5, 9)]  # fmt: skip
    plain = types.SimpleNamespace(layers=layers)
    # Reference: every stored element of K and V at 2 bytes.
    assert cache_bytes(plain, 3, 64) == sum(2 * (lay.keys.numel() + lay.values.numel())
                                            for lay in layers)  # fmt: skip
    # 100 tokens seen, 20 of them in the residual: 80 at 2 bits + 4 bytes per 64 elements.
    q = types.SimpleNamespace(keys=torch.ones(1, 2, 20, 8), nbits=2, q_group_size=64,
                              cumulative_length=100)  # fmt: skip
    elements = 2 * 2 * 8  # K and V, 2 heads, d = 8, per token
    expect = 20 * elements * 2 + 80 * elements * (2 / 8 + 4 / 64)
    assert cache_bytes(types.SimpleNamespace(layers=[q]), 2, 8) == pytest.approx(expect)
    assert kv_bytes(10, 3, 64) == 10 * 2 * 3 * 64 * 2


class _Engine:
    name, model = "kvpress", "m"
    context_window = None

    def count_tokens(self, text):
        return words(text)

    def generate(self, prompt, policy, max_new_tokens):
        return Reply("the number is 1", {"bytes_used": 10, "full_bytes": 100})


def test_rows_have_the_runner_schema_and_report_together():
    s = make_sample("niah_single", 300, 0, words, seed=0)
    ours = runner.run_cell(_Engine(), load_policy("snapkv"), "10%", s, None)
    ours = {"key": "k0", "seed": 0, **ours}
    c = configurations(["snapkv"], ["10%"], in_context=False)[1]
    theirs = record(s, c, model="m", seed=0, max_new=32, key="k1", prediction=s.answers[0],
                    stats={"bytes_used": 12.0, "full_bytes": 100}, seconds=1.0)  # fmt: skip
    assert set(theirs) == set(ours)
    assert theirs["score"] == 1.0 and ours["score"] == 0.0
    failed = record(s, c, model="m", seed=0, max_new=32, key="k2", prediction=None, stats={},
                    seconds=1.0, error="RuntimeError: x")  # fmt: skip
    assert "score" not in failed and failed["error"] == "RuntimeError: x"
    rows = report.build_rows([ours, theirs, failed])
    by_policy = {r["policy"]: r for r in rows}
    assert by_policy["kvpress-snapkv"]["bytes_fraction"] == pytest.approx(0.12)
    assert by_policy["kvpress-snapkv"]["errors"] == 1 and by_policy["kvpress-snapkv"]["n"] == 1
    assert by_policy["snapkv"]["score"] == 0.0


kvpress_missing = importlib.util.find_spec("kvpress") is None


@pytest.mark.skipif(kvpress_missing, reason="kvpress is not installed (bench/kvpress_env.sh)")
def test_fan_out_equals_one_press_at_a_time():
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from tiered_radix.eval.kvpress_engine import fan_out, make_press

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (1, 150))
    names = {"snap": ("snapkv", 0.9), "knorm": ("knorm", 0.5), "stream": ("streaming", 0.8),
             "full": (None, 0.0)}  # fmt: skip
    fan = fan_out({k: make_press(n, r) for k, (n, r) in names.items()})
    with torch.inference_mode():
        with fan(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        for key, (name, ratio) in names.items():
            alone = DynamicCache()
            press = make_press(name, ratio)
            with press(model) if press is not None else contextlib.nullcontext():
                model.model(input_ids=ids, past_key_values=alone)
            for mine, ref in zip(fan.caches[key].layers, alone.layers, strict=True):
                assert mine.keys.shape[-2] == int(150 * (1 - ratio)) or ratio == 0.0
                torch.testing.assert_close(mine.keys, ref.keys, rtol=0, atol=0)
                torch.testing.assert_close(mine.values, ref.values, rtol=0, atol=0)


def test_offline_stand_in_refuses_use_but_not_introspection(monkeypatch):
    """The stand-in for ``datasets`` raises when kvpress uses it, and has no dunder attributes:
    the GPU run 6 stand-in answered ``__file__`` with a function, and ``inspect.getmodule`` (run
    by ``torch.library`` when kvpress registers a custom op) crashed on it."""
    import inspect
    import sys

    from tiered_radix.eval.kvpress_engine import _offline_module

    mod = _offline_module("datasets_standin")
    with pytest.raises(RuntimeError, match="offline kvpress run"):
        mod.load_dataset("x")
    assert not hasattr(mod, "__file__") and not hasattr(mod, "__path__")
    monkeypatch.setitem(sys.modules, "datasets_standin", mod)
    assert inspect.getmodule(test_offline_stand_in_refuses_use_but_not_introspection,
                             "/no/such/file.py") is not mod  # walks sys.modules  # fmt: skip
