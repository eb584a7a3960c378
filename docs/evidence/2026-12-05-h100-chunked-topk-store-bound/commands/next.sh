#!/usr/bin/env bash
# Planned for the next lease (not run yet), after `source .gpu-kit/bin/device-install.sh
# > $OUT/kit.log 2>&1 || exit 3;`: the store owner's write channel through its socket
# against a shared ring (python -m harness store: the channel alone and a whole ingest
# through the owner, 1 MiB records), then store:hidden-states served without and with
# DMX_OWNER_RING_MB=1024 (one unit each; resumable: call it again until the serving log
# says no unit is left). The serving log now names each busiest thread (its OS name:
# dmi-capture-dra, dmi-sink-N, dmi-store-write, ZMQbg/IO/0, ThreadPool, ...).
set -o pipefail
mkdir -p "$OUT/logs" /root/w; export TRITON_CACHE_DIR=/root/triton-cache
if [ ! -s /root/w/store.json ]; then
    bash scripts/gpu-run.sh python3 -m harness store --mb 4096 --sizes 1048576 --writers 4 \
        --repeat 2 --probe-mb 1024 --readback 4,32,32 --export 8,6 --dir /root/w \
        --out /root/w/store.json > /root/w/store.log 2>&1 || { tail -20 /root/w/store.log; exit 4; }
fi
cp /root/w/store.json /root/w/store.log "$OUT/"; grep -v "\[info\|\[warn" /root/w/store.log | tail -20
DEADLINE=$((575 - SECONDS)) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh ring \
    "store:hidden-states,store:hidden-states[DMX_OWNER_RING_MB=1024]" 1
