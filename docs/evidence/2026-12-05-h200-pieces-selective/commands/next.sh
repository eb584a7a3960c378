#!/usr/bin/env bash
# Run on 2026-12-05 on an H100 (two units: ../../2026-12-05-h100-scheduler-figures/). One unit a cell measured on different days
# differs by up to 4 % (store:resid_pre:last 0.937 and 0.895), as much as the gaps to the
# targets, so the targets' cells come first with the three repeats the targets ask for:
# call this three times on the same machine (it resumes with the units measured).
#   bash docs/evidence/2026-12-05-h200-pieces-selective/commands/next.sh
# Every unit also records, over its timed waves, stock's included, each engine process's
# main thread and other threads (CPU seconds, context switches: figures.processes), the
# busiest threads (figures.threads) and the GPU's busy share (figures.gpu_busy), and the
# log prints them per wave after each unit: whether stock's scheduler keeps the GPU fed,
# and where the monitored engines' extra scheduler time goes.
# Afterwards, if a call is left: store:hidden-states on the reference workload (its waves
# stop at 20 GB captured; about 190 s) and the gaps variant
# transport:hidden-states[DMX_DRAIN_COPY_PIECE_MB=8 DMX_DRAIN_COPY_GAPS=1].
set -o pipefail
DEADLINE=${DEADLINE:-545} bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh next \
    "store:resid_pre:last,store:final_logits:topk(64),transport:hidden-states" 3
