#!/usr/bin/env bash
# Before/after of the owner channel's puts on one machine, alternating:
#   bash docs/evidence/2026-12-07-cpu-one-exchange-puts/commands/ab.sh BEFORE_SRC NAME
# BEFORE_SRC: a copy of src/ at the commit before (git archive 47ba67b src | tar -x -C DIR),
# with this commit's src/dmi_sglang/host_malloc.py added (the harness's channel owner
# imports it; the code measured does not use it). Runs `harness store` with the code of
# BEFORE_SRC, then with this checkout's, writing store-beforeNAME / store-afterNAME.
set -e
before=$1 name=$2
args=(--quick --sizes 262144 --writers 2 --repeat 2 --mb 1000 --batch-mb 80)
PYTHONPATH="$before:." python -m harness store "${args[@]}" --dir "/tmp/hs-before$name" \
    --out "store-before$name.json" > "store-before$name.log" 2>&1
PYTHONPATH=src:. python -m harness store "${args[@]}" --dir "/tmp/hs-after$name" \
    --out "store-after$name.json" > "store-after$name.log" 2>&1
