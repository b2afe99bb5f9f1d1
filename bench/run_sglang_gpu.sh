#!/usr/bin/env bash
# One device call for the SGLang integration (issue 5), after staging SGLang and Qwen2.5-0.5B
# (python3 ../shared/gpu/stage.py --model qwen2.5-0.5b). From the repo root on the GPU machine:
#   bash bench/run_sglang_gpu.sh
# Env: E2E_S / BENCH_S time limits, TR_E2E_POLICIES (default qevict,full,kivi), TR_SRC (what
# to install: default the working tree; a wheel path to pin a build).
set -uo pipefail
. bench/gpu_install.sh || exit 1
OUT=${OUT:-bench/results}
mkdir -p "$OUT/sglang-e2e"
export TR_MODEL_PATH=${TR_MODEL_PATH:-/tmp/models/qwen2.5-0.5b}
export TR_E2E_POLICIES=${TR_E2E_POLICIES:-qevict,full,kivi} TR_E2E_OUT="$OUT/sglang-e2e"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/sglang-e2e/gpu.txt"
python3 -c "import importlib.metadata as m; print([e.name for e in m.entry_points(group='sglang.srt.plugins')])"
timeout ${E2E_S:-300} python3 -P -m pytest -q -x -rs tests/gpu 2>&1 | tee "$OUT/sglang-e2e/pytest.txt" | tail -30
for f in "$OUT"/sglang-e2e/*.json; do echo "== $f"; head -c 1500 "$f"; echo; done
timeout ${BENCH_S:-240} python3 bench/sglang_decode.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -30
