#!/usr/bin/env bash
# Where the hooks' layout part goes on the H200 host: the steady decode layout timed warm
# (200,000 calls), then the hooks benchmark's cProfile of one more wave (sample 0).
# On the device (carry .gpu-kit/bin, .gpu-kit/project), from the root, after the kit install.
mkdir -p "$OUT/logs"
bash scripts/gpu-run.sh bash -c '
PYTHONPATH=src:.:$PYTHONPATH python3 - <<PY > "$OUT/logs/layout-warm.log" 2>&1
import sys, timeit, torch
from harness.micro_hooks import _ForwardBatch
from dmi_sglang.adapters.sglang_v0519 import batch
rids = [f"wave001-req{i:03d}-last" for i in range(64)]
fbs = iter([_ForwardBatch("DECODE", rids, torch.full((64,), 300 + i)) for i in range(200001)])
batch.layout_from_forward_batch(next(fbs))
n = 200000
print(sys.version)
print("steady layout us", timeit.timeit(lambda: batch.layout_from_forward_batch(next(fbs)), number=n) / n * 1e6)
t = torch.full((64,), 300)
print("tolist us", timeit.timeit(t.tolist, number=n) / n * 1e6)
PY
PYTHONPATH=src:.:$PYTHONPATH timeout 100 python3 -m harness hooks --presets sample0,last --waves 1 --profile \
    --out "$OUT/hooks-profile.json" > "$OUT/logs/hooks-profile.log" 2>&1'
cat "$OUT/logs/layout-warm.log"; grep -A 22 "profile of one more wave: last" "$OUT/logs/hooks-profile.log"
