"""``python -m harness COMMAND ...``: qualify, serving, transport, store or docs."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"qualify": "harness.qualify", "serving": "harness.serving",
            "transport": "harness.micro_transport", "store": "harness.micro_store",
            "docs": "harness.docs"}


def main(argv: list[str]) -> int:
    """Dispatch to the command's ``main``."""
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m harness {{{','.join(COMMANDS)}}} [--help]", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return int(module.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
