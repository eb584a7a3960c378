#!/usr/bin/env bash
# The hooks benchmark's sglang-full cell with the drain waiting for each direct item
# (before: c969208) and with one wait for consecutive direct items (after: eb76efe), one
# call on the GPU kit's machine. Here, first: the old tree, carried as an ignored path:
#   mkdir -p .gpu-kit/old && git archive c969208 src harness | tar -x -C .gpu-kit/old
# Then on the device (carry .gpu-kit/bin, .gpu-kit/project, .gpu-kit/old), from the root:
mkdir -p "$OUT/logs"
bash scripts/gpu-run.sh bash -c '
PYTHONPATH=src:$PYTHONPATH timeout 80 python3 -m harness hooks --presets sglang-full --waves 1 \
    --out "$OUT/hooks-full-after.json" > "$OUT/logs/hooks-full-after.log" 2>&1
echo "after rc=$?"
cd .gpu-kit/old && PYTHONPATH=src:$PYTHONPATH timeout 80 python3 -m harness hooks --presets sglang-full \
    --waves 1 --out "$OUT/hooks-full-before.json" > "$OUT/logs/hooks-full-before.log" 2>&1
echo "before rc=$?"'
tail -n 4 "$OUT/logs/hooks-full-after.log" "$OUT/logs/hooks-full-before.log"
