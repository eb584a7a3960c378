#!/usr/bin/env bash
# On the H200 machine (after the GPU kit's parts were stashed): install the kit and this
# project's wheel, then run the given command with logs under $OUT.
#   bash scripts/gpu-run.sh python -m pytest tests/gpu -m gpu -q
set -uo pipefail
: "${OUT:=/tmp/out}"
mkdir -p "$OUT"
source .gpu-kit/bin/device-install.sh > "$OUT/kit.log" 2>&1 || { tail -5 "$OUT/kit.log"; exit 3; }
# py-spy (bench_serving.py --profile-seconds) comes with the kit as a wheel whose binary
# lands in /tmp/site/bin, which installing this project's wheel into the same --target
# replaces: unpack the binary from the kit's payload where it is missing.
if ! command -v py-spy > /dev/null; then
  mkdir -p /tmp/py-spy-bin
  spy_wheel=$(ls /tmp/gpu-kit-payload/py_spy-*.whl 2>/dev/null | head -1)
  if [ -n "$spy_wheel" ] && python3 - "$spy_wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith("/py-spy"))
    with open("/tmp/py-spy-bin/py-spy", "wb") as out:
        out.write(wheel.read(name))
PY
  then chmod +x /tmp/py-spy-bin/py-spy
  else echo "gpu-run: py-spy is not on PATH and could not be unpacked from the kit" \
            "(--profile-seconds will report it missing)" >&2; fi
  export PATH="/tmp/py-spy-bin:$PATH"
fi
export TRITON_CACHE_DIR=/root/triton-cache DMI_EVIDENCE_DIR="$OUT/evidence" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
"$@"
