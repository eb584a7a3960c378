#!/usr/bin/env bash
# Served units after the GPU tests of the `last` rows (eager forwards, reads of whole
# groups, graph replays): REPEATS (3) units of each of MODES (default
# 'store:resid_pre:last'), then HS_REPEATS (1) of `transport:hidden-states` (the side
# stream on, the default since 2026-12-06). FLASHINFER=1 first compiles FlashInfer's
# top-k outside any unit's clock (minutes on a fresh machine), for MODES that use it.
# One call after the kit is stashed, repeated (steps once per machine; units resume from
# /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DMI_COMMIT=<this checkout's HEAD> DEADLINE=$((540 - (SECONDS - S0))) bash docs/evidence/2026-12-06-gpu-last-units/commands/units.sh
# (575 ran here; 540 since ../../2026-12-06-h100-selective-noisy-host/: the harness may
# end a few tens of seconds past its deadline, and the device ends a call at 600 s)
# EXTRA_MODES: one unit each, after MODES' units and before hidden-states (HS_REPEATS=0:
# none of those). What ran here: the command as written. Later leases set the variables
# (their evidence READMEs give them), e.g.
#   FLASHINFER=1 NAME=selective HS_REPEATS=0 MODES='store:resid_pre:last,store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer]' EXTRA_MODES='store:resid_pre@0:last' DMI_COMMIT=... DEADLINE=... bash .../units.sh
# GPU_TESTS=0 (added for ../../2026-12-06-h100-stop-halved/) leaves out the GPU tests,
# for a lease after which the code they cover did not change; 1, the default, runs them.
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-540}; W=/root/w; mkdir -p "$OUT/logs" "$W"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
: "${MODES:=store:resid_pre:last}" "${NAME:=last}" "${REPEATS:=3}" "${HS_REPEATS:=1}"
left() { echo $((budget - (SECONDS - S))); }
serve=docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh
all_units() {  # every cell of serving-$1.json has $2 units
    python3 -c "import json, sys; rows = json.load(open(sys.argv[1]))['summary']
sys.exit(0 if rows and all(r['units'] >= int(sys.argv[2]) for r in rows) else 1)" \
        "$OUT/serving-$1.json" "$2" 2>/dev/null
}
if [ "${GPU_TESTS:-1}" = 1 ] && [ ! -f "$W/gpu-tests-done" ] && [ "$(left)" -ge 130 ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    timeout 120 bash scripts/gpu-run.sh python3 -m pytest tests/transport/test_transport_gpu.py -m gpu -q \
        -p no:cacheprovider -k "last_rows" > "$OUT/logs/gpu-tests.log" 2>&1
    echo "gpu tests rc=$? at $((SECONDS-S)) s"; tail -3 "$OUT/logs/gpu-tests.log"; touch "$W/gpu-tests-done"
fi
if [ "${FLASHINFER:-0}" = 1 ] && [ ! -f "$W/flashinfer-warm" ]; then
    [ "$(left)" -ge 250 ] || exit 0  # its units would compile inside their clock
    timeout 240 python3 -c "import torch; from dmi_sglang.adapters.transport.topk_flashinfer import warm_up; print('flashinfer warm-up:', warm_up(torch.device('cuda'), 151936, 64, batches=(3, 64)))" \
        > "$OUT/logs/flashinfer-warm.log" 2>&1 && touch "$W/flashinfer-warm"
    echo "flashinfer warm-up at $((SECONDS-S)) s"; tail -2 "$OUT/logs/flashinfer-warm.log"
    [ -f "$W/flashinfer-warm" ] || exit 0
fi
if [ ! -f "$W/$NAME-done" ] && [ "$(left)" -ge 170 ]; then
    DEADLINE=$(left) bash $serve "$NAME" "$MODES" "$REPEATS"
    all_units "$NAME" "$REPEATS" && touch "$W/$NAME-done"
fi
if [ -n "${EXTRA_MODES:-}" ] && [ -f "$W/$NAME-done" ] && [ ! -f "$W/$NAME-extra-done" ] && [ "$(left)" -ge 170 ]; then
    DEADLINE=$(left) bash $serve "$NAME-extra" "$EXTRA_MODES" 1  # one unit each, after the cells
    all_units "$NAME-extra" 1 && touch "$W/$NAME-extra-done"
fi
if [ "$HS_REPEATS" -gt 0 ] && [ -f "$W/$NAME-done" ] && [ "$(left)" -ge 170 ]; then
    DEADLINE=$(left) bash $serve hs 'transport:hidden-states' "$HS_REPEATS"
fi
echo "left $(left) s"
