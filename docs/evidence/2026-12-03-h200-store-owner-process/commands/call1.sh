#!/usr/bin/env bash
# Lease call 1: the end-to-end and serving GPU tests with the store owner process.
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
timeout 260 bash scripts/gpu-run.sh python3 -m pytest tests/gpu/test_e2e_qwen3.py -m gpu -q -p no:cacheprovider --basetemp=/tmp/c1e > "$OUT/logs/test_e2e.log" 2>&1
echo "e2e rc=$? at $((SECONDS-S)) s"; tail -3 "$OUT/logs/test_e2e.log"
timeout $((570-(SECONDS-S))) bash scripts/gpu-run.sh python3 -m pytest tests/gpu/test_serving.py -m gpu -q -s -p no:cacheprovider --basetemp=/tmp/c1s > "$OUT/logs/test_serving.log" 2>&1
echo "serving rc=$? at $((SECONDS-S)) s"; tail -4 "$OUT/logs/test_serving.log"
grep -h "store_owner_started\|store_owner_ended" /tmp/c1e -r 2>/dev/null | head -3
ls "$OUT/evidence" 2>/dev/null
