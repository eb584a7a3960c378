#!/usr/bin/env bash
# On the GPU machine (after the GPU kit's parts were stashed): install the kit and this
# project's wheel, then run the given command from the repository root, logs under $OUT.
#   bash scripts/gpu-run.sh python -m harness qualify $OUT/cells
#   bash scripts/gpu-run.sh python -m pytest tests/gpu -m gpu -q
set -uo pipefail
: "${OUT:=/tmp/out}"
mkdir -p "$OUT"
source .gpu-kit/bin/device-install.sh > "$OUT/kit.log" 2>&1 || { tail -5 "$OUT/kit.log"; exit 3; }
export TRITON_CACHE_DIR=/root/triton-cache DMI_EVIDENCE_DIR="$OUT/evidence" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$@"
