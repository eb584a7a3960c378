#!/usr/bin/env bash
# On a GPU machine, from the repository root: run one command with what every GPU result
# records under $OUT (default /tmp/out): the installed versions in kit.log, the GPU in
# gpu.txt, harness evidence under $OUT/evidence (DMI_EVIDENCE_DIR).
#   bash scripts/gpu-run.sh python -m harness qualify $OUT/cells
#   bash scripts/gpu-run.sh python -m pytest tests/gpu -m gpu -q
#
# torch, SGLang 0.5.19 and this project must be installed first (docs/gpu.md): with PyPI,
# `pip install '.[sglang]'`; without, `bash scripts/wheelhouse.sh install DIR` (with
# --target PATH, export PYTHONPATH=PATH first). Where .gpu-kit/bin/device-install.sh is
# present (the GPU kit the results under docs/evidence/ were made with, described in
# docs/evidence/2026-11-29-h200-e2e-transport-cli/README.md), it is sourced instead and
# installs the kit and the project wheel.
# The Triton cache is kept in TRITON_CACHE_DIR (default /root/triton-cache where /root is
# writable, else Triton's own default) so that later commands start faster.
set -uo pipefail
if [ -n "$(compgen -e DMI_V0519_)" ]; then  # the original integration's GPU-smoke variables
    "${PYTHON:-python3}" -c 'import os, sys; from harness.__main__ import legacy_problem
sys.exit("gpu-run: " + legacy_problem(dict(os.environ)))'
    exit 2
fi
: "${OUT:=/tmp/out}"
mkdir -p "$OUT"
if [ -f .gpu-kit/bin/device-install.sh ]; then
    source .gpu-kit/bin/device-install.sh > "$OUT/kit.log" 2>&1 || { tail -5 "$OUT/kit.log"; exit 3; }
else
    "${PYTHON:-python3}" -c "import torch, sglang, dmi_sglang, importlib.metadata as md; print('installed: torch', torch.__version__, 'sglang', sglang.__version__, 'dmi-sglang', md.version('dmi-sglang'), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device visible')" > "$OUT/kit.log" 2>&1 \
        || { tail -5 "$OUT/kit.log"; echo "gpu-run: torch, sglang and dmi_sglang must import here first (docs/gpu.md: scripts/wheelhouse.sh install)" >&2; exit 3; }
fi
if [ -z "${TRITON_CACHE_DIR:-}" ] && [ -w /root ]; then export TRITON_CACHE_DIR=/root/triton-cache; fi
export DMI_EVIDENCE_DIR="$OUT/evidence" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$@"
