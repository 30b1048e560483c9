#!/usr/bin/env bash
# On a machine of several GPUs: run lists of 1-GPU suites at once, list k on GPU k (each sees only its own
# GPU), and wait for all; device time is wall time, so N lists on N GPUs take the longest list's time.
#   bash scripts/device/per_gpu.sh "art-program" "faults-shared bench-register"
#   bash scripts/device/per_gpu.sh "contract-adapters shared-sleep" "contract-requests" "replicas-1gpu" "adapter-faults"
# A word NAME=value in a list is set for that list's suites only (the same suite on two models at once):
#   bash scripts/device/per_gpu.sh "r39-vllm" "RMODEL=/root/models/qwen2.5-7b-random RUNS='grpo-128:32@bare' r39-vllm"
# PER_GPU_DEADLINE_S=N stops the lists still running N seconds after the start (each list is its own process
# group, its servers included), so a call ends inside its 10 minutes with what was measured: the benchmarks
# write their JSON after each workload and a cut suite goes on with --resume.
# Logs: $OUT/gpuK.out (plus each suite's own log in $OUT/gK/); exit status: failed suites in all.
set -uo pipefail
[ $# -ge 1 ] || { echo 'usage: per_gpu.sh "SUITES ON GPU 0" ["SUITES ON GPU 1" ...]' >&2; exit 2; }
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
start=$(date +%s)
pids=()
gpu=0
for suites in "$@"; do
  mkdir -p "$OUT/g$gpu"
  # eval: a list's quoting (RUNS='a b') is the caller's; its NAME=value words become this list's environment.
  setsid env CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/g$gpu" bash -c "eval \"set -- $suites\"; envs=(); while [[ \$# -gt 0 && \$1 == *=* ]]; do envs+=(\"\$1\"); shift; done; exec env \"\${envs[@]}\" bash scripts/device/suite.sh \"\$@\"" > "$OUT/gpu$gpu.out" 2>&1 &
  pids+=($!)
  gpu=$((gpu + 1))
done
running() { for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
while running; do
  if [ -n "${PER_GPU_DEADLINE_S:-}" ] && [ $(( $(date +%s) - start )) -ge "$PER_GPU_DEADLINE_S" ]; then
    echo "per_gpu.sh: ${PER_GPU_DEADLINE_S} s passed, stopping the lists still running"
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    sleep 15
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    break
  fi
  sleep 2
done
failed=0
for pid in "${pids[@]}"; do
  wait "$pid"
  rc=$?
  # A list stopped by a signal counts as one failed suite; otherwise suite.sh's count.
  [ "$rc" -ge 128 ] && rc=1
  failed=$((failed + rc))
done
for ((n = 0; n < gpu; n++)); do
  echo "===== GPU $n"
  grep -E '^(===|PASSED|FAILED|ERROR|SKIPPED)|passed|failed|\| ' "$OUT/gpu$n.out" | tail -40
done
exit "$failed"
