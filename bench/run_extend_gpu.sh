#!/usr/bin/env bash
# Issue 19 on the GPU machine, from the repo root, one stage a device call (each under 10 min):
#   STAGE=kernels bash bench/run_extend_gpu.sh   # extend kernel tests + bench/extend_attention.py
#   STAGE=prefill bash bench/run_extend_gpu.sh   # TTFT, plain vs tiered vs tiered_gather (SGLang)
#   STAGE=e2e     bash bench/run_extend_gpu.sh   # qevict end to end, kernel vs gather extend
# SGLang stages need SGLang and Qwen2.5-0.5B staged (bench/README.md, "A GPU session").
set -uo pipefail
. bench/gpu_install.sh || exit 1
OUT=${OUT:-bench/results/extend-gpu}
mkdir -p "$OUT"
case "${STAGE:-kernels}" in
  kernels)
    python3 bench/compile_check.py -k extend 2>&1 | tail -20
    timeout 300 python3 -P -m pytest -q -x -rs tests/kernels/test_extend.py \
      tests/kernels/test_extend_gpu.py 2>&1 | tee "$OUT/pytest.txt" | tail -15
    timeout 240 python3 bench/extend_attention.py ${EXTEND_ARGS:-} --out "$OUT" 2>&1 | tail -45
    ;;
  prefill)
    timeout 560 python3 bench/sglang_decode.py --prefill --kinds ${KINDS:-plain tiered} \
      --out "$OUT" ${PREFILL_ARGS:-} 2>&1 | grep -v Warning | tail -30
    ;;
  e2e)
    export TR_MODEL_PATH=${TR_MODEL_PATH:-/tmp/models/qwen2.5-0.5b} TR_E2E_POLICIES=${TR_E2E_POLICIES:-qevict}
    for path in kernel sdpa; do
      mkdir -p "$OUT/e2e-$path"
      TR_E2E_ARGS="--kv-extend $path" TR_E2E_OUT="$OUT/e2e-$path" timeout 270 python3 -P -m pytest -q -x -rs tests/gpu 2>&1 | tail -8
    done
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for f in sorted((out / "e2e-kernel").glob("*.json")):
    g = out / "e2e-sdpa" / f.name
    if g.exists():
        a, b = json.loads(f.read_text()), json.loads(g.read_text())
        ans = [[r["answer"] for r in x["turns"]] + [x["needle"]["answer"]] for x in (a, b)]
        paths = [x["stats"].get("extend") for x in (a, b)]
        print(f.name, paths, "answers identical" if ans[0] == ans[1] else f"DIFFER: {ans}")
PY
    ;;
esac
