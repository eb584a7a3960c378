#!/usr/bin/env bash
# The hooks benchmark's sglang-full cell at several ring sizes with the drain's stacks
# sampled (--sample) and one more wave profiled (--profile: on Python 3.12 cProfile sees
# every thread, the drain's functions included), one call on the GPU kit's machine:
#   bash docs/evidence/2026-12-04-h200-parts/commands/hooks.sh 1024 16384
mkdir -p "$OUT/logs" "$OUT/comparison"
for mb in "$@"; do
    bash scripts/gpu-run.sh bash -c "PYTHONPATH=src:\$PYTHONPATH timeout 170 python3 -m harness hooks \
        --presets sglang-full --waves 2 --ring-mb $mb --sample --profile \
        --out $OUT/comparison/hooks-full-ring$mb.json" > "$OUT/logs/hooks-full-ring$mb.log" 2>&1
    echo "ring $mb MiB rc=$?"
    tail -n 4 "$OUT/logs/hooks-full-ring$mb.log"
done
