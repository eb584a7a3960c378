#!/usr/bin/env bash
# The transport's GPU tests (every captured byte against a reference, on the device), then
# the hooks benchmark's sglang-full cell at two ring sizes, one call on the GPU kit's machine:
#   bash docs/evidence/2026-12-04-h200-flights/commands/check.sh 1024 16384
mkdir -p "$OUT/logs"
bash scripts/gpu-run.sh timeout 240 python3 -m pytest tests/transport/test_transport_gpu.py \
    -m gpu -q -p no:cacheprovider > "$OUT/logs/gpu-tests.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/logs/gpu-tests.log"
bash docs/evidence/2026-12-04-h200-parts/commands/hooks.sh "$@"
