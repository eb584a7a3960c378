#!/usr/bin/env bash
# One lease call, after the kit is stashed (repeat it: each part runs once, and the serving
# harness resumes its units from /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-05-gpu-flashinfer-topk/commands/run.sh
# 1. Once: the GPU tests of the top-k selections (FlashInfer's compiles on first use) and
#    of decode graphs with and without DMX_GRAPH_SIDE_STREAM; python -m harness topk (each
#    selection alone, in a CUDA graph); the side-stream probe (torch alone,
#    docs/evidence/2026-12-06-side-stream-copies/); python -m harness transport at batch 64
#    with DMX_GRAPH_SIDE_STREAM=0 and =1.
# 2. Served with the time left, one unit each of $MODES (default below), each bracketed by
#    stock.
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-560}; mkdir -p "$OUT/logs" /root/w
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
: "${MODES:=store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer],store:final_logits:topk(64),store:resid_pre:last[DMX_GRAPH_SIDE_STREAM=1],store:resid_pre:last,store:hidden-states}"
once() {  # once NAME SECONDS COMMAND...: run it unless done on this machine
    local name=$1 limit=$2; shift 2
    [ -f "/root/w/$name-done" ] && return 0
    timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1; echo "$name rc=$? at $((SECONDS-S)) s"
    tail -12 "$OUT/logs/$name.log"; touch "/root/w/$name-done"
}
if [ ! -f /root/w/gpu-done ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    { command -v nvcc; echo "CUDA_HOME=${CUDA_HOME:-}"; ls -d /usr/local/cuda* 2>&1; } > "$OUT/logs/nvcc.txt"
    touch /root/w/gpu-done
fi
once gpu-tests 240 python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q -p no:cacheprovider \
    -k "topk or flashinfer or graph"
once topk 120 bash scripts/gpu-run.sh python3 -m harness topk --batches 1,8,64 --chunks 128 --out "$OUT/topk.json"
once side-stream 90 python3 docs/evidence/2026-12-06-side-stream-copies/commands/side_stream_probe.py \
    --out "$OUT/side-stream.json"
once transport-inline 150 env DMX_GRAPH_SIDE_STREAM=0 bash scripts/gpu-run.sh python3 -m harness transport \
    --batches 64 --presets hidden-states,last --steps 100 --warmup 10 --out "$OUT/transport-inline.json"
once transport-side 150 env DMX_GRAPH_SIDE_STREAM=1 bash scripts/gpu-run.sh python3 -m harness transport \
    --batches 64 --presets hidden-states,last --steps 100 --warmup 10 --out "$OUT/transport-side.json"
DEADLINE=$((budget - (SECONDS - S))) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh fi "$MODES" 1
