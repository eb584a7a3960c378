#!/usr/bin/env bash
# Lease call 2: the export's cost under load with the store owner process (issue #17).
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1 DMI_HARNESS_DEADLINE_S=530
bash scripts/gpu-run.sh python3 -m harness serve-load --model 0.6b --modes hidden-states --export-gb 1 --export-rounds 2 --num-prompts 300 --out "$OUT/serve-load.json" --work /root/sl > "$OUT/logs/serve-load.log" 2>&1
echo "serve-load rc=$? at $((SECONDS-S)) s"; tail -30 "$OUT/logs/serve-load.log"
