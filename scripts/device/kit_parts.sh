#!/usr/bin/env bash
# Build a device kit of pinned wheels as parts of at most 54 MiB (room for the working tree in a 64 MiB
# call): DEST/p0 .. pN (the last one holds a LAST marker) and DEST/install.sh. Run from the project root on
# a machine with PyPI; reuse downloaded wheels with WHEELS.
#   bash scripts/device/kit_parts.sh vllm [DEST=.device-vllm]  vLLM 0.24.0 (../shared/device's list), trimmed
#                                                               by scripts/device/vllm-trim.txt
#   bash scripts/device/kit_parts.sh art [DEST=.device-art]    openpipe-art 0.5.18 and what `import art` needs
#                                                               beyond the GPU machine's image and the other
#                                                               kits (scripts/device/art-wheels.txt)
#   bash scripts/device/kit_parts.sh ray [DEST=.device-ray]    Ray 2.60 and what it needs beyond the image
#                                                               (scripts/device/ray-wheels.txt)
#   SHARED_DEVICE=/path/to/shared/device WHEELS=/tmp/vllm-wheels bash scripts/device/kit_parts.sh vllm
set -euo pipefail
kit=${1:?usage: kit_parts.sh vllm|art|ray [DEST]}
dest=${2:-.device-$kit}
here=$(cd "$(dirname "$0")" && pwd)
shared=${SHARED_DEVICE:-$here/../../../shared/device}
case $kit in
  vllm) list=$shared/vllm-0.24.0-wheels.txt trim=$here/vllm-trim.txt ;;
  art) list=$here/art-wheels.txt trim=/dev/null ;;
  ray) list=$here/ray-wheels.txt trim=/dev/null ;;
  *) echo "usage: kit_parts.sh vllm|art|ray [DEST]" >&2; exit 2 ;;
esac
test -f "$list" || { echo "no $list: set SHARED_DEVICE to the shared device kit folder" >&2; exit 2; }
test -f "$shared/install.sh" || { echo "no $shared/install.sh: set SHARED_DEVICE" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Wheels to keep: the pinned list without the trimmed names.
awk '$1 == "wheel" {print $2}' "$trim" > "$work/drop"
awk -F'==' 'FILENAME == ARGV[1] {drop[$1]; next} NF == 2 && !($1 in drop)' "$work/drop" "$list" > "$work/keep.txt"
mkdir "$work/wheels"
if [ -n "${WHEELS:-}" ]; then
  while IFS='=' read -r name _ version; do
    file=$(find "$WHEELS" -maxdepth 1 -name "$(echo "$name" | tr '-' '_')-$version-*.whl" | head -1)
    [ -n "$file" ] || { echo "missing in $WHEELS: $name==$version" >&2; exit 2; }
    cp "$file" "$work/wheels/"
  done < "$work/keep.txt"
else
  plat="--only-binary=:all: --python-version 3.12 --implementation cp"
  for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 \
           manylinux1_x86_64 manylinux_2_5_x86_64 manylinux_2_12_x86_64 linux_x86_64 any; do
    plat="$plat --platform $p"
  done
  # shellcheck disable=SC2086
  pip download -q --no-deps $plat -d "$work/wheels" -r "$work/keep.txt" 2>&1 | grep -v '^WARNING' || true
fi
kept=$(find "$work/wheels" -name '*.whl' | wc -l)
[ "$kept" = "$(wc -l < "$work/keep.txt")" ] || { echo "got $kept wheels for $(wc -l < "$work/keep.txt") names" >&2; exit 1; }
if [ "$kit" = vllm ]; then
  # Repack the vllm wheel without the trimmed files; its RECORD lists only what is left.
  wheel=$(ls "$work"/wheels/vllm-*.whl)
  mkdir "$work/v"
  (cd "$work/v" && unzip -q "$wheel")
  awk '$1 == "file" {print $2}' "$trim" | while read -r path; do
    test -e "$work/v/$path" || { echo "vllm wheel has no $path (check vllm-trim.txt)" >&2; exit 1; }
    rm -rf "${work:?}/v/$path"
  done
  (cd "$work/v" && python3 - <<'PY'
import csv, glob, os
record = glob.glob("*.dist-info/RECORD")[0]
rows = [row for row in csv.reader(open(record)) if row and os.path.exists(row[0])]
csv.writer(open(record, "w")).writerows(rows)
PY
  rm "$wheel" && zip -q -r -9 "$wheel" .)
fi
rm -rf "$dest" && mkdir -p "$dest"
tar -cf - -C "$work/wheels" . | split -b 54m -d -a 2 - "$dest/chunk."
n=0
for chunk in "$dest"/chunk.*; do
  mkdir "$dest/p$n" && mv "$chunk" "$dest/p$n/" && n=$((n + 1))
done
touch "$dest/p$((n - 1))/LAST"
cp "$shared/install.sh" "$dest/"
echo "$kept wheels, $(du -sh "$work/wheels" | cut -f1) in $n parts:"
du -sh "$dest"/p*
