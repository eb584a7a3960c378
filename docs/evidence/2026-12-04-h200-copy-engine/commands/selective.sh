#!/usr/bin/env bash
# The lease call after kernel.sh (same machine, same lease): the selective-capture cells
# of issue 16 with the drain settings kernel.sh used (/root/suggested-drain-env), stored,
# then issue 15's stored hidden-states on the reference workload. Four cells do not fit
# one call: call it again on the same machine and it resumes with the units measured.
#   bash docs/evidence/2026-12-04-h200-copy-engine/commands/selective.sh
set -o pipefail
setting=$(cat /root/suggested-drain-env 2>/dev/null || echo "DMX_DRAIN_COPY_PIECE_MB=2 DMX_DRAIN_COPY_AHEAD=2")
echo "serving with: $setting"
DEADLINE=545 bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh selective \
    "store:resid_pre:last[$setting],store:final_logits:topk(64)[$setting],store:hidden-states[DMX_REQUEST_SAMPLE=0.1 $setting],store:hidden-states[$setting]" 1
