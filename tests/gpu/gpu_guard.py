"""What every test module here needs, checked when it is collected: a CUDA GPU, SGLang 0.5.17
and a Hugging Face model folder in ``$TR_MODEL_PATH``. Without them the module is skipped with
the reason (on CPU machines and in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository


def model_or_skip() -> str:
    """``$TR_MODEL_PATH``, or skip the calling module (call it at module level)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the GPU machine)", allow_module_level=True)
    pytest.importorskip("sglang", reason="needs SGLang 0.5.17")
    model = os.environ.get("TR_MODEL_PATH", "")
    if not Path(model, "config.json").exists():
        pytest.skip("set TR_MODEL_PATH to a Hugging Face model folder", allow_module_level=True)
    return model
