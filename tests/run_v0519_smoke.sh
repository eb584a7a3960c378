#!/usr/bin/env bash
# GPU qualification of dmi-sglang on SGLang 0.5.19 (the H200 machine, GPU kit installed):
# stock and monitored engines in separate processes over named cells, one JSON per cell.
#
#   bash scripts/gpu-run.sh bash tests/run_v0519_smoke.sh $OUT/cells
#   DMI_V0519_CELLS=8b-graph-hidden bash scripts/gpu-run.sh bash tests/run_v0519_smoke.sh $OUT/cells
#   PYTHON=.venv/bin/python bash tests/run_v0519_smoke.sh --dry-run   # the plan only (no GPU)
#   bash tests/run_v0519_smoke.sh --list             # the cells
#
# Cells: DMI_V0519_CELLS (comma-separated names or core / optional / all; default core).
# A device command may run 10 minutes: cells that do not fit are skipped (exit status 3)
# and the same command continues in the next call (results and stock baselines are kept
# in /root/dmi-v0519-state while the machine stays lent). Exit 0: every cell passed;
# 1: a cell failed; 2: usage; 3: incomplete, run again. See tests/gpu/qualify.py.
# Pass DMI_COMMIT=<sha> (the commit whose working tree the device call carries): the device
# copy may have no .git, or one whose HEAD lags the tree; DMI_COMMIT wins and git's HEAD is
# kept as git_head (saved results are keyed by commit and a hash of the code anyway).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/.."
PY="${PYTHON:-python3}"

# When the 10-minute call started: scripts/gpu-run.sh (our parent) started with it.
if [ -z "${DMI_CALL_STARTED_EPOCH:-}" ]; then
  parent_age=$(ps -o etimes= -p "$PPID" 2>/dev/null | tr -d ' ')
  if [[ "$parent_age" =~ ^[0-9]+$ ]] && [ "$parent_age" -lt 600 ]; then
    export DMI_CALL_STARTED_EPOCH=$(( $(date +%s) - parent_age ))
  else
    export DMI_CALL_STARTED_EPOCH=$(date +%s)
  fi
fi

case "${1:-}" in
  --dry-run|--list|-h|--help)
    exec "$PY" tests/gpu/qualify.py "$@" ;;
esac
results="${1:-${OUT:-.}/cells}"
[ $# -gt 0 ] && shift
mkdir -p "$results" || exit 2

"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA device'" \
  || { echo "run_v0519_smoke: sglang with a CUDA device is required (GPU kit installed?)" >&2; exit 2; }
commit=${DMI_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo "unknown (no .git here: pass DMI_COMMIT=<sha>)")}
echo "run_v0519_smoke: commit $commit"
echo "run_v0519_smoke: cells=${DMI_V0519_CELLS:-core} results=$results" \
     "call started $(( $(date +%s) - DMI_CALL_STARTED_EPOCH )) s ago"
"$PY" tests/gpu/qualify.py "$results" "$@"
status=$?
echo "run_v0519_smoke: exit status $status (0 passed, 1 failed, 3 incomplete: run again)"
exit $status
