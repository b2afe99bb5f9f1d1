"""Record an attention trace from a Hugging Face causal LM on the CPU.

The recorder registers an attention function with transformers' ``AttentionInterface`` that
computes exactly what ``sdpa`` computes (batch 1, causal prefill, full-context decode) and keeps
the post-RoPE queries, keys and values of the chosen layers. It runs one prefill over the prompt
and then ``steps`` greedy decode steps, one token each. Column mass, query channel norms and the
observation-window mass (``obs_attn``) are computed afterwards from the float32 prefill queries
in row chunks (``trace.prefill_stats``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .trace import Trace, TraceError, TraceMeta, prefill_stats

ATTN_NAME = "tiered_radix_record"


class _Recorder:
    """Attention function + storage for one recording (``layers``: model layer indices)."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = set(layers)
        self.prefill_q: dict[int, torch.Tensor] = {}  # [P, H_q, d]
        self.decode_q: dict[int, list[torch.Tensor]] = {i: [] for i in layers}  # [H_q, d] each
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # latest [H_kv, T, d] cache
        self.scale: float | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        # query [1, H_q, Tq, d]; key/value [1, H_kv, Tk, d] (the whole cache, post-RoPE).
        assert query.shape[0] == 1, "the recorder runs batch 1"
        tq, tk = query.shape[2], key.shape[2]
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        mask = None
        if tq > 1:  # query row i sits at absolute position tk - tq + i
            mask = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
        layer = module.layer_idx
        if layer in self.layers:
            self.scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
            if layer not in self.prefill_q:  # the first call is the prefill (any prompt length)
                self.prefill_q[layer] = query[0].transpose(0, 1).detach().clone()
            else:
                self.decode_q[layer].append(query[0, :, 0].detach().clone())
            self.kv[layer] = (key[0].detach(), value[0].detach())
        return out.transpose(1, 2).contiguous(), None


def record_from_model(
    model,
    prompt_ids: Sequence[int],
    *,
    steps: int,
    layers: Sequence[int] | None = None,
    eos_ids: Sequence[int] = (),
    decode=None,
    model_name: str = "",
    prompt: str = "",
    extra: dict | None = None,
    progress: bool = True,
) -> Trace:
    """Prefill ``prompt_ids`` then greedy-decode up to ``steps`` tokens, recording ``layers``.

    ``model`` is a transformers causal LM whose attention goes through ``AttentionInterface``
    (Llama, Qwen2, ...). The attention function is registered globally under ``ATTN_NAME``, so
    run one recording at a time per process. Decoding stops early before feeding a token in
    ``eos_ids``, so ``trace.meta.steps`` may be smaller than ``steps``. ``decode(ids) -> str``
    renders the generated text. Returns a validated ``Trace`` (q/k/v cast to float16).

    Raises:
        TraceError: bad ``layers`` / ``steps`` / empty prompt.
    """
    from transformers import AttentionInterface, DynamicCache

    n_layers = model.config.num_hidden_layers
    layers = tuple(range(n_layers)) if layers is None else tuple(sorted(set(layers)))
    if not layers or not all(0 <= i < n_layers for i in layers):
        raise TraceError(f"layers: expected indices in [0, {n_layers}), got {list(layers)}")
    if steps < 0 or not prompt_ids:
        raise TraceError(f"need a non-empty prompt and steps >= 0 (got steps={steps})")
    rec = _Recorder(layers)
    AttentionInterface.register(ATTN_NAME, rec)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    generated: list[int] = []
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for _ in tqdm(range(steps), desc="decode", disable=not progress):
                token = int(out.logits[0, -1].argmax())
                if token in eos_ids:
                    break
                generated.append(token)
                step = torch.tensor([[token]], dtype=torch.long)
                out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
    return _to_trace(rec, list(prompt_ids), generated, decode, model_name, prompt, extra, model)


def _to_trace(rec, prompt_ids, generated, decode, model_name, prompt, extra, model) -> Trace:
    p, layers = len(prompt_ids), tuple(sorted(rec.layers))
    k, v, q, stats = [], [], [], []
    for layer in layers:
        key, value = rec.kv[layer]
        qd = rec.decode_q[layer]
        stats.append(prefill_stats(
            rec.prefill_q[layer].float().numpy(), key[:, :p].transpose(0, 1).float().numpy(),
            rec.scale,
        ))  # fmt: skip
        k.append(key.to(torch.float16).numpy())
        v.append(value.to(torch.float16).numpy())
        hq_d = rec.prefill_q[layer].shape[1:]
        q.append((torch.stack(qd) if qd else torch.zeros(0, *hq_d)).to(torch.float16).numpy())
    hkv, _, d = k[0].shape
    meta = TraceMeta(
        model=model_name, layers=layers, n_heads_q=rec.prefill_q[layers[0]].shape[1],
        n_heads_kv=hkv, head_dim=d, prompt_len=p, steps=len(generated), sm_scale=rec.scale,
        prompt=prompt, generated_text=decode(generated) if decode else "",
        prompt_ids=tuple(prompt_ids), generated_ids=tuple(generated),
        extra={"source": "recorded", "dtype": str(model.dtype).removeprefix("torch."),
               **(extra or {})},
    )  # fmt: skip
    cm, qn, obs = (tuple(x) for x in zip(*stats, strict=True))
    return Trace(meta, tuple(k), tuple(v), tuple(q), cm, qn, obs)


def record_trace(
    model_dir: str | Path,
    prompt: str,
    *,
    steps: int,
    layers: Sequence[int] | None,
    out: str | Path,
    chat: bool = True,
    model_name: str | None = None,
    extra: dict | None = None,
    progress: bool = True,
) -> Path:
    """Load the HF model in ``model_dir`` (CPU, float32), record ``prompt``, save to ``out``.

    ``chat`` wraps the prompt in the tokenizer's chat template (one user turn plus the
    generation prompt) when the tokenizer has one. Decoding stops at the model's EOS tokens.
    Returns ``out``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    if chat and tok.chat_template:
        msgs = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)
        ids = list(ids["input_ids"])
    else:
        ids = tok(prompt)["input_ids"]
    eos = model.generation_config.eos_token_id
    eos_ids = {*([eos] if isinstance(eos, int) else eos or ()), tok.eos_token_id} - {None}
    trace = record_from_model(
        model, ids, steps=steps, layers=layers, eos_ids=tuple(eos_ids),
        decode=lambda g: tok.decode(g, skip_special_tokens=True),
        model_name=model_name or model_dir.name, prompt=prompt,
        extra={"chat_template": bool(chat and tok.chat_template), **(extra or {})},
        progress=progress,
    )  # fmt: skip
    return trace.save(out)
