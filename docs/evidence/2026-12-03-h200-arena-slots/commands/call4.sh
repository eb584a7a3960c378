#!/usr/bin/env bash
# Lease call 4: stored top-64 logits of every generated token against stock (#16).
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1 DMI_HARNESS_DEADLINE_S=${DEADLINE:-380}
bash scripts/gpu-run.sh python3 -m harness serving --modes 'store:final_logits:topk(64)' --repeats 1 --out "$OUT/serving-topk.json" --work /root/wD > "$OUT/logs/serving-topk.log" 2>&1
echo "serving rc=$? at $((SECONDS-S)) s"; tail -25 "$OUT/logs/serving-topk.log"
