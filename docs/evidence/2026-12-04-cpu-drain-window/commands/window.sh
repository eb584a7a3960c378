#!/usr/bin/env bash
# The transport benchmark's drain (hidden-states and sglang-full, batch 64, Qwen3-0.6B
# widths, 400 decode steps back to back) with the decode window at each size given, on
# CPU, from the repository root; /usr/bin/time's line for each run goes to logs/:
#   bash docs/evidence/2026-12-04-cpu-drain-window/commands/window.sh 512 2048
set -euo pipefail
dir=docs/evidence/2026-12-04-cpu-drain-window
mkdir -p "$dir/comparison" "$dir/logs"
for mb in "$@"; do
    DMX_DRAIN_WINDOW_MB=$mb PYTHONPATH=src:. /usr/bin/time -o "$dir/logs/time-window$mb.txt" \
        -f "window $mb MiB: minor page faults %R, user %U s, system %S s, wall %e s" \
        .venv/bin/python -m harness transport --device cpu --batches 64 --presets hidden-states \
        --steps 400 --warmup 5 --reps 1 --out "$dir/comparison/transport-window$mb.json" \
        > "$dir/logs/transport-window$mb.log" 2>&1
    cat "$dir/logs/time-window$mb.txt"
done
