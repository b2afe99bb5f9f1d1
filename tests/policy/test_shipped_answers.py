"""The shipped compressing policies at their default budget answer short factual prompts as full
KV does, on the offline SmolLM2-135M (CPU, float32, greedy). Issue 18: ``rdkv`` at 10% answered
"The capital of France is" with " Parisswith the following code:" on the GPU and degenerated on
CPU, because its causal column mass gave the prompt's last tokens no bits (docs/fidelity.md)."""

from __future__ import annotations

import pytest
import torch

from tiered_radix.adapters.transformers.session import ChatSession
from tiered_radix.models import get_spec
from tiered_radix.models.fetch import export_verifies
from tiered_radix.models.paths import model_dir

NEW_TOKENS = 8
# (prompt, through the chat template?)
PROMPTS = [
    ("The capital of France is", False),
    ("The largest planet in the solar system is", False),
    ("What is the capital of Japan? Answer in one word.", True),
    ("Who wrote the play Romeo and Juliet?", True),
]


@pytest.fixture(scope="module")
def smollm2():
    if not export_verifies(model_dir("smollm2-135m"), get_spec("smollm2-135m")):
        pytest.skip("smollm2-135m is not fetched (tiered-radix model fetch smollm2-135m)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok


def _answer(model, tok, policy: str, prompt: str, chat: bool) -> tuple[int, ...]:
    session = ChatSession(model, tok, policy, max_new_tokens=NEW_TOKENS)
    if chat:
        return session.ask(prompt).ids
    return session.ask_ids(tok(prompt)["input_ids"]).ids


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["rdkv", "qevict"])
def test_short_factual_prompts_answer_as_full_kv(smollm2, policy):
    model, tok = smollm2
    for prompt, chat in PROMPTS:
        want = _answer(model, tok, "full", prompt, chat)
        got = _answer(model, tok, policy, prompt, chat)
        assert got == want, (prompt, tok.decode(want), tok.decode(got))
