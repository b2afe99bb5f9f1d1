#!/usr/bin/env bash
# One device block: GPU tests at full size, then every benchmark, results under $OUT.
# Run on the GPU machine after staging (../shared/gpu/README.md), from the repo root:
#   bash bench/run_gpu.sh [quick]     (SKIP_TESTS=1: the benchmarks only)
set -uo pipefail
# Our package, installed (not on the path as source: tiered_radix.kernels is a package-dir mapping)
. bench/gpu_install.sh || exit 1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
mode=${1:-full}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
[ -n "${SKIP_TESTS:-}" ] || timeout ${TEST_S:-420} python3 -P -m pytest -q -rf tests/kernels tests/engine/test_store.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
quick=(); [ "$mode" = quick ] && quick=(--quick)
timeout ${DECODE_S:-330} python3 bench/decode_attention.py --out "$OUT" "${quick[@]}" 2>&1 | tail -60
[ -n "${SKIP_QUANT:-}" ] || timeout 60 python3 bench/quant_pack.py --out "$OUT" 2>&1 | tail -20
timeout ${ROUTE_S:-90} python3 bench/routing_step.py --device cuda --count --out "$OUT" 2>&1 | tail -10
