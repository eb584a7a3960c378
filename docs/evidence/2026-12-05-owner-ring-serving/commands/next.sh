#!/usr/bin/env bash
# Planned for the next lease (not run yet), after `S0=$SECONDS; source
# .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;` with
# CALL_S=$((560 - (SECONDS - S0))) exported: store:hidden-states with the default queue
# (1024 MiB: four 256 MB inserts in flight fill it) against a 2048 MiB queue (half of it
# waits behind the inserts in flight), one unit each; the serving log prints each unit's
# sink waits (inserting, idle with nothing queued, idle with a partial insert, put blocked).
# Resumable: call it again until the serving log says no unit is left.
set -o pipefail
mkdir -p "$OUT/logs" /root/w; export TRITON_CACHE_DIR=/root/triton-cache
DEADLINE=$((${CALL_S:-560} - SECONDS)) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh queue \
    "store:hidden-states,store:hidden-states[DMX_CH_QUEUE_MB=2048]" 1
