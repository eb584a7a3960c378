#!/usr/bin/env bash
# The next lease (not run yet), one call after the kit is stashed, repeated (units resume
# from /root/w):
#   S0=$SECONDS; source .gpu-kit/bin/device-install.sh > $OUT/kit.log 2>&1 || exit 3;
#   DMI_COMMIT=<this checkout's git rev-parse HEAD> DEADLINE=$((560 - (SECONDS - S0))) bash docs/evidence/2026-12-06-h100-served-side-stream-flashinfer/commands/next.sh
# (DMI_COMMIT: the device's .git is the last landed commit, not this checkout's HEAD.)
# The method for the selective targets: three units a cell, each bracketed by
# stock, with DMX_GRAPH_SIDE_STREAM on (the default since this evidence). First, once:
# the end-to-end GPU tests with that default (tokens, rows, and every hook's captures
# against a transformers forward through SGLang's decode graphs, whose fused norms change
# the residual in place), and FlashInfer's kernel compiled (minutes on a fresh machine)
# outside any unit's clock.
set -o pipefail
S=$SECONDS; budget=${DEADLINE:-560}; mkdir -p "$OUT/logs" /root/w
export TRITON_CACHE_DIR=/root/triton-cache PYTHONUNBUFFERED=1
left() { echo $((budget - (SECONDS - S))); }
# Each step once per machine, and only with its time limit left (else the next call).
if [ ! -f /root/w/e2e-done ] && [ "$(left)" -ge 310 ]; then
    nvidia-smi > "$OUT/logs/gpu.txt" 2>&1
    timeout 300 bash scripts/gpu-run.sh python3 -m pytest tests/gpu/test_e2e_qwen3.py -m gpu -q -p no:cacheprovider \
        --basetemp=/tmp/e2e > "$OUT/logs/test_e2e.log" 2>&1; echo "e2e rc=$? at $((SECONDS-S)) s"
    tail -3 "$OUT/logs/test_e2e.log"; touch /root/w/e2e-done
fi
if [ ! -f /root/w/hooks-done ] && [ "$(left)" -ge 210 ]; then  # a `last` prefill forward's ~5 ms
    timeout 200 bash scripts/gpu-run.sh python3 -m harness hooks --presets last,sample0 --prompt-len 16 \
        --output-len 32 --profile --out "$OUT/hooks-prefill.json" > "$OUT/logs/hooks-prefill.log" 2>&1
    echo "hooks rc=$? at $((SECONDS-S)) s"; touch /root/w/hooks-done
fi
if [ ! -f /root/w/flashinfer-warm ] && [ "$(left)" -ge 250 ]; then
    timeout 240 python3 -c "import torch; from dmi_sglang.adapters.transport.topk_flashinfer import warm_up; print('flashinfer warm-up:', warm_up(torch.device('cuda'), 151936, 64, batches=(3, 64)))" \
        > "$OUT/logs/flashinfer-warm.log" 2>&1 && touch /root/w/flashinfer-warm
    echo "flashinfer warm-up at $((SECONDS-S)) s"; tail -2 "$OUT/logs/flashinfer-warm.log"
fi
[ -f /root/w/flashinfer-warm ] || exit 0  # its units would compile inside their clock
: "${MODES:=store:resid_pre:last,store:final_logits:topk(64)[DMX_TOPK_KERNEL=flashinfer],transport:hidden-states}"
DEADLINE=$(left) bash docs/evidence/2026-12-03-h200-serving-owner-landing/commands/serve.sh next "$MODES" 3
