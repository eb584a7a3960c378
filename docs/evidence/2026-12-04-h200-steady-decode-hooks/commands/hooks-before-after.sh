#!/usr/bin/env bash
# The hooks benchmark (hidden-states, last, sample0; three timed waves) of the tree before
# the steady-decode change (before: e9386c7) and after it (eef0590), one call on the GPU
# kit's machine. Here, first: the old tree, carried as an ignored path:
#   mkdir -p .gpu-kit/old && git archive e9386c7 src harness | tar -x -C .gpu-kit/old
# Then on the device (carry .gpu-kit/bin, .gpu-kit/project, .gpu-kit/old), from the root:
mkdir -p "$OUT/logs"
bash scripts/gpu-run.sh bash -c '
for round in 1 2; do
PYTHONPATH=src:$PYTHONPATH timeout 100 python3 -m harness hooks --presets last,sample0,hidden-states \
    --out "$OUT/hooks-after-$round.json" > "$OUT/logs/hooks-after-$round.log" 2>&1
echo "after $round rc=$?"
(cd .gpu-kit/old && PYTHONPATH=src:$PYTHONPATH timeout 100 python3 -m harness hooks \
    --presets last,sample0,hidden-states --out "$OUT/hooks-before-$round.json" \
    > "$OUT/logs/hooks-before-$round.log" 2>&1)
echo "before $round rc=$?"
done'
grep -h -E "^ *(last|sample0|hidden-states) " "$OUT"/logs/hooks-*.log
