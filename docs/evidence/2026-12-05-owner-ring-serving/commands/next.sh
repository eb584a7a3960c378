#!/usr/bin/env bash
# Planned for the next lease (not run yet), after `S0=$SECONDS; source
# .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;` with
# CALL_S=$((560 - (SECONDS - S0))) exported. Resumable: call it again until it says done.
#  1. python -m harness store on the GPU host (no GPU needed, 16 cores): 4 writers,
#     inserts of a quarter of the queue (256 MiB, the default) against 128 MiB.
#  2. store:hidden-states served: the default (1024 MiB queue, 256 MiB inserts: four
#     writers in flight fill the queue), inserts of 128 MiB (half the queue waits behind
#     the inserts in flight), and a 2048 MiB queue; one unit each. The serving log prints
#     each unit's sink waits (inserting, idle with nothing queued, idle with a partial
#     insert, put blocked).
set -o pipefail
mkdir -p "$OUT/logs" /root/w; export TRITON_CACHE_DIR=/root/triton-cache
for mb in 0 128; do
    [ -s /root/w/store-$mb.json ] && continue
    bash scripts/gpu-run.sh python3 -m harness store --mb 4096 --sizes 1048576 --writers 4 \
        --insert-mb $mb --repeat 2 --probe-mb 1024 --readback 4,32,32 --export 8,6 \
        --dir /root/w/store --out /root/w/store-$mb.json > /root/w/store-$mb.log 2>&1 \
        || { tail -20 /root/w/store-$mb.log; exit 4; }
    rm -rf /root/w/store
done
cp /root/w/store-*.json /root/w/store-*.log "$OUT/"
left=$((${CALL_S:-560} - SECONDS))
[ "$left" -lt 300 ] && { echo "left for the next call: serving"; exit 0; }
DEADLINE=$left bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh queue \
    "store:hidden-states,store:hidden-states[DMX_CH_INSERT_MB=128],store:hidden-states[DMX_CH_QUEUE_MB=2048]" 1 \
    | tee /root/w/serve-queue.txt
grep -q "serving rc=0 " /root/w/serve-queue.txt && echo "all done" || echo "left for the next call: serving"
