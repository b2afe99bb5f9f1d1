#!/bin/bash
# GPU machine, after ../shared/gpu/stage.py's parts (PYTHONPATH=/tmp/site): issue 19's output
# check, the end-to-end test twice at once on one GPU (the extend kernel, the launch default,
# and the SDPA gather path before it) and bench/e2e_compare.py over their answers; then, for
# PREFILL_S seconds (0: skip), the TTFT benchmark of plain and qevict 10% (--kinds plain tiered;
# KINDS, POLICY and CASES, the --prefill-cases, change them) into $OUT/prefill-POLICY-KINDS.tgz; E2E=0
# skips the end-to-end part; PROFILE=START:STEPS (e.g. 40:4) then profiles those extend batches
# of the tiered kind's 32 x 8K case (--kv-profile DIR:START:STEPS:extend, inside its first timed
# call) into $OUT/profile-extend.tgz; then, for SERVE_S seconds (0: skip),
# the serving benchmark's quick preset for qevict 10% alone (its server log and tier counters,
# for reading, not a row to compare). Writes $OUT/e2e.tgz, $OUT/e2e-compare.json and the
# others' tarballs: few files, the machine returns at most 8.
. bench/gpu_install.sh > /tmp/inst.txt 2>&1 || { tail -5 /tmp/inst.txt; exit 1; }
export TR_MODEL_PATH=/tmp/models/qwen2.5-0.5b TR_E2E_POLICIES=${POLICIES:-qevict,rdkv} TR_E2E_MEM=0.3
n_policies=$(tr ',' '\n' <<< "$TR_E2E_POLICIES" | grep -c .)
e2e() {  # NAME PORT [server flags]; 240 s a policy (run 23: one policy's server took 140 s, the
  # second was cut by a 240 s limit for both)
  TR_E2E_OUT=/tmp/e2e/$1 TR_E2E_PORT=$2 TR_E2E_ARGS="$3" timeout $((240 * n_policies)) \
    python3 -P -m pytest -q -p no:cacheprovider tests/gpu/test_sglang_e2e.py > /tmp/e2e/$1.txt 2>&1
}
if [ "${E2E:-1}" != 0 ]; then  # E2E=0: the benchmarks below only
  mkdir -p /tmp/e2e
  e2e kernel 31000 "" & e2e sdpa 31010 "--kv-extend sdpa" & wait
  tail -n 2 /tmp/e2e/kernel.txt /tmp/e2e/sdpa.txt
  python3 bench/e2e_compare.py /tmp/e2e/kernel /tmp/e2e/sdpa --policies "$TR_E2E_POLICIES" \
    --out "$OUT/e2e-compare.json"
  tar czf "$OUT/e2e.tgz" -C /tmp e2e
fi
if [ "${PREFILL_S:-0}" -gt 0 ]; then
  kinds=${KINDS:-plain tiered}
  name=prefill-${POLICY:-qevict}-${kinds// /-}
  mkdir -p "/tmp/$name"
  # shellcheck disable=SC2086  # KINDS and CASES are lists
  timeout "$PREFILL_S" python3 -P bench/sglang_decode.py --prefill --policy "${POLICY:-qevict}" \
    --kinds $kinds ${CASES:+--prefill-cases $CASES} --out "/tmp/$name" \
    > "/tmp/$name/prefill.txt" 2>&1
  echo "prefill rc=$?"; grep -E "ratio|sha256" "/tmp/$name/prefill.txt" | tail -n 8
  tar czf "$OUT/$name.tgz" -C /tmp "$name"
fi
if [ -n "${PROFILE:-}" ]; then
  mkdir -p /tmp/profile-extend
  timeout 200 python3 -P bench/sglang_decode.py --prefill --policy "${POLICY:-qevict}" \
    --kinds tiered --prefill-cases 32x8192 --profile "/tmp/profile-extend/prof:$PROFILE:extend" \
    --out /tmp/profile-extend > /tmp/profile-extend/prefill.txt 2>&1
  echo "profile rc=$?"; head -n 3 /tmp/profile-extend/prof/profile-*-extend.txt 2>/dev/null
  tar czf "$OUT/profile-extend.tgz" -C /tmp profile-extend
fi
[ "${SERVE_S:-0}" -gt 0 ] || exit 0
timeout "$SERVE_S" python3 bench/serve_multiturn.py --preset quick --systems 'qevict@10%' \
  --model "$TR_MODEL_PATH" --out /tmp/serve --commit "${TR_COMMIT:-unknown}" --no-progress \
  > /tmp/serve.txt 2>&1
echo "serve rc=$?"; tail -n 4 /tmp/serve.txt; mv /tmp/serve.txt /tmp/serve/ 2>/dev/null
tar czf "$OUT/serve.tgz" -C /tmp serve
