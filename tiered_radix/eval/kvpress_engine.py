"""kvpress's text-generation pipeline on one model, measured the way our engine reports bytes.

Imported only inside the kvpress venv (transformers 5.2, kvpress 0.5.5); nothing here needs
kvpress or transformers at import time, so :func:`cache_bytes` is testable anywhere.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from .engines import model_window


class KVPressRunError(ValueError):
    """Bad input (press, budget, task, model folder) or a missing kvpress; says what to do."""


def split_prompt(text: str) -> tuple[str, str]:
    """``(context, question)``: the question is the last line, the context all before it
    (newline included), so ``context + question == text``."""
    cut = text.rfind("\n")
    if cut < 0:
        raise KVPressRunError("a prompt without a newline has no question line to hold back")
    return text[: cut + 1], text[cut + 1 :]


# The stop rule of adapters.transformers.session.stop_ids (not importable here: it needs
# transformers 5.x): the model's EOS ids, the tokenizer's, and a known end-of-turn token.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def kv_bytes(tokens: float, kv_heads: int, head_dim: int, bytes_per_element: float = 2) -> float:
    """Bytes of K and V for ``tokens`` tokens of one layer (bf16: 2 bytes an element)."""
    return tokens * 2 * kv_heads * head_dim * bytes_per_element


def cache_bytes(cache, kv_heads: int, head_dim: int) -> float:
    """Bytes ``cache`` holds now, over its layers, at bf16 whatever the storage dtype.

    A plain layer's ``keys`` are ``[1, H, T, d]`` (T = tokens kept). A ``QuantizedLayer``
    (KIVI-style) keeps ``cumulative_length - T`` tokens quantized at ``nbits / 8`` bytes an
    element plus a 2-byte scale and a 2-byte zero point per ``q_group_size`` elements, and its
    ``keys`` (the full-precision residual) at 2 bytes.
    """
    total = 0.0
    for layer in cache.layers:
        residual = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
        total += kv_bytes(residual, kv_heads, head_dim)
        if hasattr(layer, "nbits"):
            per_element = layer.nbits / 8 + 4 / layer.q_group_size
            total += kv_bytes(layer.cumulative_length - residual, kv_heads, head_dim, per_element)
    return total


def import_kvpress() -> types.ModuleType:
    """``import kvpress``. Where ``datasets`` / ``fire`` are absent (the GPU machine: pyarrow
    does not fit a transfer) stand-in modules that raise when used take their place: kvpress
    needs them only for presses that calibrate on hub data (DuoAttention, ExpectedAttention
    statistics), none of which run here."""
    for name in ("datasets", "fire"):
        try:
            __import__(name)
        except ModuleNotFoundError:
            sys.modules[name] = _offline_module(name)
    try:
        import kvpress
    except ImportError as e:
        raise KVPressRunError(
            f"kvpress is not importable ({e}); create its venv: bash bench/kvpress_env.sh"
        ) from e
    return kvpress


def _offline_module(name: str) -> types.ModuleType:
    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"'{name}' is not installed (offline kvpress run)")

    def attr(key: str):
        if key.startswith("__"):  # no __file__, __path__, ...: inspect and importlib look them up
            raise AttributeError(key)
        return refuse

    mod = types.ModuleType(name)
    mod.__getattr__ = attr  # type: ignore[method-assign]
    return mod


def make_press(name: str | None, ratio: float):
    """A press by our short name; None (no press) for the reference and for ``kivi2``, whose
    quantization lives in the cache, not in a press."""
    kvpress = import_kvpress()
    factories: dict[str, Callable[[], Any]] = {
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),
        "expected": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        "streaming": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
        "observed": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
        "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
    }
    return factories[name]() if name in factories else None


def resolve_model(model: str) -> Path:
    from ..models.paths import model_dir
    from ..models.registry import MODELS

    folder = model_dir(model) if model in MODELS else Path(model)
    if not (folder / "config.json").is_file():
        fix = (
            f"run `tiered-radix model fetch {model}` in the main venv"
            if model in MODELS
            else f"give a Hugging Face folder or one of {', '.join(sorted(MODELS))}"
        )
        raise KVPressRunError(f"model '{model}': no config.json in {folder}; {fix}")
    return folder


def fan_out(presses: Mapping[Any, Any]):
    """A press that, during one prefill, gives every press of ``presses`` (key -> press, or
    None for no compression) the inputs kvpress's ``forward_hook`` would give it alone and
    stores each result in its own ``DynamicCache`` (``.caches[key]``); the prefill's own cache
    keeps every token. Prefill activations do not depend on the press (a press trims a layer's
    cache after that layer's attention), so this equals one prefill per press, once."""
    from kvpress import BasePress
    from kvpress.presses.base_press import is_prefilling
    from transformers import DynamicCache

    class FanOut(BasePress):
        def __init__(self) -> None:
            self.presses, self.caches = dict(presses), {k: DynamicCache() for k in presses}

        def post_init_from_model(self, model) -> None:
            for press in self.presses.values():
                if press is not None:
                    press.post_init_from_model(model)

        def forward_hook(self, module, input, kwargs, output):
            hidden, layer = kwargs["hidden_states"], module.layer_idx
            if not is_prefilling(kwargs["cache_position"], hidden.shape[1]):
                return output
            cached = kwargs["past_key_values"].layers[layer]
            for key, press in self.presses.items():
                kv = (cached.keys, cached.values)
                if press is not None:
                    kv = press.compress(module, hidden, *kv, output[1], kwargs)
                self.caches[key].update(*kv, layer)
            return output

    return FanOut()


class KVPressEngine:
    """kvpress presses on one model folder: its pipeline's preprocessing (chat template around
    context and question), prefill with the press's hooks, and ``generate_answer`` (greedy),
    with our stop tokens. One prefill per sample serves every press that shares an attention
    implementation (ObservedAttention needs eager's weights; KIVI its own quantized cache)."""

    name = "kvpress"

    def __init__(self, model: str, *, device="cpu", dtype="float32", threads=None) -> None:
        import_kvpress()
        import torch
        import transformers

        if threads:
            torch.set_num_threads(threads)
        transformers.utils.logging.disable_progress_bar()
        self.model, self.folder, self.device = model, resolve_model(model), device
        self.dtype = getattr(torch, dtype)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.folder)
        self.context_window = model_window(self.folder)
        self._pipes: dict[str, Any] = {}
        self.versions = {p: metadata.version(p) for p in ("kvpress", "transformers", "torch")}

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def pipeline(self, attn: str):
        """One model per attention implementation (ObservedAttention needs eager's weights)."""
        if attn not in self._pipes:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(
                self.folder, dtype=self.dtype, attn_implementation=attn
            )
            hf.to(self.device).eval()
            eos = hf.generation_config.eos_token_id
            ids = set([eos] if isinstance(eos, int) else eos or ()) | {self.tokenizer.eos_token_id}
            vocab = self.tokenizer.get_vocab()
            ids |= {vocab[t] for t in _END_OF_TURN if t in vocab}
            hf.generation_config.eos_token_id = sorted(ids - {None})
            from kvpress import KVPressTextGenerationPipeline

            self._pipes[attn] = KVPressTextGenerationPipeline(model=hf, tokenizer=self.tokenizer)
        return self._pipes[attn]

    def answer(
        self,
        prompt: str,
        presses: Mapping[Any, tuple[str | None, float]],
        max_new_tokens: int,
        *,
        in_context: bool = False,
    ) -> dict[Any, tuple[str, dict[str, Any]]]:
        """Answer ``prompt`` under each ``key -> (press name, ratio removed)``;
        ``key -> (text, stats)``."""
        import torch

        context, question = (prompt, "") if in_context else split_prompt(prompt)
        groups: dict[str, dict] = {}
        for key, (name, ratio) in presses.items():
            attn = {"observed": "eager", "kivi2": "kivi2"}.get(name or "", "sdpa")
            groups.setdefault(attn, {})[key] = (name, ratio)
        out = {}
        for attn, group in groups.items():
            pipe = self.pipeline("sdpa" if attn == "kivi2" else attn)
            ids = pipe.preprocess(context, [question], "", pipe.tokenizer.model_max_length)
            ctx, q = ids["context_ids"].to(self.device), ids["questions_ids"][0].to(self.device)
            with torch.inference_mode():
                caches = self._prefill(pipe.model, ctx, group, attn)
                for key, cache in caches.items():
                    kept = [cache.get_seq_length(i) for i in range(len(cache.layers))]
                    text = pipe.generate_answer(q, cache, ctx.shape[1], max_new_tokens)
                    stats = self._stats(cache, pipe.model.config, ctx.shape[1], q.shape[1], kept)
                    stats.update(compression_ratio=group[key][1], question_in_context=in_context)
                    out[key] = text.strip(), stats
        return out

    def _prefill(self, model, ctx, group: Mapping, attn: str) -> dict:
        from transformers import DynamicCache, QuantizedCache

        if attn == "kivi2":  # the pipeline's no-press prefill into a 2-bit quantized cache
            caches = {k: QuantizedCache("quanto", model.config, nbits=2) for k in group}
            for cache in caches.values():
                model.model(input_ids=ctx, past_key_values=cache)
            return caches
        fan = fan_out({k: make_press(name, ratio) for k, (name, ratio) in group.items()})
        with fan(model):
            model.model(input_ids=ctx, past_key_values=DynamicCache())
        return fan.caches

    @staticmethod
    def _stats(cache, cfg, context: int, question: int, kept: list[int]) -> dict[str, Any]:
        """What the cache holds after the answer: kept context + question + fed answer tokens
        (``generate_answer`` never feeds its last token); ``full_bytes``: the same uncompressed."""
        kv_heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        fed = cache.get_seq_length(0) - kept[0]  # question + answer tokens fed after prefill
        return {
            "bytes_used": cache_bytes(cache, kv_heads, head_dim),
            "full_bytes": kv_bytes(context + fed, kv_heads, head_dim) * len(kept),
            "context_tokens": context,
            "kept_context_tokens": sum(kept) / len(kept),
            "question_tokens": question,
            "prefill_tokens": context + question,
            "fed_answer_tokens": fed - question,
        }
