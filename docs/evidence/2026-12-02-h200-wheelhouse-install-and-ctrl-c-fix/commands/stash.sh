#!/usr/bin/env bash
# On the GPU machine: keep the carried wheelhouse part(s) in /root/wh-chunks.
set -euo pipefail
mkdir -p /root/wh-chunks
for d in .whx/parts/part-*; do
  [ -f "$d/blob" ] || continue
  cp "$d/blob" "/root/wh-chunks/chunk-${d##*-}"
done
echo "stashed: $(ls /root/wh-chunks | wc -l) chunks"
