#!/usr/bin/env bash
# Lease call 2: the serving GPU tests, then the Ctrl-C test in a loop until 420 s.
set -o pipefail
S=$SECONDS; mkdir -p "$OUT/logs" "$OUT/stacks" "$OUT/loop"
export PYTHONPATH=/opt/dmi-site TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
timeout 330 bash scripts/gpu-run.sh python3 -m pytest tests/gpu/test_serving.py -m gpu -q -s -p no:cacheprovider --basetemp=/tmp/c2 > "$OUT/logs/test_serving.log" 2>&1
echo "test_serving rc=$? at $((SECONDS-S)) s"; tail -4 "$OUT/logs/test_serving.log"
find /tmp/c2 -name 'stacks-*.txt' -size +0 -exec cp {} "$OUT/stacks/" \; 2>/dev/null
for i in 1 2 3 4 5 6 7 8; do
  [ $((SECONDS-S)) -lt 420 ] || break
  T=$SECONDS; rm -f "$OUT/evidence/serve-ctrl-c.json"
  timeout 160 bash scripts/gpu-run.sh python3 -m pytest tests/gpu/test_serving.py -m gpu -q -s -p no:cacheprovider -k ctrl_c --basetemp=/tmp/l$i > "$OUT/logs/loop-try$i.log" 2>&1
  echo "try$i rc=$? in $((SECONDS-T)) s"; cp "$OUT/evidence/serve-ctrl-c.json" "$OUT/loop/try$i.json" 2>/dev/null
  mkdir -p "$OUT/stacks/try$i"; find /tmp/l$i -name 'stacks-*.txt' -size +0 -exec cp {} "$OUT/stacks/try$i/" \; 2>/dev/null
done
ls "$OUT/evidence"
