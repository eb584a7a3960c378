#!/usr/bin/env bash
# One lease call, after the kit is stashed (repeat it: each part runs once per machine,
# and the serving harness resumes its units from /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-05-gpu-flashinfer-topk/commands/run.sh
# (The top-k micro-benchmark, the side-stream probe, the transport comparisons and the
# decode-graph GPU tests ran on 2026-12-06: docs/evidence/2026-12-06-h200-side-stream-topk/.)
# 1. Once: the top-k GPU tests, FlashInfer's among them; FlashInfer compiles its kernel on
#    first use on a machine (minutes; kept in ~/.cache/flashinfer, so the served
#    flashinfer unit that follows on the same machine starts without it).
# 2. Served with the time left, one unit each of $MODES (default below), each bracketed by
#    stock.
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-560}; mkdir -p "$OUT/logs" /root/w
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
: "${MODES:=store:resid_pre:last[DMX_GRAPH_SIDE_STREAM=1],store:resid_pre:last,store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer],store:final_logits:topk(64),store:hidden-states}"
if [ ! -f /root/w/gpu-tests-done ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    timeout 400 python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q -p no:cacheprovider \
        -k "topk or flashinfer" > "$OUT/logs/gpu-tests.log" 2>&1; echo "gpu tests rc=$? at $((SECONDS-S)) s"
    tail -4 "$OUT/logs/gpu-tests.log"; touch /root/w/gpu-tests-done
fi
DEADLINE=$((budget - (SECONDS - S))) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh fi "$MODES" 1
