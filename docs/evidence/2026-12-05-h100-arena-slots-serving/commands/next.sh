#!/usr/bin/env bash
# Planned for the next lease (not run yet), after `source .gpu-kit/bin/device-install.sh
# > $OUT/kit.log 2>&1 || exit 3;`: the top-k selection alone (torch.topk against
# chunked_topk per chunk width), the capture's graph with the fastest chunk width at
# batch 64, then topk(64) served with and without it (resumable: call it again until the
# serving log says no unit is left).
set -o pipefail
mkdir -p "$OUT/logs"; export TRITON_CACHE_DIR=/root/triton-cache
if [ ! -s "$OUT/topk.json" ]; then
    bash scripts/gpu-run.sh python3 -m harness topk --out "$OUT/topk.json" > "$OUT/logs/topk.log" 2>&1
    cat "$OUT/logs/topk.log"
fi
BEST=$(python3 -c '
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["figures"]["rows"] if r["batch"] == 64]
best = min(rows, key=lambda r: r["us"])
print(best["variant"].removeprefix("chunked ") if best["variant"] != "torch.topk" else 0)
' "$OUT/topk.json") || exit 4
echo "fastest at batch 64: DMX_TOPK_CHUNK=$BEST"
[ "$BEST" = 0 ] && exit 0  # torch.topk itself is fastest: nothing to serve
DMX_TOPK_CHUNK=$BEST bash scripts/gpu-run.sh python3 -m harness hooks --presets topk64 \
    --out "$OUT/hooks-topk-chunk$BEST.json" > "$OUT/logs/hooks-topk-chunk$BEST.log" 2>&1
sed -n 1,3p "$OUT/logs/hooks-topk-chunk$BEST.log"
DEADLINE=$((560 - SECONDS)) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh topk \
    "store:final_logits:topk(64),store:final_logits:topk(64)[DMX_TOPK_CHUNK=$BEST]" 2
