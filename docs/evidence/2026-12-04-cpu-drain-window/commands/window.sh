#!/usr/bin/env bash
# The transport benchmark's drain (hidden-states and sglang-full, batch 64, Qwen3-0.6B
# widths, 100 decode steps back to back) with the decode window at each size given, on
# CPU, from the repository root:
#   bash docs/evidence/2026-12-04-cpu-drain-window/commands/window.sh 512 2048
set -euo pipefail
out=docs/evidence/2026-12-04-cpu-drain-window/comparison
mkdir -p "$out"
for mb in "$@"; do
    DMX_DRAIN_WINDOW_MB=$mb PYTHONPATH=src:. /usr/bin/time -f "window $mb MiB: minor page faults %R, user %U s, system %S s" \
        .venv/bin/python -m harness transport --device cpu --batches 64 --presets hidden-states \
        --steps 100 --warmup 5 --reps 1 --out "$out/transport-window$mb.json" 2>&1 | tail -n 1
done
