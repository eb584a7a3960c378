#!/usr/bin/env bash
# Call 3 of this lease as a script (the call ran serve.sh with these modes): issue 16's stored cells and issue 15's stored
# hidden-states on the reference workload, with the drain's defaults. A second call resumes.
#   bash docs/evidence/2026-12-05-h200-pieces-selective/commands/selective.sh
set -o pipefail
DEADLINE=${DEADLINE:-545} bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh selective \
    "store:resid_pre:last,store:final_logits:topk(64),store:hidden-states[DMX_REQUEST_SAMPLE=0.1],store:hidden-states" 1
