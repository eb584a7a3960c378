#!/usr/bin/env bash
# The hooks benchmark's sglang-full cell before (9ea502d) and after (1d3ee60) the row runs,
# on a bare machine (its own torch, no GPU kit: the benchmark needs no SGLang).
# Here, first: the pure-Python dependencies and the old tree, carried as ignored paths:
#   SP=.venv/lib/python3.11/site-packages; mkdir -p .gpu-kit/pure .gpu-kit/old
#   cp -r $SP/attr $SP/attrs $SP/structlog .gpu-kit/pure/
#   git archive 9ea502d src harness | tar -x -C .gpu-kit/old
# Then on the device (carry .gpu-kit/pure and .gpu-kit/old), from the repository root at 1d3ee60:
mkdir -p "$OUT/logs"; export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
PYTHONPATH=.gpu-kit/pure:src timeout 55 python3 -m harness hooks --presets sglang-full --waves 1 \
    --out "$OUT/hooks-full-after.json" > "$OUT/logs/hooks-full-after.log" 2>&1
(cd .gpu-kit/old && PYTHONPATH=../pure:src timeout 55 python3 -m harness hooks --presets sglang-full \
    --waves 1 --out "$OUT/hooks-full-before.json" > "$OUT/logs/hooks-full-before.log" 2>&1)
# The JSONs and logs were then put under ../comparison/ (harness docs does not show them).
