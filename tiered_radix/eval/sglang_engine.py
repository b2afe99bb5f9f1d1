"""``tiered-radix eval --engine sglang``: the samples served by ``sglang.Engine`` with the SGLang
plugin (``kv_policy=``), so a policy is measured in the server it ships for.

Starting an engine costs tens of seconds, so this engine answers a whole configuration at once
(:meth:`SGLangEngine.answer_batch`: the runner goes configuration by configuration, see
``runner.run_grid``): one ``sglang.Engine`` per (policy, budget), every sample's turn ``i`` in
one batched ``generate`` call, greedy, and the engine shut down before the next configuration.
Multi-turn samples send each turn's whole conversation again; SGLang's radix cache (the tiered
one under a policy) reuses the earlier turns. The full-KV reference is plain SGLang: no
``kv_policy``.

Per-cell KV bytes are not reported (the pool's counters are global, not per request): the
report's bytes column stays empty for this engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..policy import Policy
from .engines import EngineError, Reply, conversation_ids, model_folder, model_window


class SGLangEngine:
    """``model``: a Hugging Face folder (or a registry name, fetched offline).
    ``engine_kwargs`` go to every ``sglang.Engine`` (e.g. ``mem_fraction_static``;
    ``attention_backend`` to the full-KV reference only: under a policy the plugin picks); the
    tokenizer renders prompts with the model's chat template, as the transformers engine does.
    """

    name = "sglang"

    def __init__(
        self, model: str, *, engine_kwargs: dict[str, Any] | None = None, tokenizer=None
    ) -> None:
        try:
            import sglang
        except ImportError as e:
            raise EngineError(
                f"the sglang engine needs SGLang 0.5.17 and a GPU ({e}); "
                "pip install 'tiered-radix[sglang]', or use --engine transformers"
            ) from e
        folder = model_folder(model)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
        self._sglang, self.model, self.folder = sglang, model, str(folder)
        self.tokenizer, self.engine_kwargs = tokenizer, dict(engine_kwargs or {})
        self.context_window = self.engine_kwargs.get("context_length") or model_window(folder)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def engine_args(self, policy: Policy, label: str) -> dict[str, Any]:
        """``sglang.Engine`` keyword arguments for one configuration.

        Raises:
            EngineError: a budget other than a fraction (the plugin's ``kv_budget`` takes
                ``10%``, ``2 GiB`` or ``4096 tokens``, the runner's labels only the first).
        """
        kw = {"model_path": self.folder, **self.engine_kwargs}
        if policy.name == "full":
            return kw
        kw.pop("attention_backend", None)  # the plugin picks its own (tiered_triton)
        if not label.endswith("%"):
            raise EngineError(f"the sglang engine takes fraction budgets (10%), got {label!r}")
        src = Path(policy.source)
        return kw | {"kv_policy": str(src) if src.is_file() else policy.name, "kv_budget": label}

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation rendered for generation (:func:`~.engines.conversation_ids`)."""
        return conversation_ids(self.tokenizer, messages)

    def answer_batch(
        self,
        policy: Policy,
        label: str,
        conversations: Sequence[Sequence[str]],
        max_new: Sequence[int],
    ) -> list[list[Reply]] | Exception:
        """Every conversation's replies under one configuration, or the exception that stopped
        the configuration (the runner records it in each of its cells)."""
        try:
            engine = self._sglang.Engine(**self.engine_args(policy, label))
        except Exception as e:  # noqa: BLE001  (a policy the server refuses: recorded per cell)
            return e
        history: list[list[dict[str, str]]] = [[] for _ in conversations]
        replies: list[list[Reply]] = [[] for _ in conversations]
        try:
            for turn in range(max(map(len, conversations), default=0)):
                live = [i for i, c in enumerate(conversations) if turn < len(c)]
                for i in live:
                    history[i].append({"role": "user", "content": conversations[i][turn]})
                outs = engine.generate(
                    input_ids=[self.prompt_ids(history[i]) for i in live],
                    sampling_params=[
                        {"max_new_tokens": max_new[i], "temperature": 0.0} for i in live
                    ],
                )
                for i, out in zip(live, outs, strict=True):
                    text = out["text"].strip()
                    history[i].append({"role": "assistant", "content": text})
                    meta = out.get("meta_info", {})
                    stats = {k: meta[k] for k in ("cached_tokens", "prompt_tokens") if k in meta}
                    replies[i].append(Reply(text, stats))
        except Exception as e:  # noqa: BLE001
            return e
        finally:
            engine.shutdown()
        return replies
