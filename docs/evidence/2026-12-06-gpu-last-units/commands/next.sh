#!/usr/bin/env bash
# The next lease (not run yet), one call after the kit is stashed, repeated (steps once
# per machine via /root/w flags, each only where its limit fits; units resume):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DMI_COMMIT=<this checkout's HEAD> DEADLINE=$((575 - (SECONDS - S0))) bash docs/evidence/2026-12-06-gpu-last-units/commands/next.sh
# 1. the `last` rows' GPU tests (the eager test now reads a prefill-decided row: not run
#    on a GPU yet); 2. FlashInfer's top-k compiled outside any unit's clock (minutes on a
#    fresh machine); 3. three units each of `last` and `topk(64)` with FlashInfer, then
#    `transport:hidden-states` (the side stream on, unserved so far).
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-560}; W=/root/w; mkdir -p "$OUT/logs" "$W"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
left() { echo $((budget - (SECONDS - S))); }
serve=docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh
if [ ! -f "$W/gpu-tests-done" ] && [ "$(left)" -ge 130 ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    timeout 120 bash scripts/gpu-run.sh python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q \
        -p no:cacheprovider -k "last_rows" > "$OUT/logs/gpu-tests.log" 2>&1
    echo "gpu tests rc=$? at $((SECONDS-S)) s"; tail -3 "$OUT/logs/gpu-tests.log"; touch "$W/gpu-tests-done"
fi
if [ ! -f "$W/flashinfer-warm" ] && [ "$(left)" -ge 250 ]; then
    timeout 240 python3 -c "import torch; from dmi_sglang.adapters.transport.topk_flashinfer import warm_up; print('flashinfer warm-up:', warm_up(torch.device('cuda'), 151936, 64, batches=(3, 64)))" \
        > "$OUT/logs/flashinfer-warm.log" 2>&1 && touch "$W/flashinfer-warm"
    echo "flashinfer warm-up at $((SECONDS-S)) s"; tail -2 "$OUT/logs/flashinfer-warm.log"
fi
[ -f "$W/flashinfer-warm" ] || exit 0  # its units would compile inside their clock
: "${MODES:=store:resid_pre:last,store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer]}"
if [ ! -f "$W/selective-done" ] && [ "$(left)" -ge 170 ]; then
    DEADLINE=$(left) bash $serve selective "$MODES" 3
    [ "$(grep -c '  3  ' "$OUT/logs/serving-selective.log")" -ge 2 ] && touch "$W/selective-done"
fi
if [ -f "$W/selective-done" ] && [ "$(left)" -ge 170 ]; then
    DEADLINE=$(left) bash $serve hs 'transport:hidden-states' 3
fi
echo "left $(left) s"
