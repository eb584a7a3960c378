#!/usr/bin/env bash
# One lease call, after the kit is stashed (repeat it: the serving harness resumes from /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-05-gpu-flashinfer-topk/commands/run.sh
# 1. Once: the top-k selections' GPU tests (FlashInfer's included: it compiles on first
#    use), python -m harness topk (each selection timed alone, in a CUDA graph) and the
#    side-stream probe of docs/evidence/2026-12-06-side-stream-copies/.
# 2. Served with the time left, one unit each: store:final_logits:topk(64) with
#    DMX_TOPK_KERNEL=flashinfer beside the default selection, then store:hidden-states at
#    the defaults of 2026-12-05 (128 MiB inserts, puts in 8 MiB pieces), each bracketed
#    by stock.
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-560}; mkdir -p "$OUT/logs" /root/w
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
if [ ! -f /root/w/topk-done ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    { command -v nvcc; echo "CUDA_HOME=${CUDA_HOME:-}"; ls -d /usr/local/cuda* 2>&1; } > "$OUT/logs/nvcc.txt"
    timeout 200 python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q -p no:cacheprovider \
        -k "topk or flashinfer" > "$OUT/logs/gpu-tests.log" 2>&1; echo "gpu tests rc=$? at $((SECONDS-S)) s"
    tail -3 "$OUT/logs/gpu-tests.log"
    timeout 120 bash scripts/gpu-run.sh python3 -m harness topk --batches 1,8,64 --chunks 128 \
        --out "$OUT/topk.json" > "$OUT/logs/topk.log" 2>&1; echo "topk rc=$? at $((SECONDS-S)) s"
    tail -10 "$OUT/logs/topk.log"
    timeout 90 python3 docs/evidence/2026-12-06-side-stream-copies/commands/side_stream_probe.py \
        --out "$OUT/side-stream.json" > "$OUT/logs/side-stream.log" 2>&1; echo "side-stream rc=$? at $((SECONDS-S)) s"
    tail -6 "$OUT/logs/side-stream.log"; touch /root/w/topk-done
fi
DEADLINE=$((budget - (SECONDS - S))) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh fi \
    "store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer],store:final_logits:topk(64),store:hidden-states" 1
