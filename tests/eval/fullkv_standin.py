"""TEST STAND-IN, not the adapter: full-KV greedy answers from plain ``model.generate``.

It ignores the policy entirely (every token stays in the HF dynamic cache), so it is only a
reference for the harness plumbing and for the adapter's ``full`` policy, never a policy result.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_radix.eval.engines import Reply


class FullKVStandIn:
    name = "hf-generate-standin"
    context_window = None

    def __init__(self, model: str = "smollm2-135m") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tiered_radix.models import model_dir

        folder = model_dir(model)
        self.model = model
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt: str, policy, max_new_tokens: int) -> Reply:
        return self.chat([prompt], policy, max_new_tokens)[-1]

    def chat(self, turns: Sequence[str], policy, max_new_tokens: int) -> list[Reply]:
        import torch

        messages, replies = [], []
        for user in turns:
            messages.append({"role": "user", "content": user})
            enc = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            with torch.no_grad():
                out = self.hf_model.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=False,
                    pad_token_id=self.tokenizer.eos_token_id,
                )  # fmt: skip
            new = out[0, enc["input_ids"].shape[1] :]
            text = self.tokenizer.decode(new, skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": text})
            replies.append(Reply(text, {"new_tokens": int(new.numel())}))
        return replies
