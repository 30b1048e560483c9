#!/usr/bin/env bash
# On the GPU machine: stage one part of the device kit (../shared/device/README.md), and install the stack
# once its last part is there. Each part travels in its own `run` call (64 MiB per call):
#   bash scripts/device/stage.sh sglang 0..3   carry .device/pN (+ .device/install.sh with the last)
#   bash scripts/device/stage.sh train 0..1    carry .device-train/pN (+ .device-train/install.sh with the last)
set -euo pipefail
what=${1:?usage: stage.sh sglang|train N}
n=${2:?usage: stage.sh sglang|train N}
case $what in
  sglang) src=.device stage=/root/b site=/tmp/site last=3 ;;
  train) src=.device-train stage=/root/t site=/tmp/tsite last=1 ;;
  *) echo "usage: stage.sh sglang|train N" >&2; exit 2 ;;
esac
mkdir -p "$stage"
cp "$src/p$n"/* "$stage/"
echo "staged $what part $n into $stage ($(du -sh "$stage" | cut -f1))"
if [ "$n" = "$last" ]; then
  start=$(date +%s)
  bash "$src/install.sh" "$stage" "$site"
  echo "install of $what took $(( $(date +%s) - start )) s"
fi
