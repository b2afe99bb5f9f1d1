"""`tiered-radix policy check|explain` and `model fetch`: exit codes and what explain says."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_radix.cli.explain import LLAMA_8B, ModelShape, explain, tier_bytes_per_token
from tiered_radix.cli.main import main
from tiered_radix.policy import compile_text, load_policy
from tiered_radix.policy.model import Keep, Quantize

POLICIES = sorted(Path(__file__).parents[2].joinpath("policies").glob("*.yaml"))
ERRORS = Path(__file__).parents[1] / "policy_errors"


def test_check_accepts_every_shipped_policy(capsys):
    assert main(["policy", "check", *map(str, POLICIES)]) == 0
    assert capsys.readouterr().out.count("ok  ") == len(POLICIES)


def test_check_exits_2_with_the_position(capsys):
    bad = ERRORS / "unknown_signal.yaml"
    assert main(["policy", "check", str(POLICIES[0]), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "^" in err and "did you mean" in err


def test_explain_by_name_exits_0(capsys):
    assert main(["policy", "explain", "qevict"]) == 0
    assert "qevict" in capsys.readouterr().out


def test_tier_bytes_from_first_principles():
    d = 128
    assert tier_bytes_per_token(Keep(), d) == 2 * d * 2  # K and V rows, 2 bytes each
    # 2-bit, groups of 32: K per channel over 32 tokens, V per token over d; fp16 scale + lo.
    k = (d * 32 * 2 / 8 + 4 * d) / 32
    v = d * 2 / 8 + 4 * d / 32
    assert tier_bytes_per_token(Quantize(bits=2, group=32), d) == k + v == 96


def test_explain_qevict_says_what_the_paper_does():
    text = explain(load_policy("qevict"))
    for phrase in ("window of 32 tokens", "one decision moves both", "first 4 tokens",
                   "last 64 tokens", "cumulative(attn, decay=0.99)", "2-bit codes, groups of 32",
                   "full up to 50% of the budget", "int2 up to 50% of the budget",
                   "the rest evicted", "within 10%", "every 16 decode steps", "write-once"):
        assert phrase in text, phrase
    # 10% of 128 KiB/token for Llama-3.1-8B; half the budget buys full rows, half INT2 rows.
    assert LLAMA_8B.full_bytes_per_token == 32 * 8 * 512
    assert "12.8 KiB/token of 128.0 KiB" in text
    full_share, int2_share = 0.05 * 512 / 512, 0.05 * 512 / 96
    assert f"{full_share:.1%} of tokens full" in text
    assert f"{int2_share:.1%} of tokens int2" in text
    assert f"{1 - full_share - int2_share:.1%} of tokens evicted" in text


def test_explain_rdkv_says_what_the_paper_does():
    text = explain(load_policy("rdkv"))
    for phrase in ("V in units of one token, K in units of one channel", "rate-distortion",
                   "{16, 8, 4, 2, 0}", "V units first over 50% of the budget",
                   "w(V) = ((cumulative(colmass) / seq_len) + (pool_max(obs_attn, size=7) / 32))",
                   "w(K) = ((sqrt(cumulative((qnorm ^ 2))) * knorm) / sqrt(head_dim))",
                   "Protected at full precision: the first 4 tokens",
                   "Routing runs: once after the whole prompt"):
        assert phrase in text, phrase


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.stem)
def test_explain_lists_every_tier_and_the_budget(path):
    policy = load_policy(path)
    text = explain(policy)
    assert all(f"  {t.name} " in text for t in policy.tiers)
    assert str(policy.budget) in text


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.stem)
def test_explain_says_how_many_tokens_a_server_pool_holds(path):
    """The SGLang pool's token slot for the model shape, and its tokens against a bf16 pool of
    the same bytes: the sizing's own numbers (adapters/sglang/sizing.py)."""
    from tiered_radix.adapters.sglang import sizing

    policy = load_policy(path)
    text = explain(policy, ModelShape("Qwen2.5-0.5B", 24, 2, 64))
    cell = sizing.cell_bytes(policy, policy.budget, 24, 2, 64, 2)
    line = next(x for x in text.splitlines() if x.startswith("In an SGLang server"))
    assert f"{2 * 24 * 2 * 64 * 2 / cell:.1f}x the tokens of a bf16 pool" in line
    assert ("keeps its full-precision rows" in line) == (not policy.coupled)


def test_explain_says_when_a_server_would_refuse_the_policy():
    text = """
policy: tokens
budget: 98%
units: token
scores:
  s: attn
tiers:
  full: keep(bf16)
  int2: quantize(bits=2, group=32)
  evicted: evict
allocate: {method: rank, by: s, shares: {full: 50%, int2: 50%}}
"""
    out = explain(compile_text(text))
    assert "In an SGLang server (--kv-policy): refused at launch" in out
    assert "would hold no more tokens than SGLang's own" in out


def test_model_fetch_unknown_name_exits_2(capsys):
    assert main(["model", "fetch", "smolm"]) == 2
    assert "did you mean 'smollm2-135m'" in capsys.readouterr().err.lower()
