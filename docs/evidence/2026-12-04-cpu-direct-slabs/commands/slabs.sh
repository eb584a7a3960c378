#!/usr/bin/env bash
# The CPU hooks benchmark's sglang-full cell (1 GiB ring) at two commits, from the
# repository root: bash docs/evidence/2026-12-04-cpu-direct-slabs/commands/slabs.sh 86c5395 HEAD
set -e
for rev in "$@"; do
    rm -rf /tmp/wt-slabs && git worktree add -q /tmp/wt-slabs "$rev"
    (cd /tmp/wt-slabs && PYTHONPATH=src:. "$OLDPWD/.venv/bin/python" -m harness hooks --device cpu \
        --presets sglang-full --layers 28 --hidden 1024 --vocab 151936 --batch 16 \
        --prompt-len 64 --output-len 16 --waves 2 --ring-mb 1024 --out "/tmp/slabs-$rev.json")
    git worktree remove --force /tmp/wt-slabs
done
