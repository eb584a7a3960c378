#!/usr/bin/env bash
# What ran on the H100 this session (three calls after the kit's 26 stash calls), each
# after `source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;`:
#   call 1: the hooks benchmark with a busy scheduler thread, then serving (resumable)
#   call 2: the same serving command again (it resumed with the units left)
#   call 3: the hooks benchmark with a busy thread at three drain lingers
set -o pipefail
mkdir -p "$OUT/logs"; export TRITON_CACHE_DIR=/root/triton-cache
case "${1:?call 1, 2 or 3}" in
1)  bash scripts/gpu-run.sh python3 -m harness hooks --busy --presets topk64,last,sample0 \
        --out "$OUT/hooks-busy.json" > "$OUT/logs/hooks-busy.log" 2>&1
    DEADLINE=$((565 - SECONDS)) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh a \
        "store:final_logits:topk(64),store:resid_pre:last,store:final_logits:topk(64)[DMX_DRAIN_GIL_SLICE_US=50],transport:hidden-states" 1 ;;
2)  DEADLINE=$((555 - SECONDS)) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh a \
        "store:final_logits:topk(64),store:resid_pre:last,store:final_logits:topk(64)[DMX_DRAIN_GIL_SLICE_US=50],transport:hidden-states" 1 ;;
3)  for L in 30000 60000 100000; do
        DMX_DRAIN_LINGER_US=$L bash scripts/gpu-run.sh python3 -m harness hooks --busy \
            --presets topk64,sample0 --out "$OUT/hooks-busy-linger$L.json" \
            > "$OUT/logs/hooks-busy-linger$L.log" 2>&1
    done ;;
esac
