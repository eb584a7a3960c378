#!/usr/bin/env bash
# Where `last`'s scheduler time goes on the GPU host, one call after the kit is stashed
# (repeated calls resume; each step once per machine, only where its limit fits):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DMI_COMMIT=<this checkout's HEAD> DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-06-gpu-hook-split/commands/split.sh
# 1. the hooks benchmark, busy scheduler (no sleeps between forwards), last and sample 0,
#    with each prefill forward's parts; 2. one served unit of `store:resid_pre:last`, whose
#    timing now splits the hooks' time between decode graph steps and eager forwards;
# 3. the end-to-end GPU tests with the side stream on (the default since 2026-12-06).
# DEVICE=cpu runs step 1 on the CPU only (a dry run of this script).
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-560}; W=${WORK:-/root/w}; mkdir -p "$OUT/logs" "$W"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
left() { echo $((budget - (SECONDS - S))); }
run() { if [ "${DEVICE:-cuda}" = cpu ]; then PYTHONPATH=src:. "${PYTHON:-python3}" "$@"; else bash scripts/gpu-run.sh python3 "$@"; fi; }
if [ ! -f "$W/hooks-done" ] && [ "$(left)" -ge 150 ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    timeout 140 bash -c "$(declare -f run); run -m harness hooks --device ${DEVICE:-cuda} --presets last,sample0,last,sample0 --busy \
        --out $OUT/hooks-busy.json ${HOOKS_ARGS:-}" > "$OUT/logs/hooks-busy.log" 2>&1
    echo "hooks rc=$? at $((SECONDS-S)) s"; grep -v "^ *[0-9]" "$OUT/logs/hooks-busy.log" | head -12; touch "$W/hooks-done"
fi
[ "${DEVICE:-cuda}" = cpu ] && exit 0
if [ ! -f "$W/serve-done" ] && [ "$(left)" -ge 200 ]; then
    DEADLINE=$(left) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh last 'store:resid_pre:last' 1
    touch "$W/serve-done"
fi
if [ ! -f "$W/e2e-done" ] && [ "$(left)" -ge 310 ]; then
    timeout 300 bash scripts/gpu-run.sh python3 -m pytest tests/gpu/test_e2e_qwen3.py -m gpu -q -p no:cacheprovider \
        --basetemp=/tmp/e2e > "$OUT/logs/test_e2e.log" 2>&1; echo "e2e rc=$? at $((SECONDS-S)) s"
    tail -3 "$OUT/logs/test_e2e.log"; touch "$W/e2e-done"
fi
echo "left $(left) s"
