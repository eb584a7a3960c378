#!/usr/bin/env bash
# The hooks benchmark's sglang-full cell with piecewise prefills on the development machine
# (CPU), the tree before the parts (BEFORE, a git revision) and the working tree, two runs
# each, from the repository root: bash docs/evidence/2026-12-04-cpu-piecewise-parts/commands/parts.sh 6af0000
set -euo pipefail
out=docs/evidence/2026-12-04-cpu-piecewise-parts/comparison
old=$(mktemp -d); git archive "$1" src harness | tar -x -C "$old"
for tree in before after; do
    dir=$PWD; [ "$tree" = before ] && dir=$old
    for i in 1 2; do
        (cd "$dir" && PYTHONPATH=src:. "$OLDPWD/.venv/bin/python" -m harness hooks --device cpu \
            --presets sglang-full --layers 28 --hidden 1024 --vocab 151936 --batch 16 \
            --prompt-len 64 --output-len 16 --waves 2 --ring-mb 256 \
            --out "$OLDPWD/$out/hooks-$tree-$i.json" > /dev/null 2>&1)
    done
done
rm -rf "$old"
