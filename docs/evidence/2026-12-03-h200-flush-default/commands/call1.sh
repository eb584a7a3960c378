#!/usr/bin/env bash
# Lease call: the transport's GPU tests, then the capture hooks' time per forward
# (DMX_DRAIN_FLUSH_TIMEOUT_US at its 400 ms default).
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
timeout 240 bash scripts/gpu-run.sh python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q -s -p no:cacheprovider > "$OUT/logs/transport-gpu-pytest.log" 2>&1
echo "pytest rc=$? at $((SECONDS-S)) s"; grep -E "passed|failed|Error|assert" "$OUT/logs/transport-gpu-pytest.log" | tail -8
timeout $((560-(SECONDS-S))) bash scripts/gpu-run.sh python3 -m harness hooks --presets hidden-states,last,topk64 --out "$OUT/hooks.json" > "$OUT/logs/hooks.log" 2>&1
echo "hooks rc=$? at $((SECONDS-S)) s"; tail -8 "$OUT/logs/hooks.log"
