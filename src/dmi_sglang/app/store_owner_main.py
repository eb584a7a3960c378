"""``python -m dmi_sglang.app.store_owner_main``: the store owner process
(:mod:`dmi_sglang.app.store_owner`), its channels from the composition root."""

from __future__ import annotations

import sys

from dmi_sglang.app.composition import owner_services
from dmi_sglang.app.store_owner import run_owner

if __name__ == "__main__":
    sys.exit(run_owner(sys.argv[1:], owner_services))
