#!/usr/bin/env bash
# One measurement call on the GPU machine: per_gpu.sh's lists (the arguments), once the models prepare.sh
# builds in the background are there, then everything back as one file: $OUT/$NAME.tgz holds the lists'
# logs and server logs, the benches' JSON (/tmp/bench-results) and the GPUs' state after the call.
#   NAME=a ART_SGLANG_COMMIT=<sha> PER_GPU_DEADLINE_S=545 bash scripts/device/measure.sh "LIST 0" "LIST 1"
set -uo pipefail
test -d /tmp/site/sglang || { echo COLD; exit 3; }
# shellcheck source=scripts/device/env.sh
source scripts/device/env.sh
name=${NAME:?NAME=<call> names the tarball}
# prepare.sh's MODELS build, if any, must end first (a 7B model takes ~2 min of CPU).
for _ in $(seq 1 100); do [ ! -e /tmp/models.log ] || [ -e /tmp/models.done ] && break; sleep 3; done
dest=$OUT
export OUT=/tmp/o-$name
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv > "$OUT/gpus.csv"
bash scripts/device/per_gpu.sh "$@"
failed=$?
{ nvidia-smi --query-gpu=index,memory.used --format=csv
  echo "server, vLLM or trainer processes left: $(pgrep -fc 'sglang.launch_server|vllm.entrypoints|training.worker' || true)"
} > "$OUT/gpu-after.txt"
cat "$OUT/gpu-after.txt"
kept=("tmp/o-$name" tmp/bench-results)
[ ! -e /tmp/models.log ] || kept+=(tmp/models.log)
tar czf "$dest/$name.tgz" -C / "${kept[@]}" 2>/dev/null
ls -la "$dest"
exit "$failed"
