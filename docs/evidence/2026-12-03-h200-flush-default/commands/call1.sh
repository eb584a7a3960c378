#!/usr/bin/env bash
# Lease call 1: the transport's GPU tests, then the capture hooks' time per forward
# (DMX_DRAIN_FLUSH_TIMEOUT_US at its 400 ms default), then where the drain thread spends
# its time (sampled, a separate run: sampling takes the GIL too).
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
timeout 240 bash scripts/gpu-run.sh python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q -s -p no:cacheprovider > "$OUT/logs/transport-gpu-pytest.log" 2>&1
echo "pytest rc=$? at $((SECONDS-S)) s"; grep -E "passed|failed|Error|assert" "$OUT/logs/transport-gpu-pytest.log" | tail -8
timeout $((560-(SECONDS-S))) bash scripts/gpu-run.sh python3 -m harness hooks --out "$OUT/hooks.json" > "$OUT/logs/hooks.log" 2>&1
echo "hooks rc=$? at $((SECONDS-S)) s"; tail -12 "$OUT/logs/hooks.log"
timeout $((590-(SECONDS-S))) bash scripts/gpu-run.sh python3 -m harness hooks --presets hidden-states,topk64 --sample --out "$OUT/hooks-sampled.json" > "$OUT/logs/hooks-sampled.log" 2>&1
echo "hooks --sample rc=$? at $((SECONDS-S)) s"; tail -40 "$OUT/logs/hooks-sampled.log"
