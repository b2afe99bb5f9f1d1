"""Inference engines the evaluation drives, behind one small interface.

An engine generates greedily under a compiled :class:`Policy` (whose budget the runner has
already set) and returns the text plus flat, JSON-ready statistics. Only the transformers
engine runs on CPU; the SGLang engine (:mod:`.sglang_engine`) serves the same grid on a GPU.

An engine may also offer a shared prefill (:class:`SharedPrefill`): ``prefill`` once per
single-turn sample, then ``decode`` it under each (policy, budget); the runner uses it when the
engine has it. The transformers engine's version is in :mod:`.prefill` / :mod:`.seeded`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..policy import Policy


class EngineError(RuntimeError):
    """An engine cannot be built (missing package, model or adapter); the message says why."""


@dataclasses.dataclass(frozen=True)
class Reply:
    """One generated answer. ``stats``: flat ``{name: number | str}``, e.g. ``bytes_used``,
    ``full_bytes``, ``budget_bytes``, ``occupancy.<tier>``, ``fmm``, ``lir``, ``churn``."""

    text: str
    stats: Mapping[str, Any]


class Engine(Protocol):
    name: str  # "transformers"
    model: str  # the model's registry name or path
    context_window: int | None  # the model's most tokens (prompt + answer); None: unbounded

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` without special tokens (the tokenizer that generation uses)."""

    def generate(self, prompt: str, policy: Policy, max_new_tokens: int) -> Reply:
        """Answer one user message from an empty cache."""

    def chat(self, turns: Sequence[str], policy: Policy, max_new_tokens: int) -> list[Reply]:
        """Answer ``turns`` in one session (later turns reuse the cached prefix)."""


def model_window(folder: str | Path) -> int | None:
    """The context window a model folder's ``config.json`` declares
    (``max_position_embeddings``), or None when it says nothing."""
    import json

    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


class SharedPrefill(Protocol):
    """An engine that can decode many policies from one prompt prefill."""

    def prefill(self, prompt: str, policies: Sequence[Policy]) -> Any:
        """Prefill ``prompt`` once, computing every signal one of ``policies`` reads."""

    def decode(
        self, prefill: Any, policy: Policy, max_new_tokens: int, answers: Sequence[str] = ()
    ) -> Reply:
        """Answer from ``prefill`` under ``policy``; with ``answers``, the engine may stop as
        soon as the text contains every one (the string-match score cannot change after)."""


def flatten_stats(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Numbers and strings of a stats object (dataclass, mapping or plain object), flattened to
    ``"a.b"`` keys; numeric arrays and tensors become their mean; anything else is dropped."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    elif not isinstance(obj, Mapping) and hasattr(obj, "__dict__"):
        obj = vars(obj)
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten_stats(v, f"{prefix}{k}."))
        return out
    key = prefix[:-1]
    if isinstance(obj, bool | int | str) or obj is None:
        return {key: obj}
    if isinstance(obj, float):
        return {key: obj if math.isfinite(obj) else None}
    try:  # numpy / torch scalars and arrays, lists of numbers
        import numpy as np

        arr = np.asarray(obj.detach().cpu() if hasattr(obj, "detach") else obj, dtype=np.float64)
    except (TypeError, ValueError):
        return {}
    if arr.size == 0:
        return {}
    value = float(arr.mean())
    return {key: value if math.isfinite(value) else None}


class TransformersEngine:
    """The Hugging Face transformers adapter (``tiered_radix.adapters.transformers``), on CPU in
    float32 unless told otherwise. ``model``: a registry name (fetched offline) or a folder.

    ``attention``: ``"exact"`` (the adapter's own attention: a shared-prefill run equals an
    independent one token for token) or ``"fast"`` (sdpa prefill, batched-matmul decode; the
    same math up to rounding); default fast on CUDA, exact elsewhere. ``diagnostics``: measure
    FMM/LIR/churn in shared-prefill runs. ``variant`` names the numerics in cell keys.
    """

    name = "transformers"

    def __init__(
        self,
        model: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str | None = None,
        diagnostics: bool = True,
        prefill_chunk: int | None = None,
    ) -> None:
        if attention not in (None, "exact", "fast"):
            raise EngineError(f"attention must be 'exact' or 'fast', got {attention!r}")
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from ..adapters import transformers as adapter
        except ImportError as e:
            raise EngineError(
                f"the transformers engine needs the 'models' extra and the transformers "
                f"adapter ({e}); pip install 'tiered-radix[models]'"
            ) from e
        folder = model_folder(model)
        self.model, self._adapter = model, adapter
        self.adapter_hash = _source_hash(Path(adapter.__file__).parent)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        self.hf_model.to(device).eval()
        self.context_window = model_window(folder)
        self.fast = (attention or ("fast" if str(device).startswith("cuda") else "exact")) == "fast"
        self.variant = "fast" if self.fast else ""
        self.prefill_chunk = prefill_chunk  # chunked prompts (as a server): no shared prefill
        if prefill_chunk:
            self.variant += f"chunk{prefill_chunk}"
        self.diagnostics = diagnostics
        self._float_keys = None
        self.eos = adapter.stop_ids(self.hf_model, self.tokenizer)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt: str, policy: Policy, max_new_tokens: int) -> Reply:
        text, stats = self._adapter.generate(
            self.hf_model, self.tokenizer, prompt, policy, max_new_tokens=max_new_tokens,
            prefill_chunk=self.prefill_chunk,
        )  # fmt: skip
        return Reply(text, _turn_stats(stats))

    def chat(self, turns: Sequence[str], policy: Policy, max_new_tokens: int) -> list[Reply]:
        session = self._adapter.ChatSession(
            self.hf_model, self.tokenizer, policy, max_new_tokens=max_new_tokens,
            prefill_chunk=self.prefill_chunk,
        )  # fmt: skip
        replies = []
        for user in turns:
            turn = session.ask(user)
            replies.append(Reply(turn.text, _turn_stats(turn)))
        return replies

    def prompt_ids(self, prompt: str) -> list[int]:
        """The first turn's ids exactly as ``ChatSession.ask`` builds them."""
        return conversation_ids(self.tokenizer, [{"role": "user", "content": prompt}])

    def prefill(self, prompt: str, policies: Sequence[Policy]):
        from ..engine.signals import policy_reads
        from .prefill import PREFILL_SIGNALS, capture

        need = frozenset(n for p in policies for n in policy_reads(p)) & PREFILL_SIGNALS
        return capture(self.hf_model, self.prompt_ids(prompt), need, fast=self.fast)

    def decode(
        self, prefill, policy: Policy, max_new_tokens: int, answers: Sequence[str] = ()
    ) -> Reply:
        from .probes import DecodeProbe
        from .scoring import score
        from .seeded import run_seeded

        tok = self.tokenizer

        def done(ids: list[int]) -> bool:
            return bool(answers) and score(tok.decode(ids, skip_special_tokens=True), answers) == 1

        probe = None
        if self.diagnostics:  # float32 prompt keys, made once per prefill
            if self._float_keys is None or self._float_keys[0] is not prefill:
                self._float_keys = (prefill, [k.float() for k in prefill.keys])
            probe = DecodeProbe(self._float_keys[1], max_new_tokens + 1)
        ids, _, stats = run_seeded(
            self.hf_model, prefill, policy, max_new_tokens, self.eos,
            fast=self.fast, probe=probe, done=done if answers else None,
        )  # fmt: skip
        return Reply(tok.decode(ids, skip_special_tokens=True).strip(), stats)


def conversation_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` rendered for generation: the chat template, or without one plain
    ``User:``/``Assistant:`` lines (a single user turn: as ``ChatSession`` renders it)."""
    if not tokenizer.chat_template:
        text = "".join(
            f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}\n" for m in messages
        )
        return tokenizer(text + "Assistant:", add_special_tokens=True)["input_ids"]
    x = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def model_folder(model: str) -> Path:
    """A registry model's folder (fetched offline on first use), or ``model`` as a folder.

    Raises:
        EngineError: neither.
    """
    from ..models import MODELS, fetch

    folder = Path(fetch(model, progress=False)) if model in MODELS else Path(model)
    if not folder.is_dir():
        raise EngineError(
            f"'{model}' is neither a registry model ({', '.join(sorted(MODELS))}) "
            "nor a model folder"
        )
    return folder


def _source_hash(folder: Path) -> str:
    """Short hash of the adapter's sources, so a report says which adapter produced it."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _turn_stats(turn: Any) -> dict[str, Any]:
    stats = flatten_stats(turn)
    for key in ("text", "ids"):  # the answer itself, not statistics
        stats.pop(key, None)
    return stats
