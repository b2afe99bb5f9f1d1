"""A tiny random Llama for adapter and evaluation tests (no downloads). A helper module, not a
conftest: tests import it by name (tests/ is on sys.path through tests/conftest.py)."""

from __future__ import annotations

import torch

VOCAB = 101


def tiny_llama():
    """2 layers, 4 query / 2 KV heads, head_dim 32, sdpa; attention sharpened (q and k weights
    x6) so that a masking or cache mistake moves the logits."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        attn_implementation="sdpa",
    )  # fmt: skip
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return m


def tokens(n: int, seed: int) -> list[int]:
    """``n`` seeded token ids of the tiny model's vocabulary (no special ids 0-2)."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(3, VOCAB, (n,), generator=g)]
