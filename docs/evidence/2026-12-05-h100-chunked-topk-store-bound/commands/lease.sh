#!/usr/bin/env bash
# One lease, after `source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;`:
# the top-k selection alone (torch.topk against chunked_topk per chunk width, CUDA-graph
# replays), then served on the reference workload: topk(64) with the fastest chunk width at
# batch 64, store:hidden-states (its bound share), and topk(64) with torch.topk on the same
# host. State lives under /root/w, so a call that stops at its deadline is resumed by the next.
set -o pipefail
mkdir -p "$OUT/logs" /root/w; export TRITON_CACHE_DIR=/root/triton-cache
if [ ! -s /root/w/topk.json ]; then
    bash scripts/gpu-run.sh python3 -m harness topk --out /root/w/topk.json > /root/w/topk.log 2>&1 \
        || { cat /root/w/topk.log; rm -f /root/w/topk.json; exit 4; }
fi
cp /root/w/topk.json /root/w/topk.log "$OUT/"; cat /root/w/topk.log
BEST=$(python3 -c '
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["figures"]["rows"] if r["batch"] == 64]
best = min(rows, key=lambda r: r["us"])
print(best["variant"].removeprefix("chunked ") if best["variant"] != "torch.topk" else 0)
' /root/w/topk.json) || exit 5
echo "fastest at batch 64: DMX_TOPK_CHUNK=$BEST"
MODES="store:final_logits:topk(64)[DMX_TOPK_CHUNK=$BEST],store:hidden-states,store:final_logits:topk(64)"
[ "$BEST" = 0 ] && MODES="store:hidden-states"
DEADLINE=$((575 - SECONDS)) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh lease "$MODES" 1
