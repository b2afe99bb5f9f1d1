#!/usr/bin/env bash
# Run one evaluation command as N shards in parallel, PER_GPU processes on each GPU, then merge.
# A 0.5B model's eager decode is launch-bound: one process leaves the GPU mostly idle, so several
# per GPU multiply the samples an hour. Each shard gets `--shard i/N --out OUT/shard-i` and its
# own CUDA_VISIBLE_DEVICES and log; the merged report goes to OUT.
#   PER_GPU=4 bash bench/shards.sh OUT python3 -P -m tiered_radix eval --device cuda ...
#   PER_GPU=4 bash bench/shards.sh OUT python3 -m tiered_radix.eval.kvpress_run --device cuda ...
# MERGE_PYTHONPATH: the merge's PYTHONPATH when the shards' differs (kvpress's transformers).
# SEED_RESULTS: a results.jsonl of an earlier run (another machine, another shard count) copied
# into each new shard folder, so finished cells are skipped (they match by cell key).
# Exit: 1 if a shard failed (its log tail is printed), else the merge's exit code.
set -uo pipefail
OUT=$1; shift
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$GPUS" -ge 1 ] || { echo "shards.sh: no GPU (set GPUS=)" >&2; exit 2; }
N=$((GPUS * ${PER_GPU:-1}))
mkdir -p "$OUT"
pids=()
for ((i = 0; i < N; i++)); do
  if [ -n "${SEED_RESULTS:-}" ] && [ ! -f "$OUT/shard-$i/results.jsonl" ]; then
    mkdir -p "$OUT/shard-$i" && cp "$SEED_RESULTS" "$OUT/shard-$i/results.jsonl"
  fi
  CUDA_VISIBLE_DEVICES=$((i % GPUS)) "$@" --shard "$i/$N" --out "$OUT/shard-$i" \
    > "$OUT/shard-$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((i = 0; i < N; i++)); do
  if ! wait "${pids[$i]}"; then
    echo "== shard $i failed:" >&2; tail -5 "$OUT/shard-$i.log" >&2; failed=1
  fi
done
dirs=()
for ((i = 0; i < N; i++)); do [ -f "$OUT/shard-$i/results.jsonl" ] && dirs+=("$OUT/shard-$i"); done
[ ${#dirs[@]} -gt 0 ] || { echo "shards.sh: no shard wrote results" >&2; exit 1; }
PYTHONPATH="${MERGE_PYTHONPATH:-${PYTHONPATH:-}}" python3 -P -m tiered_radix eval --report-from "${dirs[@]}" \
  --out "$OUT" | tail -40
rc=${PIPESTATUS[0]}
[ $failed = 0 ] || exit 1
exit "$rc"
