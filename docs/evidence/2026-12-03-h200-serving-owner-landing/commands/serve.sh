#!/usr/bin/env bash
# Serving cells in one lease call: bash serve.sh NAME MODES REPEATS [harness serving args]
# e.g. DEADLINE=560 bash docs/evidence/<dir>/commands/serve.sh a 'store:resid_pre:last,transport:hidden-states' 1
# Units already measured on this machine (harness state under /root) are reused.
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"; name=$1; modes=$2; reps=$3; shift 3
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1 DMI_HARNESS_DEADLINE_S=${DEADLINE:-560}
nproc > "$OUT/logs/host.txt"; free -g >> "$OUT/logs/host.txt"
bash scripts/gpu-run.sh python3 -m harness serving --modes "$modes" --repeats "$reps" "$@" --out "$OUT/serving-$name.json" --work /root/w > "$OUT/logs/serving-$name.log" 2>&1
echo "serving rc=$? at $((SECONDS-S)) s"; tail -25 "$OUT/logs/serving-$name.log"
