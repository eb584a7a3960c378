#!/usr/bin/env bash
# Where sglang-full's drain thread spends its CPU on a GPU, and what it costs a busy
# scheduler-like thread (python -m harness hooks: no SGLang, no model). One call after
# the kit is stashed:
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DMI_COMMIT=<HEAD> DEADLINE=$((540 - (SECONDS - S0))) bash docs/evidence/2026-12-07-drain-diagnostics/commands/diag.sh
# Steps already done on this machine (marker files under /root/wd) are skipped, so a
# repeated call goes on where the last one stopped.
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-540}; W=/root/wd; mkdir -p "$OUT/logs" "$W"
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
left() { echo $((budget - (SECONDS - S))); }
nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
step() {  # step NAME SECONDS ARGS...: one hooks run, skipped when done or out of time
    local name=$1 secs=$2; shift 2
    [ -f "$W/$name-done" ] && return 0
    [ "$(left)" -ge "$secs" ] || { echo "$name: $(left) s left, needs $secs"; return 0; }
    timeout "$secs" bash scripts/gpu-run.sh python3 -m harness hooks "$@" \
        --out "$OUT/hooks-$name.json" > "$OUT/logs/hooks-$name.log" 2>&1
    local rc=$?; echo "$name rc=$rc at $((SECONDS - S)) s"
    grep -v "warning" "$OUT/logs/hooks-$name.log" | tail -4
    [ $rc = 0 ] && touch "$W/$name-done"
}
step profile 200 --presets sglang-full,hidden-states --waves 2 --profile
step busy 200 --presets sglang-full,hidden-states --busy
step sample 160 --presets sglang-full --waves 2 --sample
echo "left $(left) s"
