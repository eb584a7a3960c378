#!/usr/bin/env bash
# One lease call, planned for the next lease (not run yet): the copy-engine benchmark with
# one-ahead pieces, pieces with gap kernels and copy kernels, then two serving cells with the drain settings the
# benchmark suggests (its JSON's figures.suggested_env: the fastest variant that kept the
# small copy's p99 under 1 ms; 2 MiB pieces with 2 ahead, measured in this directory's
# copies.json, when it suggests none).
#   bash docs/evidence/2026-12-04-h200-copy-engine/commands/kernel.sh
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
timeout 150 bash scripts/gpu-run.sh python3 -m harness copies --pieces-mb 8,2 --in-flight 1,2 \
    --gap-pieces-mb 16,8,2 --kernel-programs 8,32,132 --probes 300 --out "$OUT/copies-kernel.json" \
    > "$OUT/logs/copies-kernel.log" 2>&1
echo "copies rc=$? at $((SECONDS-S)) s"; tail -14 "$OUT/logs/copies-kernel.log"
setting=$(python3 -c 'import json, sys
try:
    s = json.load(open(sys.argv[1]))["figures"]["suggested_env"]
except Exception:
    s = None
print(s if s else "DMX_DRAIN_COPY_PIECE_MB=2 DMX_DRAIN_COPY_AHEAD=2")' "$OUT/copies-kernel.json")
echo "serving with: $setting"; echo "$setting" > /root/suggested-drain-env  # for selective.sh
DEADLINE=$((545-(SECONDS-S))) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh kernel \
    "transport:hidden-states[$setting],transport:sglang-full[$setting]" 1
