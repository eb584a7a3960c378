#!/usr/bin/env bash
# The hooks benchmark's sglang-full cell with the GPU ring (and its page-locked staging) at
# several sizes, one call on the GPU kit's machine, from the repository root:
#   bash docs/evidence/2026-12-04-h200-full-ring/commands/rings.sh 1024 4096 16384
mkdir -p "$OUT/logs" "$OUT/comparison"
for mb in "$@"; do
    bash scripts/gpu-run.sh bash -c "PYTHONPATH=src:\$PYTHONPATH timeout 150 python3 -m harness hooks \
        --presets sglang-full --waves 2 --ring-mb $mb --out $OUT/comparison/hooks-full-ring$mb.json" \
        > "$OUT/logs/hooks-full-ring$mb.log" 2>&1
    echo "ring $mb MiB rc=$?"
    tail -n 3 "$OUT/logs/hooks-full-ring$mb.log"
done
