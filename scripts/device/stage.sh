#!/usr/bin/env bash
# On the GPU machine: stage one part of a device kit (../shared/device/README.md), and install the stack
# once its last part is there. Each part travels in its own `run` call (64 MiB per call):
#   bash scripts/device/stage.sh sglang 0..3   carry .device/pN (+ .device/install.sh with the last)
#   bash scripts/device/stage.sh train 0..1    carry .device-train/pN (+ .device-train/install.sh with the last)
#   bash scripts/device/stage.sh vllm 0..5     carry .device-vllm/pN (+ .device-vllm/install.sh with the last;
#                                              built by scripts/device/kit_parts.sh vllm, its last part holds LAST)
#   bash scripts/device/stage.sh art 0..1      carry .device-art/pN (+ .device-art/install.sh with the last;
#                                              kit_parts.sh art): openpipe-art for the test process, after
#                                              prepare.sh
#   bash scripts/device/stage.sh router 0      carry .device-router/p0 + .device-router/install.sh (after sglang:
#                                              SGLang's router goes next to SGLang in /tmp/site)
set -euo pipefail
what=${1:?usage: stage.sh sglang|train|vllm|router|art N}
n=${2:?usage: stage.sh sglang|train|vllm|router|art N}
case $what in
  sglang) src=.device stage=/root/b site=/tmp/site last=3 ;;
  train) src=.device-train stage=/root/t site=/tmp/tsite last=1 ;;
  vllm) src=.device-vllm stage=/root/v site=/tmp/vsite last=marked ;;
  router) src=.device-router stage=/root/r site=/tmp/site last=0 ;;
  art) src=.device-art stage=/root/a site=/tmp/usite last=marked ;;
  *) echo "usage: stage.sh sglang|train|vllm|router|art N" >&2; exit 2 ;;
esac
mkdir -p "$stage"
cp "$src/p$n"/chunk.* "$stage/"
echo "staged $what part $n into $stage ($(du -sh "$stage" | cut -f1))"
if [ "$n" = "$last" ] || [ -e "$src/p$n/LAST" ]; then
  start=$(date +%s)
  bash "$src/install.sh" "$stage" "$site"
  echo "install of $what took $(( $(date +%s) - start )) s"
  if [ "$what" = vllm ]; then
    # vLLM runs on the machine's torch with its own stack first on the path, as SGLang does (prepare.sh).
    printf '#!/bin/sh\n# vLLM with its own stack first (kept apart from SGLang and the trainer)\nPYTHONPATH=/tmp/vsite exec python3 "$@"\n' \
      > /tmp/vllm-python
    chmod +x /tmp/vllm-python
    /tmp/vllm-python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
  fi
fi
