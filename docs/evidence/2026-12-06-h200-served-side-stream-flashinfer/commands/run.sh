#!/usr/bin/env bash
# One lease call, after the kit is stashed (repeat it; units resume from /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-06-h200-served-side-stream-flashinfer/commands/run.sh
# The plan of docs/evidence/2026-12-05-gpu-flashinfer-topk/commands/run.sh (the top-k GPU
# tests once, FlashInfer's compile among them), with the served units in this order.
: "${MODES:=store:resid_pre:last[DMX_GRAPH_SIDE_STREAM=1],store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer],store:final_logits:topk(64),store:resid_pre:last,store:hidden-states}"
export MODES
exec bash docs/evidence/2026-12-05-gpu-flashinfer-topk/commands/run.sh
