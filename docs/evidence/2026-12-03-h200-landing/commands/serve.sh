#!/usr/bin/env bash
# One serving cell per lease call: bash serve.sh NAME MODE [--env DMX_...=...]
# e.g. bash docs/evidence/<dir>/commands/serve.sh last store:resid_pre:last
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"; name=$1; mode=$2; shift 2
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1 DMI_HARNESS_DEADLINE_S=${DEADLINE:-380}
bash scripts/gpu-run.sh python3 -m harness serving --modes "$mode" --repeats 1 "$@" --out "$OUT/serving-$name.json" --work "/root/w-$name" > "$OUT/logs/serving-$name.log" 2>&1
echo "serving rc=$? at $((SECONDS-S)) s"; tail -25 "$OUT/logs/serving-$name.log"
