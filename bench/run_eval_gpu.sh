#!/usr/bin/env bash
# Issue 6's GPU evaluation in one device command (<= 9 min): Qwen2.5-Coder-0.5B-Instruct at 16K and
# 32K tokens, full KV + qevict, rdkv, snapkv, h2o, streaming at 5/10/20% + kivi (one tier: runs once),
# 50 samples per task and length, results/report/plots under $OUT. From the repo root:
#   bash bench/run_eval_gpu.sh
# CPU smoke of the same path (ran here: 7 cells in 86 s on 2 busy cores, tables + plots written):
#   DEVICE=cpu DTYPE=float32 MODEL=smollm2-135m LENGTHS=600 SAMPLES=1 TASKS=niah_single \
#     BUDGETS=10% MINUTES=3 SKIP_INSTALL=1 OUT=/tmp/smoke bash bench/run_eval_gpu.sh
#
# Time estimate (not measured on the GPU: no device was lent to this step). Per sample and length:
# one prefill (sdpa + the Triton column-mass kernel for rdkv; ~0.3-0.6 s at 32K), then 17
# configurations each seeded from it (append + one routing step, ~20-50 ms) and decoded greedily.
# A decode step costs one eager HF forward (~10-15 ms on 24 layers, launch-bound) plus the tier
# engine per layer (append, cached view, 2 matmuls, observe; h2o/streaming also route and rebuild
# views every step): ~25-40 ms. With --stop-when-answered a correct answer ends after ~15-20
# tokens, a wrong one runs to the task cap (niah_multikey: 32). So ~0.5-1 s per configuration,
# ~9-17 s per sample: 8 minutes hold ~30-55 samples in total, i.e. 15-25 per length for ONE task,
# short of 50. --max-minutes 8 keeps the command inside its limit either way (samples round-robin
# over lengths, so both lengths get the same n) and the report states n and the 95% CIs. CPU
# measurements behind this (smollm2-135m, 1 thread, 1K tokens, 7 configs, 12 tokens): adapter
# per configuration 145 s; shared prefill, exact attention 55 s; shared + fast 43 s
# (docs/evaluation.md).
set -uo pipefail
if [ -z "${SKIP_INSTALL:-}" ]; then  # the new eval modules must be in the installed package
  . bench/gpu_install.sh || exit 1
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/eval-qwen-gpu}
MODEL=${MODEL:-/tmp/models/qwen2.5-0.5b}
model_arg=(--model "$MODEL"); [ -d "$MODEL" ] && model_arg=(--model-path "$MODEL")
mkdir -p "$OUT"
# niah_multikey: 4 keyed needles in prose; the question names one, so a policy must keep the
# right needle and not a distractor: harder than the single needle full KV always finds
# (shared/notes/gpu-anchors.md), still answerable by a 0.5B model, and short (32-token cap).
python3 -m tiered_radix eval --engine transformers "${model_arg[@]}" \
  --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --threads "${THREADS:-1}" \
  --policies full qevict rdkv snapkv h2o streaming kivi --budgets "${BUDGETS:-5%,10%,20%}" \
  --tasks "${TASKS:-niah_multikey}" --lengths "${LENGTHS:-16k,32k}" --samples "${SAMPLES:-50}" \
  --stop-when-answered --max-minutes "${MINUTES:-8}" --out "$OUT" 2>&1 | grep -v '^eval:' | tail -60
exit "${PIPESTATUS[0]}"
