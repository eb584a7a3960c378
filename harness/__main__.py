"""``python -m harness COMMAND ...``: qualify, serving, serve-load, hooks, transport, store,
copies, topk, profile, waves, docs."""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {"qualify": "harness.qualify", "serving": "harness.serving",
            "hooks": "harness.micro_hooks", "transport": "harness.micro_transport",
            "store": "harness.micro_store", "profile": "harness.profile", "docs": "harness.docs",
            "serve-load": "harness.serve_load", "copies": "harness.micro_copies",
            "topk": "harness.micro_topk", "waves": "harness.waves"}


LEGACY = {
    "DMI_V0519_CELLS": "--cells core|optional|all|NAME,... (python -m harness qualify --list)",
    "DMI_V0519_PYTHON": "the interpreter that runs python -m harness",
    "DMI_V0519_MODEL": "--model 0.6b|8b of python -m harness serving (real shapes, dummy "
                       "weights); tests/gpu builds its own checkpoint",
    "DMI_V0519_MEM_FRACTION": "none: MEM_FRACTION_STATIC in harness/constants.py is fixed so "
                              "that two engines share the GPU",
}
"""The original integration's GPU-smoke variables, refused with what replaces them."""


def legacy_problem(env: dict[str, str]) -> str | None:
    """One message naming every ``DMI_V0519_*`` variable set and its replacement."""
    found = sorted(k for k in env if k.startswith("DMI_V0519_"))
    if not found:
        return None
    lines = [f"  {k}: {LEGACY.get(k, 'no counterpart')}" for k in found]
    return ("the original integration's GPU-smoke variables are not read here; unset them "
            "and use instead:\n" + "\n".join(lines) +
            "\n  deadline: DMI_HARNESS_DEADLINE_S (seconds), state: DMI_HARNESS_STATE")


def main(argv: list[str]) -> int:
    """Dispatch to the command's ``main``."""
    problem = legacy_problem(dict(os.environ))
    if problem:
        print(f"python -m harness: {problem}", file=sys.stderr)
        return 2
    usage = f"usage: python -m harness {{{','.join(COMMANDS)}}} [--help]"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{(sys.modules['harness'].__doc__ or '').strip()}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage, file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return int(module.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
