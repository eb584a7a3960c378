"""``python -m dmi_sglang.app.store_owner_main``: the store owner process
(:mod:`dmi_sglang.app.store_owner`), its channels from the composition root.

The process ends with ``os._exit`` once :func:`run_owner` returned: by then its sink is
closed (everything it took inserted, the run's files synced by ``finish_run``) and its
channels are gone, and the parent's stop waits for this exit to find the store free.
The interpreter's and the embedded engine's own teardown (about 0.2 s) would only add
to that wait; the operating system releases the store's lock and files either way.
"""

from __future__ import annotations

import os
import sys

from dmi_sglang.app.composition import owner_services
from dmi_sglang.app.store_owner import run_owner

if __name__ == "__main__":
    code = run_owner(sys.argv[1:], owner_services)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
