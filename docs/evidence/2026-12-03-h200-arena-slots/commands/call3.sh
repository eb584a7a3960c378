#!/usr/bin/env bash
# Lease call 3: stored hidden-states of 10 % of the requests against stock (#16).
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1 DMI_HARNESS_DEADLINE_S=${DEADLINE:-380}
bash scripts/gpu-run.sh python3 -m harness serving --modes store:hidden-states --env DMX_REQUEST_SAMPLE=0.1 --repeats 1 --out "$OUT/serving-sample10.json" --work /root/wC > "$OUT/logs/serving-sample10.log" 2>&1
echo "serving rc=$? at $((SECONDS-S)) s"; tail -25 "$OUT/logs/serving-sample10.log"
