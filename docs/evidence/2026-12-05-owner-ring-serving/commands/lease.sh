#!/usr/bin/env bash
# One lease call (after `source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;`);
# call it again until it says "all done": state lives under /root/w, so each call resumes.
#  1. python -m harness store on the GPU host: the store owner's write channel through its
#     socket against a shared ring, alone and in a whole ingest (1 MiB records, 4 writers).
#  2. store:hidden-states served without and with DMX_OWNER_RING_MB=1024 (one unit each).
#  3. topk(64) and resid_pre:last served, one unit each, with the threads' OS names
#     (the serving log names the monitored side's busiest threads).
set -o pipefail
mkdir -p "$OUT/logs" /root/w; export TRITON_CACHE_DIR=/root/triton-cache
serve=docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh
if [ ! -s /root/w/store.json ]; then
    bash scripts/gpu-run.sh python3 -m harness store --mb 4096 --sizes 1048576 --writers 4 \
        --repeat 2 --probe-mb 1024 --readback 4,32,32 --export 8,6 --dir /root/w/store \
        --out /root/w/store.json > /root/w/store.log 2>&1 || { tail -20 /root/w/store.log; exit 4; }
    rm -rf /root/w/store
fi
cp /root/w/store.json /root/w/store.log "$OUT/"; grep -v "\[info\|\[warn" /root/w/store.log | tail -24
for cell in "ring|store:hidden-states,store:hidden-states[DMX_OWNER_RING_MB=1024]" \
            "sel|store:final_logits:topk(64),store:resid_pre:last"; do
    name=${cell%%|*}; modes=${cell#*|}
    [ -e "/root/w/done-$name" ] && { cp /root/w/serving-$name.* "$OUT/" 2>/dev/null; continue; }
    left=$((${CALL_S:-580} - SECONDS))
    [ "$left" -lt 300 ] && { echo "left for the next call: $name"; exit 0; }
    DEADLINE=$left bash "$serve" "$name" "$modes" 1 | tee /root/w/serve-$name.txt
    cp "$OUT/serving-$name.json" "$OUT/logs/serving-$name.log" /root/w/ 2>/dev/null
    grep -q "serving rc=0 " /root/w/serve-$name.txt && touch "/root/w/done-$name"
    [ -e "/root/w/done-$name" ] || { echo "left for the next call: $name"; exit 0; }
done
echo "all done"
