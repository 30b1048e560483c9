#!/usr/bin/env bash
# On the GPU machine (after stage.sh + prepare.sh): run named suites one after another, each logging to
# $OUT/<name>.log; measured numbers go to $OUT/results.jsonl and the benchmarks' JSON/markdown to $OUT.
# A failing suite does not stop the next; the exit status is the number of failed suites.
#   bash scripts/device/suite.sh contract shared-sleep
# Suites: contract shared-sleep shared-restart sync split bench-cycle bench-inference bench-trainer
#         bench-multiturn
set -uo pipefail
# shellcheck source=scripts/device/env.sh
source scripts/device/env.sh
export ART_SGLANG_GPU_RESULTS="$OUT/results.jsonl"
tiny=$ART_SGLANG_GPU_TINY
big=$ART_SGLANG_GPU_REALISTIC
kernels=(--attention-backend triton --sampling-backend pytorch)
pytest=(python3 -m pytest -p no:cacheprovider -v -rA --tb=short --timeout 590)
failed=0
for name in "$@"; do
  start=$(date +%s)
  case $name in
    contract) cmd=("${pytest[@]}" tests/contract --engine sglang --model-path "$tiny") ;;
    shared-sleep) cmd=("${pytest[@]}" -m gpu tests/gpu/test_shared_mode.py -k sleep) ;;
    shared-restart) cmd=("${pytest[@]}" -m gpu tests/gpu/test_shared_mode.py -k restart) ;;
    sync) cmd=("${pytest[@]}" -m gpu tests/gpu/test_sync_methods.py) ;;
    split) cmd=("${pytest[@]}" -m gpu tests/gpu/test_split_mode.py) ;;
    bench-cycle) cmd=(python3 scripts/bench_cycle.py --model "$big" "${kernels[@]}" --cycles 5
                      --json "$OUT/bench_cycle.json" --markdown "$OUT/bench_cycle.md") ;;
    bench-inference) cmd=(python3 scripts/benchmark_inference.py --engine sglang --model "$big" "${kernels[@]}"
                          --json "$OUT/bench_inference.json" --markdown "$OUT/bench_inference.md") ;;
    bench-trainer) cmd=(python3 scripts/bench_trainer.py --model "$big" --out "$OUT") ;;
    bench-multiturn) cmd=(python3 scripts/bench_multiturn.py --model "$big" "${kernels[@]}"
                          --json "$OUT/bench_multiturn.json" --markdown "$OUT/bench_multiturn.md") ;;
    *) echo "unknown suite $name" >&2; failed=$((failed + 1)); continue ;;
  esac
  echo "=== $name: ${cmd[*]}" | tee "$OUT/$name.log"
  "${cmd[@]}" 2>&1 | tee -a "$OUT/$name.log" | grep -E --line-buffered '^(===|PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error|\| '
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.log"
  [ "$rc" = 0 ] || failed=$((failed + 1))
done
exit "$failed"
