#!/usr/bin/env bash
# Issue 18 on one H200: does qevict hold hard retrieval in the server? SGLang engine (chunked
# prefill, 2,048 tokens a chunk, as issue 18's table), Qwen2.5-0.5B at 16K, tasks distractor,
# niah_multikey and niah_multivalue, SAMPLES (default 12) each, greedy. Rows (one sglang.Engine
# each, ~60-90 s to start): full (plain SGLang), full with an FP8 KV cache (kv_cache_dtype=
# fp8_e4m3), qevict as shipped before issue 18 (examples/qevict_v1.yaml: routes after every
# chunk and may evict before the question is read), qevict as shipped now, rdkv. Expected
# total: ~8 minutes. From the repo root on the GPU machine after staging (../shared/gpu/), with
# .whl/ carried (lark):
#   bash bench/run_issue18_gpu.sh
# Env: MODEL (default /tmp/models/qwen2.5-0.5b), OUT (default bench/results/issue18-gpu),
# SAMPLES, LENGTHS (default 16k), MINUTES (start no new configuration after this; default 9),
# EXTRA_POLICIES (more rows, ~1.5-2 min each, e.g. "examples/ablation/defer.yaml
# examples/ablation/rdkv_defer.yaml": deferral without the new score, and rdkv deferred),
# POLICIES (the rows besides full; default "examples/qevict_v1.yaml qevict rdkv"), FP8=0 (skip
# the FP8 row), TASKS (default distractor,niah_multikey,niah_multivalue). A second call with
# the same OUT reuses the full row's cells.
set -uo pipefail
. bench/gpu_install.sh || exit 1
MODEL=${MODEL:-/tmp/models/qwen2.5-0.5b}
OUT=${OUT:-bench/results/issue18-gpu}
common=(--engine sglang --model-path "$MODEL" --tasks "${TASKS:-distractor,niah_multikey,niah_multivalue}"
        --lengths "${LENGTHS:-16k}" --samples "${SAMPLES:-12}" --budgets 10%
        --engine-arg attention_backend=triton --max-minutes "${MINUTES:-9}")
mkdir -p "$OUT"
# full, qevict v1, qevict, rdkv (the runner goes configuration by configuration)
python3 -P -m tiered_radix eval "${common[@]}" \
  --policies ${POLICIES:-examples/qevict_v1.yaml qevict rdkv} ${EXTRA_POLICIES:-} \
  --out "$OUT/policies" >> "$OUT/policies.log" 2>&1
# full KV at FP8 (a separate folder: its cells would share the full row's keys)
if [ "${FP8:-1}" != 0 ]; then
  python3 -P -m tiered_radix eval "${common[@]}" --policies full \
    --engine-arg kv_cache_dtype=fp8_e4m3 --out "$OUT/fp8" > "$OUT/fp8.log" 2>&1
fi
tail -n 30 "$OUT/policies/report.md" "$OUT/fp8/report.md" 2>/dev/null
