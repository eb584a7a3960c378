#!/usr/bin/env bash
# Lease call 1: unpack the stashed wheelhouse, install it (scripts/wheelhouse.sh), run the
# README main job with it, then the serving Ctrl-C test once.
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs"
echo "chunks stashed: $(ls /root/wh-chunks | wc -l)"
[ "$(cat /root/wh-chunks/chunk-* | sha256sum | cut -d' ' -f1)" = "$(cut -d' ' -f1 .whx/bin/SHA)" ] || { echo "chunks: sha mismatch"; exit 3; }
rm -rf /root/wh && cat /root/wh-chunks/chunk-* | tar -C /root -xf - || exit 3
echo "unpacked /root/wh at $((SECONDS-S)) s: $(ls /root/wh | wc -l) files, $(du -sh /root/wh | cut -f1)"
python3 --version; python3 -c "import torch; print('host torch before install', torch.__version__)" 2>&1
bash scripts/wheelhouse.sh install /root/wh --target /opt/dmi-site > "$OUT/logs/install.log" 2>&1; rc=$?
tail -8 "$OUT/logs/install.log"; echo "install rc=$rc at $((SECONDS-S)) s"; [ $rc = 0 ] || exit 4
export PYTHONPATH=/opt/dmi-site TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
T=$SECONDS; bash scripts/gpu-run.sh bash scripts/main-job.sh > "$OUT/logs/main-job.log" 2>&1; rc=$?
echo "main-job rc=$rc in $((SECONDS-T)) s (at $((SECONDS-S)) s)"; tail -30 "$OUT/logs/main-job.log"
cp "$OUT/kit.log" "$OUT/logs/kit-call1.log" 2>/dev/null
[ $((SECONDS-S)) -lt 430 ] || exit 0
T=$SECONDS; timeout 160 bash scripts/gpu-run.sh python3 -m pytest tests/gpu/test_serving.py -m gpu -q -s -p no:cacheprovider -k ctrl_c --basetemp=/tmp/c1 > "$OUT/logs/call1-ctrl_c.log" 2>&1
echo "ctrl_c rc=$? in $((SECONDS-T)) s"; tail -4 "$OUT/logs/call1-ctrl_c.log"
mkdir -p "$OUT/stacks"; find /tmp/c1 -name 'stacks-*.txt' -size +0 -exec cp {} "$OUT/stacks/" \; 2>/dev/null
ls "$OUT/evidence" 2>/dev/null
