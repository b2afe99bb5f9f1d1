#!/usr/bin/env bash
# Issue 6's GPU evaluation in one device command: Qwen2.5-Coder-0.5B-Instruct at 16K and 32K
# tokens, full KV + qevict, rdkv, snapkv, h2o, streaming at 5/10/20% + kivi (one tier: runs
# once), 50 samples per task and length, and kvpress's presses (SnapKV, ExpectedAttention,
# StreamingLLM) at the same kept fractions on the same samples, side by side. From the repo root
# on the GPU machine, after staging (../shared/gpu/) and with .whl/ carried (lark, and
# .whl/kvpress from `bash bench/kvpress_env.sh --target`):
#   bash bench/run_eval_gpu.sh
# Env: OUT (default bench/results/eval-qwen-gpu), LENGTHS, TASKS, SAMPLES, BUDGETS, MINUTES
# (start no sample after this), OURS_PER_GPU / KVPRESS_PER_GPU (processes per GPU; 0 skips),
# PRESSES, KVPRESS_ARGS (extra kvpress_run flags, e.g. --question-in-context), SKIP_INSTALL, SEED_OURS / SEED_KVPRESS (an earlier run's results.jsonl: its finished
# cells are skipped, e.g. bench/results/eval-qwen-gpu-run2/results.jsonl). Rerunning resumes.
# RETURN: a folder that gets only ours.jsonl and kvpress.jsonl (every shard's records, merged or
# not), at the end and on SIGTERM: the device returns 8 files a call, fewer than OUT holds
# (`OUT=$OUT/e RETURN=$OUT`).
#
# Parallelism: a 0.5B model's eager decode is launch-bound (one process leaves the H200 mostly
# idle), so bench/shards.sh runs several shards per GPU, each its own samples (--shard i/N).
# Memory bounds it: GPU run 6 saw ~30-34 GB a process at 32K, and 5 + 3 shards on one H200 ran
# out of memory (579 of 1,241 cells failed); the defaults (3 + 1) fit 140 GB. Each shard's report
# records its peak (meta cuda_peak_mib).
# CPU smoke of the same path:
#   GPUS=2 OURS_PER_GPU=1 KVPRESS_PER_GPU=0 DEVICE=cpu DTYPE=float32 MODEL=smollm2-135m \
#     LENGTHS=300 SAMPLES=2 TASKS=niah_single BUDGETS=10% SKIP_INSTALL=1 OUT=/tmp/smoke \
#     bash bench/run_eval_gpu.sh
set -uo pipefail
if [ -z "${SKIP_INSTALL:-}" ]; then  # the eval modules must be in the installed package
  . bench/gpu_install.sh || exit 1
fi
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
OUT=${OUT:-bench/results/eval-qwen-gpu}
MODEL=${MODEL:-/tmp/models/qwen2.5-0.5b}
model_arg=(--model "$MODEL"); [ -d "$MODEL" ] && model_arg=(--model-path "$MODEL")
common=(--device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --threads 1
        --budgets "${BUDGETS:-5%,10%,20%}" --tasks "${TASKS:-niah_multikey}"
        --lengths "${LENGTHS:-16k,32k}" --samples "${SAMPLES:-50}" --max-minutes "${MINUTES:-8}")
mkdir -p "$OUT"
collect() {  # every record so far, one file per engine (shards' files hold the seed's records too)
  [ -n "${RETURN:-}" ] || return 0
  mkdir -p "$RETURN"
  for e in ours kvpress; do
    local src=("$OUT/$e"/shard-*/results.jsonl)
    [ -f "${src[0]}" ] && sort -u "${src[@]}" > "$RETURN/$e.jsonl"
  done
  return 0
}
trap 'collect; exit 143' TERM
pids=()
# niah_multikey: 4 keyed needles in prose; the question names one, so a policy must keep the
# right needle and not a distractor: harder than the single needle full KV always finds
# (shared/notes/gpu-anchors.md), still answerable by a 0.5B model, and short (32-token cap).
if [ "${OURS_PER_GPU:-3}" -gt 0 ]; then
  SEED_RESULTS=${SEED_OURS:-} PER_GPU=${OURS_PER_GPU:-3} bash bench/shards.sh "$OUT/ours" \
    python3 -P -m tiered_radix eval --engine transformers "${model_arg[@]}" "${common[@]}" \
    --policies full qevict rdkv snapkv h2o streaming kivi --stop-when-answered \
    > "$OUT/ours.log" 2>&1 &
  pids+=($!)
fi
KVPRESS_PER_GPU=${KVPRESS_PER_GPU:-1}
if [ "$KVPRESS_PER_GPU" -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvp .whl/kvpress/*.whl || exit 1
  # kvpress needs transformers < 5.3 (its own, in /tmp/kvp); the merge runs with ours
  SEED_RESULTS=${SEED_KVPRESS:-} MERGE_PYTHONPATH=${PYTHONPATH:-} PYTHONPATH=/tmp/kvp:$PWD \
    PER_GPU=$KVPRESS_PER_GPU \
    bash bench/shards.sh "$OUT/kvpress" \
    python3 -m tiered_radix.eval.kvpress_run --model "$MODEL" --name "$MODEL" "${common[@]}" \
    --presses "${PRESSES:-snapkv,expected,streaming}" ${KVPRESS_ARGS:-} > "$OUT/kvpress.log" 2>&1 &
  pids+=($!)
fi
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
collect
tail -25 "$OUT"/ours.log "$OUT"/kvpress.log 2>/dev/null
dirs=(); for d in "$OUT/ours" "$OUT/kvpress"; do [ -f "$d/results.jsonl" ] && dirs+=("$d"); done
[ ${#dirs[@]} -gt 0 ] && python3 -P -m tiered_radix eval --report-from "${dirs[@]}" --out "$OUT" \
  | tail -45
exit $rc
