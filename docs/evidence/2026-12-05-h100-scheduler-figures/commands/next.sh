#!/usr/bin/env bash
# Planned for the next lease (not run yet): the targets' cells with the code since this
# lease (arena slots up to 32: the drain wakes when its linger ends), topk(64) first (the
# cell the change is for), three units each; call it until it reports no unit left (it
# resumes with the units measured on the same machine):
#   bash docs/evidence/2026-12-05-h100-scheduler-figures/commands/next.sh
# Each unit also records the scheduler figures (figures.processes, threads, gpu_busy):
# compare topk's scheduler time off the CPU (66 ms a wave on the H100 with 16 slots),
# and with the drain handing the GIL over after 50 µs of Python instead of 200 (each of
# the scheduler's 205 waits a wave lasted 0.32 ms there).
set -o pipefail
DEADLINE=${DEADLINE:-545} bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh next \
    "store:final_logits:topk(64),store:final_logits:topk(64)[DMX_DRAIN_GIL_SLICE_US=50],store:resid_pre:last,transport:hidden-states" 3
