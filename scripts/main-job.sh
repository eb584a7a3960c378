#!/usr/bin/env bash
# The main job: install dmi-sglang with SGLang 0.5.19 into ./.venv-gpu, write a small
# random-weight Qwen3 checkpoint, capture a monitored generation into the embedded store
# (./dmi-captures; no server to start) and show what was captured.
#
# Needs an NVIDIA GPU; without one it says so in one line and exits 3. Where SGLang
# 0.5.19 is already importable (e.g. the H200 GPU kit), nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "dmi-sglang: the main job needs an NVIDIA GPU and none is visible here (the CPU test suite runs without one: see README)" >&2
    exit 3
fi
PY=python3
if ! "$PY" -c "import sglang, dmi_sglang" >/dev/null 2>&1; then
    [ -x .venv-gpu/bin/python ] || "$PY" -m venv .venv-gpu
    .venv-gpu/bin/python -m pip install --quiet -e '.[sglang]'
    PY=.venv-gpu/bin/python
fi
dmi() { "$PY" -m dmi_sglang.app.cli "$@"; }
[ -f qwen3-demo/config.json ] || dmi demo-model qwen3-demo
dmi capture --model qwen3-demo --prompts examples/prompts.txt --max-new-tokens 16 \
    --attention-backend triton --mem-fraction-static 0.3
dmi ls
