"""``python -m dmi_sglang.app.store_owner_main``: the store owner process
(:mod:`dmi_sglang.app.store_owner`), its channels from the composition root.

The process ends with ``os._exit`` once :func:`run_owner` returned, its output flushed:
by then its sink is closed (everything it took inserted, the embedded store shut down,
the run's files synced by ``finish_run``), its channels are gone, and it told its parent
that the store is free (the parent's stop goes on from there). Python's own
finalization (its modules, threads and the embedded engine's process-wide state: 0.2 to
1 s measured) would only keep its resources longer. Where a server's read was still in
hand when the owner closed, its store client stays open and the exit leaves the store as
a crash would; the next opening finds the lock stale and takes the store.
"""

from __future__ import annotations

import contextlib
import os
import sys

from dmi_sglang.app.composition import owner_services
from dmi_sglang.app.store_owner import run_owner

if __name__ == "__main__":
    code = run_owner(sys.argv[1:], owner_services)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or absent stream: exit anyway
            stream.flush()
    os._exit(code)
