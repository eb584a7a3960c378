#!/usr/bin/env bash
# Planned for the next lease (not run yet), after the kit is stashed, one call after another:
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-05-h100-topk-kernel-insert-size/commands/next.sh
# The serving harness resumes from its state under /root/w: call again until it says rc=0.
#  - store:hidden-states at the new defaults (inserts of 128 MiB, puts in 8 MiB pieces:
#    ../../2026-12-05-cpu-owner-put-pieces/) against this lease's 0.452 (256 MiB
#    inserts, whole puts) and 0.503 (128 MiB inserts, whole puts); one unit each;
#  - the cells not run this lease: transport:hidden-states, store:resid_pre:last.
set -o pipefail
bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh next \
    "store:hidden-states,transport:hidden-states,store:resid_pre:last" 1
