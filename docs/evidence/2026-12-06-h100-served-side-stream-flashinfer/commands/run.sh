#!/usr/bin/env bash
# One lease call, after the kit is stashed (repeat it; units resume from /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-06-h100-served-side-stream-flashinfer/commands/run.sh
# 1. Once: FlashInfer's GPU tests (its kernel compiles on first use on a machine, minutes;
#    the other top-k GPU tests passed earlier). 2. The served units of
#    docs/evidence/2026-12-05-gpu-flashinfer-topk/commands/run.sh, in this order.
# At b8c11e8 a mode without brackets ran with DMX_GRAPH_SIDE_STREAM off (its default
# then); at later commits the off arm is `store:resid_pre:last[DMX_GRAPH_SIDE_STREAM=0]`.
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs" /root/w
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
if [ ! -f /root/w/gpu-tests-done ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    timeout 400 python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q -p no:cacheprovider \
        -k flashinfer > "$OUT/logs/gpu-tests.log" 2>&1; echo "gpu tests rc=$? at $((SECONDS-S)) s"
    tail -4 "$OUT/logs/gpu-tests.log"; touch /root/w/gpu-tests-done
fi
: "${MODES:=store:resid_pre:last[DMX_GRAPH_SIDE_STREAM=1],store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer],store:final_logits:topk(64),store:resid_pre:last,store:hidden-states}"
export MODES DEADLINE=$((${DEADLINE:-560} - (SECONDS - S)))
exec bash docs/evidence/2026-12-05-gpu-flashinfer-topk/commands/run.sh
