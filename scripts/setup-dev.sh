#!/usr/bin/env bash
# Create (or update) ./.venv with everything the CPU test suite needs: the real
# sglang==0.5.19 with its CPU import set, this project (editable) and the test and lint
# tools. Every tox environment runs in this .venv too (tox.ini).
#
# `pip install sglang==0.5.19` with its dependencies fails offline (GPU-only placeholder
# packages), so the import-time dependencies come from requirements/sglang-cpu.txt and the
# sglang wheel is installed with --no-deps. Size and time: docs/env-setup.md.
#
# Each step prints one line with the seconds since start; while pip unpacks, a line every
# 20 s gives the size of .venv so far. A run whose inputs (requirements/sglang-cpu.txt,
# pyproject.toml, this script) have not changed since the last complete run installs
# nothing and only checks the imports; delete .venv/.setup-dev-inputs to force a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=.venv/.setup-dev-inputs

step() { printf '[setup-dev %4ss] %s\n' "$SECONDS" "$*"; }

heartbeat=
stop_heartbeat() {
    if [ -n "$heartbeat" ]; then kill "$heartbeat" 2>/dev/null || true; wait "$heartbeat" 2>/dev/null || true; fi
    heartbeat=
}
trap stop_heartbeat EXIT

pip_step() {  # pip_step DESCRIPTION PIP-INSTALL-ARGS...
    local what=$1
    shift
    step "$what"
    (while sleep 20 </dev/null >/dev/null 2>&1; do step "  ... .venv holds $(du -sm .venv | cut -f1) MB"; done) &
    heartbeat=$!
    .venv/bin/python -m pip install --disable-pip-version-check "$@"
    stop_heartbeat
}

inputs=$(cat requirements/sglang-cpu.txt pyproject.toml scripts/setup-dev.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
    step ".venv is up to date (inputs unchanged since the last complete run); checking imports"
else
    if [ ! -x .venv/bin/python ]; then
        step "creating .venv with $("$PY" --version 2>&1)"
        "$PY" -m venv .venv
    fi
    rm -f "$stamp"
    pip_step "1/3 sglang 0.5.19's CPU import set (requirements/sglang-cpu.txt; torch is several GB)" \
        -r requirements/sglang-cpu.txt
    pip_step "2/3 sglang==0.5.19 (--no-deps)" --no-deps sglang==0.5.19
    pip_step "3/3 this project, editable, with [test,lint]" -e '.[test,lint]'
    echo "$inputs" > "$stamp"
fi
.venv/bin/python -c "import sglang, torch, chdb, clickhouse_connect; print('dev env ready: sglang', sglang.__version__, 'torch', torch.__version__)"
step "done: .venv holds $(du -sm .venv | cut -f1) MB"
