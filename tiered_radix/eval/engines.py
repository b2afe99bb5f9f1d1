"""Inference engines the evaluation drives, behind one small interface.

An engine generates greedily under a compiled :class:`Policy` (whose budget the runner has
already set) and returns the text plus flat, JSON-ready statistics. Only the transformers
engine exists; SGLang is refused by the CLI until its adapter lands.
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

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` without special tokens (the tokenizer that generation uses)."""

    def generate(self, prompt: str, policy: Policy, max_new_tokens: int) -> Reply:
        """Answer one user message from an empty cache."""

    def chat(self, turns: Sequence[str], policy: Policy, max_new_tokens: int) -> list[Reply]:
        """Answer ``turns`` in one session (later turns reuse the cached prefix)."""


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
    float32 unless told otherwise. ``model``: a registry name (fetched offline) or a folder."""

    name = "transformers"

    def __init__(self, model: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from ..adapters import transformers as adapter
        except ImportError as e:
            raise EngineError(
                f"the transformers engine needs the 'models' extra and the transformers "
                f"adapter ({e}); pip install 'tiered-radix[models]'"
            ) from e
        from ..models import MODELS, fetch

        folder = fetch(model, progress=False) if model in MODELS else Path(model)
        if not Path(folder).is_dir():
            raise EngineError(
                f"'{model}' is neither a registry model ({', '.join(sorted(MODELS))}) "
                "nor a model folder"
            )
        self.model, self._adapter = model, adapter
        self.adapter_hash = _source_hash(Path(adapter.__file__).parent)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        self.hf_model.to(device).eval()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt: str, policy: Policy, max_new_tokens: int) -> Reply:
        text, stats = self._adapter.generate(
            self.hf_model, self.tokenizer, prompt, policy, max_new_tokens=max_new_tokens
        )
        return Reply(text, _turn_stats(stats))

    def chat(self, turns: Sequence[str], policy: Policy, max_new_tokens: int) -> list[Reply]:
        session = self._adapter.ChatSession(
            self.hf_model, self.tokenizer, policy, max_new_tokens=max_new_tokens
        )
        replies = []
        for user in turns:
            turn = session.ask(user)
            replies.append(Reply(turn.text, _turn_stats(turn)))
        return replies


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
