#!/usr/bin/env bash
# Three served units of `store:resid_pre:last`, then one of `transport:hidden-states` (the
# side stream on, the default since 2026-12-06), after the GPU tests of the `last` rows
# (eager forwards through the landing, reads of whole groups, graph replays). One call
# after the kit is stashed, repeated (steps once per machine; units resume from /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DMI_COMMIT=<this checkout's HEAD> DEADLINE=$((575 - (SECONDS - S0))) bash docs/evidence/2026-12-06-gpu-last-units/commands/units.sh
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
if [ ! -f "$W/last-done" ] && [ "$(left)" -ge 170 ]; then
    DEADLINE=$(left) bash $serve last 'store:resid_pre:last' 3
    grep -q "store:resid_pre:last *3 " "$OUT/logs/serving-last.log" && touch "$W/last-done"
fi
if [ -f "$W/last-done" ] && [ "$(left)" -ge 170 ]; then
    DEADLINE=$(left) bash $serve hs 'transport:hidden-states' 1
fi
echo "left $(left) s"
