#!/usr/bin/env bash
# On a machine of several GPUs: run lists of 1-GPU suites at once, list k on GPU k (each sees only its own
# GPU), and wait for all; device time is wall time, so N lists on N GPUs take the longest list's time.
#   bash scripts/device/per_gpu.sh "art-program" "faults-shared bench-register"
#   bash scripts/device/per_gpu.sh "contract-adapters shared-sleep" "contract-requests" "replicas-1gpu" "adapter-faults"
# Logs: $OUT/gpuK.out (plus each suite's own log); exit status: failed suites in all.
set -uo pipefail
[ $# -ge 1 ] || { echo 'usage: per_gpu.sh "SUITES ON GPU 0" ["SUITES ON GPU 1" ...]' >&2; exit 2; }
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
pids=()
gpu=0
for suites in "$@"; do
  # shellcheck disable=SC2086  # each argument is a list of suite names
  CUDA_VISIBLE_DEVICES=$gpu bash scripts/device/suite.sh $suites > "$OUT/gpu$gpu.out" 2>&1 &
  pids+=($!)
  gpu=$((gpu + 1))
done
failed=0
for pid in "${pids[@]}"; do
  wait "$pid"
  failed=$((failed + $?))
done
for ((n = 0; n < gpu; n++)); do
  echo "===== GPU $n"
  grep -E '^(===|PASSED|FAILED|ERROR|SKIPPED)|passed|failed|\| ' "$OUT/gpu$n.out" | tail -40
done
exit "$failed"
