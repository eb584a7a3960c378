"""``python -m dmi_sglang``: the ``dmi-sglang`` command."""

from __future__ import annotations

import sys

from dmi_sglang.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
