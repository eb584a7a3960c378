#!/usr/bin/env bash
# Planned for the next lease (not run yet): the defaults beside 8 MiB pieces with a gap
# kernel after each (the copies benchmark's quickest variant that let the small copy
# through at 50 GB/s), then issue 15's stored hidden-states on the reference workload
# (its waves stop at 20 GB captured). Call it twice on the same machine: it resumes.
#   bash docs/evidence/2026-12-05-h200-pieces-selective/commands/next.sh
set -o pipefail
gaps="DMX_DRAIN_COPY_PIECE_MB=8 DMX_DRAIN_COPY_GAPS=1"
DEADLINE=${DEADLINE:-545} bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh next \
    "transport:hidden-states,transport:hidden-states[$gaps],store:hidden-states,transport:sglang-full[$gaps]" 1
