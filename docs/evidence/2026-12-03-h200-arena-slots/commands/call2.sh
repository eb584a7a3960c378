#!/usr/bin/env bash
# Lease call 2: capture-only hidden-states against stock (#15).
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1 DMI_HARNESS_DEADLINE_S=${DEADLINE:-380}
bash scripts/gpu-run.sh python3 -m harness serving --modes transport:hidden-states --repeats 1 --out "$OUT/serving-hidden-states.json" --work /root/wB > "$OUT/logs/serving-hidden-states.log" 2>&1
echo "serving rc=$? at $((SECONDS-S)) s"; tail -25 "$OUT/logs/serving-hidden-states.log"
