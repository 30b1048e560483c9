#!/usr/bin/env bash
# On a 2-GPU machine: run two lists of 1-GPU suites at once, the first on GPU 0 and the second on GPU 1
# (each sees only its own GPU), and wait for both; device time is wall time, so this halves it.
#   bash scripts/device/pair.sh "art-program" "faults-shared bench-register"
# Logs: $OUT/gpu0.out and $OUT/gpu1.out (plus each suite's own log); exit status: failed suites in all.
set -uo pipefail
first=${1:?usage: pair.sh "SUITES ON GPU 0" "SUITES ON GPU 1"}
second=${2:?usage: pair.sh "SUITES ON GPU 0" "SUITES ON GPU 1"}
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# shellcheck disable=SC2086  # each argument is a list of suite names
CUDA_VISIBLE_DEVICES=0 bash scripts/device/suite.sh $first > "$OUT/gpu0.out" 2>&1 &
gpu0=$!
# shellcheck disable=SC2086
CUDA_VISIBLE_DEVICES=1 bash scripts/device/suite.sh $second > "$OUT/gpu1.out" 2>&1 &
gpu1=$!
wait "$gpu0"; rc0=$?
wait "$gpu1"; rc1=$?
for n in 0 1; do
  echo "===== GPU $n"
  grep -E '^(===|PASSED|FAILED|ERROR|SKIPPED)|passed|failed|\| ' "$OUT/gpu$n.out" | tail -40
done
exit $((rc0 + rc1))
