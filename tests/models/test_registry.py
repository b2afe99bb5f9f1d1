"""Model registry consistency and the fetch error paths (no network except the slow test)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import re
import sys

import pytest

from tiered_radix.models import paths, registry
from tiered_radix.models.registry import MODELS, ModelError, get_spec

# the package re-exports the function `fetch`, which shadows the submodule attribute
fetch_mod = importlib.import_module("tiered_radix.models.fetch")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registry_entries_are_consistent(name):
    spec = MODELS[name]
    assert spec.name == name
    assert spec.packages and all(
        re.fullmatch(r"[a-z0-9_.-]+==[0-9][\w.]*", p) for p in spec.packages
    )
    assert spec.parts and len(set(spec.parts)) == len(spec.parts)
    assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
    assert spec.size > 1_000_000 and spec.gguf_name.endswith(".gguf")
    assert spec.n_heads_q % spec.n_heads_kv == 0
    assert spec.hidden == spec.n_heads_q * spec.head_dim
    assert spec.export_dtype in ("bfloat16", "float16", "float32")


def test_known_sizes_from_notes():
    assert MODELS["smollm2-135m"].size == 98_362_432
    assert MODELS["qwen2.5-coder-0.5b"].size == 491_400_064
    assert len(MODELS["qwen2.5-coder-0.5b"].parts) == 6


def test_unknown_name_lists_names_and_suggests():
    with pytest.raises(ModelError) as e:
        get_spec("smolm2-135m")
    msg = str(e.value)
    assert "Did you mean 'smollm2-135m'" in msg
    assert all(n in msg for n in MODELS)
    with pytest.raises(ModelError, match="Valid names") as e:
        get_spec("zzzz")
    assert "Did you mean" not in str(e.value)


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    assert paths.packages_dir("m") == tmp_path / "pkgs" / "m"
    assert paths.model_dir("m") == tmp_path / "models" / "m"
    monkeypatch.delenv(paths.CACHE_ENV)
    assert paths.cache_root().name == "tiered-radix"


def _fake_spec(data: bytes, n_parts: int, **kw) -> registry.ModelSpec:
    base = MODELS["smollm2-135m"]
    parts = tuple(f"fake_part{i}/data.bin" for i in range(n_parts))
    return dataclasses.replace(
        base, name="fake", packages=("fake-pkg==1.0",), parts=parts, gguf_name="fake.gguf",
        size=len(data), sha256=hashlib.sha256(data).hexdigest(), **kw,
    )  # fmt: skip


def _place_parts(pkg_dir, spec, data: bytes) -> None:
    cuts = [round(i * len(data) / len(spec.parts)) for i in range(len(spec.parts) + 1)]
    for rel, a, b in zip(spec.parts, cuts, cuts[1:], strict=False):
        (pkg_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg_dir / rel).write_bytes(data[a:b])


def test_sha256_matches_known_vector(tmp_path):
    f = tmp_path / "abc"
    f.write_bytes(b"abc")
    known = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert fetch_mod.sha256_file(f) == known


def test_assembles_multi_part_and_verifies(tmp_path):
    data = bytes(range(256)) * 1000 + b"tail"
    spec = _fake_spec(data, 3)
    _place_parts(tmp_path, spec, data)
    out = fetch_mod.ensure_gguf(spec, tmp_path, progress=False)
    assert out == tmp_path / "fake.gguf" and out.read_bytes() == data
    assert fetch_mod.ensure_gguf(spec, tmp_path, progress=False) == out  # verified, no rebuild


def test_sha_mismatch_says_expected_got_and_fix(tmp_path):
    data = b"GGUF" + bytes(range(200)) * 50
    spec = dataclasses.replace(_fake_spec(data, 2), sha256="0" * 64)
    _place_parts(tmp_path, spec, data)
    with pytest.raises(ModelError) as e:
        fetch_mod.ensure_gguf(spec, tmp_path, progress=False)
    msg = str(e.value)
    assert "corrupt" in msg and "0" * 64 in msg and hashlib.sha256(data).hexdigest() in msg
    assert f"delete {tmp_path}" in msg


def test_size_mismatch(tmp_path):
    data = b"GGUF" + bytes(range(100)) * 7
    spec = _fake_spec(data, 1)
    _place_parts(tmp_path, spec, data + b"x")
    with pytest.raises(ModelError, match="corrupt: expected 704 bytes, got 705; delete"):
        fetch_mod.ensure_gguf(spec, tmp_path, progress=False)


def test_pip_failure_is_reported(tmp_path, monkeypatch):
    def fake_cmd(packages, target):
        return [
            sys.executable,
            "-c",
            "import sys; sys.stderr.write('No matching dist'); sys.exit(1)",
        ]

    monkeypatch.setattr(fetch_mod, "pip_command", fake_cmd)
    spec = _fake_spec(b"GGUF0000", 1)
    with pytest.raises(ModelError, match=r"pip could not install fake-pkg==1.0 \(exit 1\)") as e:
        fetch_mod.ensure_gguf(spec, tmp_path / "pkgs", progress=False)
    assert "No matching dist" in str(e.value)


def test_pip_command_never_builds_or_pulls_deps(tmp_path):
    cmd = fetch_mod.pip_command(("a==1",), tmp_path)
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and str(tmp_path) in cmd


def test_fetch_skips_work_when_export_verifies(tmp_path, monkeypatch):
    spec = _fake_spec(b"GGUF1234", 1)
    monkeypatch.setitem(registry.MODELS, "fake", spec)
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"12345")
    marker = {"name": "fake", "gguf_sha256": spec.sha256, "files": {"model.safetensors": 5}}
    (out / fetch_mod.MARKER).write_text(json.dumps(marker))

    def boom(*a, **k):
        raise AssertionError("fetch did work although the export verifies")

    monkeypatch.setattr(fetch_mod, "ensure_gguf", boom)
    assert fetch_mod.fetch("fake", dest=out, progress=False) == out
    (out / "model.safetensors").write_bytes(b"1234")  # truncated: no longer verifies
    assert not fetch_mod.export_verifies(out, spec)
    with pytest.raises(AssertionError, match="did work"):
        fetch_mod.fetch("fake", dest=out, progress=False)


def test_missing_converter_packages(monkeypatch, tmp_path):
    real = fetch_mod.importlib.util.find_spec
    monkeypatch.setattr(
        fetch_mod.importlib.util, "find_spec", lambda m: None if m == "gguf" else real(m)
    )
    with pytest.raises(ModelError, match=r"needs [a-z, ]*gguf[a-z, ]*: pip install"):
        fetch_mod.export_hf(_fake_spec(b"x", 1), tmp_path / "a.gguf", tmp_path / "out")


@pytest.mark.slow
def test_real_fetch_smollm2():
    try:
        folder = fetch_mod.fetch("smollm2-135m", progress=False)
    except ModelError as e:
        if "pip could not install" in str(e):
            pytest.skip(f"package index unreachable (offline?): {e}")
        raise
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert cfg["rope_theta"] == 100_000.0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
