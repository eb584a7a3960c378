#!/usr/bin/env bash
# After the review fixes: the transport's GPU tests, then one timed wave of the hooks
# benchmark's sglang-full cell with the default 1 GiB ring (direct slabs of 128 MiB):
#   bash docs/evidence/2026-12-04-h200-flights/commands/final.sh
mkdir -p "$OUT/logs" "$OUT/comparison"
bash scripts/gpu-run.sh timeout 60 python3 -m pytest tests/transport/test_transport_gpu.py \
    -m gpu -q -p no:cacheprovider > "$OUT/logs/gpu-tests-final.log" 2>&1
echo "gpu tests rc=$?"; tail -n 2 "$OUT/logs/gpu-tests-final.log"
bash scripts/gpu-run.sh bash -c "PYTHONPATH=src:\$PYTHONPATH timeout 90 python3 -m harness hooks \
    --presets sglang-full --waves 1 --ring-mb 1024 \
    --out $OUT/comparison/hooks-full-ring1024-final.json" > "$OUT/logs/hooks-final.log" 2>&1
echo "hooks rc=$?"; tail -n 6 "$OUT/logs/hooks-final.log"
