"""Every shipped policy compiles, and each says what its paper (or its comment) says."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tiered_radix import Policy, load_policy
from tiered_radix.policy import shipped_names
from tiered_radix.policy.expr import BinOp, Call, Name, Num, to_text
from tiered_radix.policy.model import (
    Evict,
    Granularity,
    Keep,
    Quantize,
    RankAllocation,
    RateDistortion,
)
from tiered_radix.resources import policies_dir

SHIPPED = sorted(policies_dir().glob("*.yaml"))
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_policy.yaml"


def actions(p: Policy) -> list[type]:
    return [type(t.action) for t in p.tiers]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_file_compiles(path: Path) -> None:
    by_path, by_name = load_policy(path), load_policy(path.stem)
    assert by_path == by_name
    assert by_path.name == path.stem  # `policy:` matches the file name that selects it
    assert by_path.description
    assert path.read_text(encoding="utf-8").startswith("#")  # a comment says what it is


def test_shipped_names_are_the_folder() -> None:
    assert shipped_names() == [p.stem for p in SHIPPED]
    assert {"qevict", "rdkv", "full"} <= set(shipped_names())


# ---- QEvict -----------------------------------------------------------------------------------


def test_qevict_windows_of_32_for_k_and_v() -> None:
    p = load_policy("qevict")
    assert p.k == p.v == Granularity("window", 32) and p.coupled


def test_qevict_tiers_full_int2_evicted() -> None:
    p = load_policy("qevict")
    assert actions(p) == [Keep, Quantize, Evict]
    assert p.tiers[1].action.bits == 2  # the recoverable INT2 tier sits between the other two
    assert p.tiers[0].action == Keep("bf16")


def test_qevict_cumulative_attention_with_decay() -> None:
    p = load_policy("qevict")
    assert isinstance(p.allocate, RankAllocation)
    score = p.allocate.by
    if isinstance(score, Name) and score.id in dict(p.scores):
        score = p.score(score.id)
    if isinstance(score, BinOp):  # cumulative attention plus the question's (issue 18)
        assert score.op == "+" and score.right == Call(
            "pool_max", (Name("obs_attn"),), (("size", Num(7)),)
        )
        score = score.left
    assert score.fn == "cumulative" and score.args == (Name("attn"),)
    decay = score.kwarg("decay")
    assert isinstance(decay, Num) and 0 < decay.value < 1  # a decay, so not H2O's plain sum


def test_qevict_rank_allocation_write_once_and_periodic_routing() -> None:
    p = load_policy("qevict")
    assert isinstance(p.allocate, RankAllocation)
    assert len(p.allocate.shares) == 2 and sum(p.allocate.shares) == pytest.approx(1.0)
    assert p.ledger.write_once
    assert p.schedule.after_prefill and p.schedule.every is not None and p.schedule.every >= 1


# ---- RDKV -------------------------------------------------------------------------------------


def test_rdkv_bit_set() -> None:
    p = load_policy("rdkv")
    assert isinstance(p.allocate, RateDistortion)
    assert sorted(p.allocate.bits) == [0, 2, 4, 8, 16]
    assert actions(p) == [Keep, Quantize, Quantize, Quantize, Evict]  # derived from the bits
    assert [t.action.bits for t in p.tiers[1:4]] == [8, 4, 2]


def test_rdkv_v_per_token_k_per_channel() -> None:
    p = load_policy("rdkv")
    assert p.v == Granularity("token") and p.k == Granularity("channel") and not p.coupled


def test_rdkv_weights() -> None:
    rd = load_policy("rdkv").allocate
    # w_t: the column mass per prompt query (each prefill chunk's sum, accumulated) plus the
    # question's mass per query (obs_attn, pooled)
    per_query = BinOp("/", Call("cumulative", (Name("colmass"),)), Name("seq_len"))
    obs = Call("pool_max", (Name("obs_attn"),), (("size", Num(7)),))
    assert rd.v_weight == BinOp("+", per_query, BinOp("/", obs, Num(32)))
    # w_c = ||Q[:, c]|| ||K[:, c]|| / sqrt(d), ||Q[:, c]||^2 summed over the chunks
    qn = Call("sqrt", (Call("cumulative", (BinOp("^", Name("qnorm"), Num(2)),)),))
    qk = BinOp("*", qn, Name("knorm"))
    assert rd.k_weight == BinOp("/", qk, Call("sqrt", (Name("head_dim"),)))
    assert rd.sigma == Name("sigma")


def test_rdkv_protects_sinks_and_the_question() -> None:
    p = load_policy("rdkv")
    assert (p.protect.sinks, p.protect.recent) == (4, 64)


def test_rdkv_weights_once_after_the_whole_prompt() -> None:
    p = load_policy("rdkv")
    assert p.schedule.after_prefill and p.schedule.every is None and not p.ledger.write_once
    assert p.schedule.prefill_defers


# ---- baselines, as their comments describe them -----------------------------------------------


def test_full_keeps_everything() -> None:
    p = load_policy("full")
    assert (p.budget.kind, p.budget.value) == ("fraction", 1.0)
    assert actions(p) == [Keep]


def test_streaming_sinks_plus_recent() -> None:
    p = load_policy("streaming")
    assert p.protect.sinks == 4 and p.k == Granularity("token")
    assert actions(p) == [Keep, Evict]
    assert p.allocate.by == Name("newness") and p.score("newness") == Name("position")
    assert p.schedule.every == 1


def test_h2o_accumulated_attention_without_decay() -> None:
    p = load_policy("h2o")
    assert p.score("heavy") == Call("cumulative", (Name("attn"),), (("decay", Num(1)),))
    assert (p.protect.sinks, p.protect.recent) == (4, 64)
    assert actions(p) == [Keep, Evict] and p.k == Granularity("token")
    assert p.schedule.every == 1


def test_snapkv_one_shot_observation_window_max_pooled() -> None:
    p = load_policy("snapkv")
    assert p.score("vote") == Call("pool_max", (Name("obs_attn"),), (("size", Num(7)),))
    assert actions(p) == [Keep, Evict] and p.protect.recent == 32
    assert p.schedule.after_prefill and p.schedule.every is None  # never revisited


def test_kivi_uniform_two_bits_with_residual() -> None:
    p = load_policy("kivi")
    assert actions(p) == [Quantize]  # nothing evicted, nothing full except the residual
    assert p.tiers[0].action == Quantize(bits=2, group=32, axis="kivi")
    assert p.protect.recent == 128 and p.budget.value == 1.0


# ---- the example that combines both papers ----------------------------------------------------


def test_custom_example_combines_qevict_and_rdkv() -> None:
    p = load_policy(EXAMPLE)
    assert p.k == p.v == Granularity("window", 32)
    assert isinstance(p.allocate, RateDistortion) and p.allocate.bits == (16, 4, 2, 0)
    assert actions(p) == [Keep, Quantize, Quantize, Evict]
    assert [t.action.bits for t in p.tiers[1:3]] == [4, 2]
    assert p.allocate.v_weight == Name("heat")
    attn = Call("cumulative", (Name("attn"),), (("decay", Num(0.99)),))
    assert p.score("heat") == BinOp("+", attn, Name("colmass"))
    assert p.ledger.write_once and p.schedule.every == 16


def test_the_full70_example_is_qevict_with_other_shares() -> None:
    """examples/qevict_full70.yaml (the niah_multivalue precision test of GPU eval run 6) is
    qevict as shipped then (examples/qevict_v1.yaml) but for its name and its 70/30 split
    between full precision and INT2."""
    ours = load_policy(EXAMPLE.parent / "qevict_full70.yaml")
    ref = load_policy(EXAMPLE.parent / "qevict_v1.yaml")
    assert ours.allocate.shares == (0.7, 0.3) and ref.allocate.shares == (0.5, 0.5)
    same = ("name", "description", "source", "allocate")
    assert replace(ours, **{f: getattr(ref, f) for f in same}) == ref
    assert replace(ours.allocate, shares=ref.allocate.shares) == ref.allocate


def test_qevict_v1_is_qevict_but_for_its_first_routing() -> None:
    """Issue 18: the shipped qevict defers its prefill routing to the first decode step and
    adds the pooled observation window to its score; examples/qevict_v1.yaml keeps the old
    schedule and score for comparison, nothing else differs."""
    new, old = load_policy("qevict"), load_policy(EXAMPLE.parent / "qevict_v1.yaml")
    assert new.schedule.prefill_defers and not old.schedule.prefill_defers
    assert to_text(new.score("score")) == (
        "(cumulative(attn, decay=0.99) + pool_max(obs_attn, size=7))"
    )
    same = ("name", "description", "source", "schedule", "scores")
    assert replace(old, **{f: getattr(new, f) for f in same}) == new
    assert replace(old.schedule, prefill_defers=True) == new.schedule


# ---- the reference stays true to the language -------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "policy-language.md"
RANK_BASE = """\
budget: 10%
units: window(size=32)
scores:
  heat: cumulative(attn, decay=0.99)
tiers: {full: keep(bf16), int2: quantize(bits=2), evicted: evict}
allocate: {method: rank, by: heat}
"""
RD_BASE = """\
budget: 10%
units: {k: channel, v: token}
scores:
  heat: cumulative(attn, decay=0.99)
allocate: {method: rate_distortion, v_weight: colmass, k_weight: qnorm, sigma: sigma}
"""


def test_docs_name_every_key_signal_and_function() -> None:
    from tiered_radix.policy.compiler import TOP_KEYS
    from tiered_radix.policy.vocabulary import CONSTANTS, FUNCTIONS, SIGNALS

    text = DOC.read_text(encoding="utf-8")
    for name in [*TOP_KEYS, *SIGNALS, *CONSTANTS]:
        assert f"`{name}`" in text, name
    for fn in FUNCTIONS:
        assert f"`{fn}(" in text, fn


def test_every_yaml_block_in_the_docs_compiles(tmp_path: Path) -> None:
    """A block with ``budget:`` or ``extends:`` is a whole policy; any other block is a fragment
    and must compile laid over one of two small bases (rank, rate_distortion) with ``extends``."""
    import re

    (tmp_path / "rank.yaml").write_text(RANK_BASE, encoding="utf-8")
    (tmp_path / "rd.yaml").write_text(RD_BASE, encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        whole = re.search(r"^(budget|extends):", block, re.M) is not None
        candidates = (
            [block] if whole else [f"extends: {b}\n{block}" for b in ("rank.yaml", "rd.yaml")]
        )
        errors = []
        for j, text in enumerate(candidates):
            path = tmp_path / f"block{i}_{j}.yaml"
            path.write_text(text, encoding="utf-8")
            try:
                load_policy(path)
                break
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(str(e))
        else:
            raise AssertionError(
                f"docs yaml block {i} does not compile:\n{block}\n" + "\n".join(errors)
            )
