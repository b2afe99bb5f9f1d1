#!/usr/bin/env bash
# kvpress (NVIDIA) in its own environment: kvpress 0.5.5 needs transformers>=4.56,<5.3, while
# tiered-radix's main env (and SGLang 0.5.17) pins transformers 5.12.1. See docs/kvpress.md.
#
#   bash bench/kvpress_env.sh [VENV]     CPU venv (default /work/venv-kvpress), torch 2.13.0 CPU
#   bash bench/kvpress_env.sh --target   wheels for the GPU machine (cp312, manylinux x86_64)
#                                        into .whl/kvpress/ (torch excluded: the image has it)
#
# On the GPU machine, carry .whl/kvpress and run:
#   pip install --no-index --no-deps --target /tmp/kvp .whl/kvpress/*.whl
#   PYTHONPATH=/tmp/kvp:$PWD python3 -m tiered_radix.eval.kvpress_run ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The set that resolved together (2026-12; recorded by `pip freeze` into the venv's
# kvpress-freeze.txt). transformers 5.2.0 is the only 5.2.x release.
KVPRESS="kvpress==0.5.5"
TRANSFORMERS="transformers==5.2.0"
QUANTO="optimum-quanto==0.2.7"  # transformers' QuantizedCache backend (the KIVI-style row)

if [[ "${1:-}" == "--target" ]]; then
    # Only what `import kvpress` and the run need on top of the GPU image (torch, numpy,
    # requests, safetensors, pyyaml, tqdm). kvpress imports `datasets` (hub calibration presses
    # only); it is NOT carried (pyarrow alone is ~45 MB of the 64 MiB a transfer may hold):
    # kvpress_run puts an offline placeholder in its place when it is missing.
    DEST="$ROOT/.whl/kvpress"
    mkdir -p "$DEST"
    # Versions: those the CPU venv resolved (its kvpress-freeze.txt). fire 0.6.0 (kvpress's pin)
    # ships no wheel; it is only imported by a calibration script, so it is left out too.
    SPECS=("$KVPRESS" "$TRANSFORMERS" "$QUANTO" ninja==1.13.2 tokenizers==0.22.2
           huggingface-hub==1.33.0 hf-xet==1.8.0 safetensors==0.8.0 regex==2026.11.19
           typer-slim==0.24.0 typer==0.29.2 click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0
           mdurl==0.1.2 pygments==2.21.0 shellingham==1.5.4 annotated-doc==0.0.7
           filelock==4.3.1 fsspec==2026.9.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0
           anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1 typing-extensions==4.16.0
           packaging==26.4 cachetools==5.5.2 lark==1.3.1 pyyaml==6.0.4 tqdm==4.70.1)
    python3 -m pip download --no-deps --only-binary=:all: --disable-pip-version-check -q \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$DEST" "${SPECS[@]}"
    du -sh "$DEST"
    exit 0
fi

VENV="${1:-/work/venv-kvpress}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 "$KVPRESS" "$TRANSFORMERS" "$QUANTO" \
    lark pyyaml tqdm numpy pytest
"$VENV/bin/pip" install -q --no-deps -e "$ROOT"
"$VENV/bin/pip" freeze > "$VENV/kvpress-freeze.txt"
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('kvpress', \
transformers.__version__, torch.__version__)"
