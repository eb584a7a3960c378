#!/usr/bin/env bash
# Planned for the next lease (not run yet). Each call, after the kit is stashed:
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   CALL_S=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-05-cpu-topk-kernel/commands/next.sh
# Resumable (state under /root/w): call it again until it says "all done".
#  1. python -m harness topk: torch.topk, chunked_topk and fused_topk (DMX_TOPK_KERNEL) at
#     16 to 512 columns, batch 1, 8 and 64, CUDA-graph replays; then the GPU test of both
#     selections replayed in a graph.
#  2. store:final_logits:topk(64) served without and with DMX_TOPK_KERNEL=1, one unit each.
#  3. the store's insert size, as planned last session:
#     ../../2026-12-05-owner-ring-serving/commands/next.sh (its own deadline, CALL_S).
set -o pipefail
S=$SECONDS
mkdir -p "$OUT/logs" /root/w; export TRITON_CACHE_DIR=/root/triton-cache
left() { echo $(( ${CALL_S:-560} - (SECONDS - S) )); }
if [ ! -s /root/w/topk.json ]; then
    bash scripts/gpu-run.sh python3 -m harness topk --out /root/w/topk.json > /root/w/topk.log 2>&1 \
        || { tail -40 /root/w/topk.log; rm -f /root/w/topk.json; exit 4; }
    python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -k "topk" -q \
        -p no:cacheprovider > /root/w/topk-gpu-test.log 2>&1
fi
cp /root/w/topk.json /root/w/topk.log /root/w/topk-gpu-test.log "$OUT/"; cat /root/w/topk.log
tail -3 /root/w/topk-gpu-test.log
if ! grep -qs "serving rc=0 " /root/w/serve-topk.txt; then
    [ "$(left)" -lt 320 ] && { echo "left for the next call: topk served"; exit 0; }
    DEADLINE=$(( $(left) - 15 )) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh \
        topk "store:final_logits:topk(64),store:final_logits:topk(64)[DMX_TOPK_KERNEL=1]" 1 \
        | tee /root/w/serve-topk.txt
    grep -q "serving rc=0 " /root/w/serve-topk.txt || { echo "left for the next call: topk served"; exit 0; }
fi
cp /root/w/serve-topk.txt "$OUT/logs/"
[ "$(left)" -lt 200 ] && { echo "left for the next call: the store's insert size"; exit 0; }
CALL_S=$(left) bash docs/evidence/2026-12-05-owner-ring-serving/commands/next.sh
