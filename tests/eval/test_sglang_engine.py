"""``--engine sglang`` without a GPU: a stand-in ``sglang`` module records every
``sglang.Engine`` the eval starts and answers from the prompt, so the runner's
configuration-by-configuration path, the engine arguments (plain SGLang for full KV, the plugin's
``kv_policy``/``kv_budget`` otherwise), batching, multi-turn histories, resume and errors are
checked. The real server runs on the GPU machine (bench/README.md)."""

from __future__ import annotations

import re
import sys
import types

import pytest

from tiered_radix.eval.runner import Grid, load_results, run_grid
from tiered_radix.eval.sglang_engine import SGLangEngine
from tiered_radix.policy import compile_text, load_policy

_WORD = re.compile(r"\w+|[^\w\s]")


class Tokenizer:
    """Counts words; a rendered prompt becomes one id that the stand-in server reads back. No
    chat template, so prompts are ``User:/Assistant:`` lines."""

    chat_template = None

    def __init__(self) -> None:
        self.texts: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(_WORD.findall(text))))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.texts.append(text)
        return {"input_ids": [len(self.texts) - 1]}


class FakeEngine:
    """``sglang.Engine``: answers the last user message's question from the conversation it was
    given; a ``kv_budget`` of 5% answers nothing (stands for a policy that lost the needle)."""

    started: list = []
    tokenizer: Tokenizer

    def __init__(self, **kw) -> None:
        if kw.get("kv_policy") == "broken":
            raise ValueError("policy refused by the server")
        self.kw, self.calls = kw, []
        FakeEngine.started.append(self)

    def generate(self, input_ids, sampling_params):
        self.calls.append(len(input_ids))
        out = []
        for ids in input_ids:
            text = self.tokenizer.texts[ids[0]]
            found = dict(re.findall(r"numbers for ([\w-]+) is: (\d+)", text))
            asked = re.findall(r"number for ([\w-]+) mentioned", text.rsplit("User: ", 1)[-1])
            right = found.get(asked[0], "") if asked else "OK"
            answer = "no idea" if self.kw.get("kv_budget") == "5%" else f"It is {right}."
            out.append({"text": answer, "meta_info": {"prompt_tokens": len(text)}})
        return out

    def shutdown(self) -> None:
        self.kw["shut"] = True


@pytest.fixture
def engine(monkeypatch, tmp_path):
    FakeEngine.started = []
    FakeEngine.tokenizer = tok = Tokenizer()
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    return SGLangEngine(str(tmp_path), tokenizer=tok, engine_kwargs={"mem_fraction_static": 0.5})


def grid(**kw) -> Grid:
    base = dict(policies=(load_policy("full"), load_policy("qevict")), budgets=("5%", "20%"),
                tasks=("niah_multikey", "multiturn"), lengths=(300,), samples=3)  # fmt: skip
    return Grid(**{**base, **kw})


def test_one_server_per_configuration_all_samples_batched(engine, tmp_path):
    records = run_grid(engine, grid(), tmp_path / "out", progress=False)
    kws = [e.kw for e in FakeEngine.started]
    policies = [k.get("kv_policy") for k in kws]  # full KV: plain SGLang
    assert policies[0] is None and all(p.endswith("policies/qevict.yaml") for p in policies[1:])
    assert [k.get("kv_budget") for k in kws] == [None, "5%", "20%"]
    assert all(k["shut"] and k["mem_fraction_static"] == 0.5 for k in kws)
    turns = max(len(r.get("turns", [0])) for r in records)
    assert turns > 1  # multiturn samples ran every turn
    # 6 samples a configuration: turn 1 of all in one call, later turns of the multi-turn ones
    assert FakeEngine.started[0].calls[0] == 6 and len(FakeEngine.started[0].calls) == turns
    by = {(r["policy"], r["budget"]): [] for r in records}
    for r in records:
        by[(r["policy"], r["budget"])].append(r["score"])
    assert len(records) == 3 * 6 and all(len(v) == 6 for v in by.values())
    assert sum(by[("full", "100%")]) > 0 and sum(by[("qevict", "5%")]) == 0
    assert by[("full", "100%")] == by[("qevict", "20%")]
    again = run_grid(engine, grid(), tmp_path / "out", progress=False)  # resume: no server
    assert len(FakeEngine.started) == 3 and len(again) == len(records)


def test_a_refused_configuration_is_recorded_in_its_cells(engine, tmp_path, monkeypatch):
    text = open(load_policy("h2o").source).read()
    broken = compile_text(text.replace("policy: h2o", "policy: broken"))
    monkeypatch.setattr(engine, "engine_args", lambda p, label: {"kv_policy": p.name})
    g = grid(policies=(load_policy("full"), broken), budgets=("20%",), tasks=("niah_multikey",))
    records = run_grid(engine, g, tmp_path, progress=False)
    errors = [r for r in records if "error" in r]
    assert len(errors) == 3 and all("policy refused" in r["error"] for r in errors)
    assert len(load_results(tmp_path / "results.jsonl")) == 6


def test_engine_args_and_errors(engine):
    assert engine.engine_args(load_policy("rdkv"), "10%")["kv_policy"].endswith("rdkv.yaml")
    with pytest.raises(Exception, match="fraction budgets"):
        engine.engine_args(load_policy("qevict"), "4096 tokens")
    engine.engine_kwargs["attention_backend"] = "triton"  # plain SGLang's; the plugin picks its own
    assert engine.engine_args(load_policy("full"), "100%")["attention_backend"] == "triton"
    assert "attention_backend" not in engine.engine_args(load_policy("qevict"), "10%")
    from tiered_radix.cli.eval import parse_engine_args

    assert parse_engine_args(["a=1", "b=0.5", "c=true", "d=triton"]) == {
        "a": 1, "b": 0.5, "c": True, "d": "triton"}  # fmt: skip
    assert engine.count_tokens("a b, c") == 4
    assert engine.prompt_ids([{"role": "user", "content": "hi"}]) == [0]
    assert engine.tokenizer.texts == ["User: hi\nAssistant:"]
