#!/usr/bin/env bash
# Create (or update) ./.venv with everything the CPU test suite needs: the real
# sglang==0.5.19 with its CPU import set, this project (editable) and the test and lint
# tools. Idempotent; a second run installs nothing new.
#
# `pip install sglang==0.5.19` with its dependencies fails offline (GPU-only placeholder
# packages), so the import-time dependencies come from requirements/sglang-cpu.txt and the
# sglang wheel is installed with --no-deps. See docs/env-setup.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r requirements/sglang-cpu.txt
"${pip[@]}" --no-deps sglang==0.5.19
"${pip[@]}" -e '.[test,lint]'
.venv/bin/python -c "import sglang, torch, chdb, clickhouse_connect; print('dev env ready: sglang', sglang.__version__, 'torch', torch.__version__)"
