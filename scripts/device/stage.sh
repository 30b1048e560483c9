#!/usr/bin/env bash
# On the GPU machine: stage one part of a device kit (../shared/device/README.md), and install the stack
# once its last part is there. Each part travels in its own `run` call (64 MiB per call); every kit's last
# part holds a LAST marker (make_parts.sh, kit_parts.sh), so carry it with the kit's install.sh:
#   bash scripts/device/stage.sh sglang 0..6   carry .device/pN (SGLang + FlashAttention-3, 7 parts)
#   bash scripts/device/stage.sh train 0..1    carry .device-train/pN (the Unsloth trainer stack)
#   bash scripts/device/stage.sh vllm 0..5     carry .device-vllm/pN (built by scripts/device/kit_parts.sh vllm)
#   bash scripts/device/stage.sh art 0..1      carry .device-art/pN (kit_parts.sh art): openpipe-art for the
#                                              test process, after prepare.sh
#   bash scripts/device/stage.sh router 0      carry .device-router/p0 (after sglang: SGLang's router goes
#                                              next to SGLang in /tmp/site)
#   bash scripts/device/stage.sh ray 0..1      carry .device-ray/pN (kit_parts.sh ray): Ray for the test
#                                              process and its simulated nodes, after prepare.sh
# The part counts are today's kits'; the marker, not the number, says when a kit is complete.
set -euo pipefail
what=${1:?usage: stage.sh sglang|train|vllm|router|art|ray N}
n=${2:?usage: stage.sh sglang|train|vllm|router|art|ray N}
case $what in
  sglang) src=.device stage=/root/b site=/tmp/site ;;
  # Trainer and router kits built before make_parts.sh marked the last part end at p1 and p0.
  train) src=.device-train stage=/root/t site=/tmp/tsite unmarked_last=1 ;;
  vllm) src=.device-vllm stage=/root/v site=/tmp/vsite ;;
  router) src=.device-router stage=/root/r site=/tmp/site unmarked_last=0 ;;
  art) src=.device-art stage=/root/a site=/tmp/usite ;;
  ray) src=.device-ray stage=/root/y site=/tmp/usite ;;
  *) echo "usage: stage.sh sglang|train|vllm|router|art|ray N" >&2; exit 2 ;;
esac
mkdir -p "$stage"
cp "$src/p$n"/chunk.* "$stage/"
echo "staged $what part $n into $stage ($(du -sh "$stage" | cut -f1))"
complete=no
if [ -e "$src/p$n/LAST" ]; then
  complete=yes
elif [ "$n" = "${unmarked_last:-}" ]; then
  complete=yes
  echo "no LAST marker in $src/p$n: taken as the last part of a $what kit built before the marker"
fi
if [ "$complete" = yes ]; then
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
