#!/usr/bin/env bash
# One lease call: the copy-engine benchmark with copy kernels, then two serving cells with
# the drain's copies made by the kernel (DMX_DRAIN_COPY_KERNEL=N, N picked from the
# benchmark: the fewest programs whose small-copy p99 on the device stays under 1 ms and
# whose rate is within 80 % of the best kernel's; without a working kernel, 2 MiB pieces
# with 2 ahead instead).  bash docs/evidence/2026-12-04-h200-copy-engine/commands/kernel.sh
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
timeout 150 bash scripts/gpu-run.sh python3 -m harness copies --pieces-mb 8,2 --in-flight 1,2 \
    --kernel-programs 8,32,132 --probes 300 --out "$OUT/copies-kernel.json" \
    > "$OUT/logs/copies-kernel.log" 2>&1
echo "copies rc=$? at $((SECONDS-S)) s"; tail -12 "$OUT/logs/copies-kernel.log"
setting=$(python3 - "$OUT/copies-kernel.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    rows = d["figures"]["rows"][1:]
    intact = d["checks"]["bulk_copies_intact"]["per_variant"]
except Exception:
    rows, intact = [], []
ok = [r for r, good in zip(rows, intact) if good and r.get("kernel_programs")
      and r["bulk_gbps"] and r["device_p99_us"] is not None and r["device_p99_us"] < 1000]
best = max((r["bulk_gbps"] for r in ok), default=0)
pick = [r for r in ok if r["bulk_gbps"] >= 0.8 * best]
print(f"DMX_DRAIN_COPY_KERNEL={min(r['kernel_programs'] for r in pick)}" if pick
      else "DMX_DRAIN_COPY_PIECE_MB=2 DMX_DRAIN_COPY_AHEAD=2")
PY
)
echo "serving with: $setting"
DEADLINE=$((545-(SECONDS-S))) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh kernel \
    "transport:hidden-states[$setting],transport:sglang-full[$setting]" 1
