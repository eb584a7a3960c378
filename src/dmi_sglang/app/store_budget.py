"""The store budget: new requests are not captured once the store would outgrow its cap
or its disk runs short, so a serving run never fills the disk.

A run's store grows by what the capture hands its sink. :class:`StoreBudget` adds that
(payload bytes, before the store's compression: an overestimate) to the embedded store's
size when the run began, and compares it with ``DMX_STORE_MAX_GB`` (0: no cap); for the
embedded store it also refuses while the store's file system has less than
:data:`MIN_FREE_BYTES` free (and, once it refused for that, until it has
:data:`RESUME_FREE_BYTES`). It is asked once per new request, answers from a value at
most :data:`REFRESH_S` old, and never stops a request already captured (those finish and
commit; the overshoot is bounded by the requests in flight).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from dmi_sglang.domain.store_config import StoreConfig, StoreKind

__all__ = ["MIN_FREE_BYTES", "REFRESH_S", "RESUME_FREE_BYTES", "StoreBudget", "directory_bytes"]

MIN_FREE_BYTES = 2 << 30
"""New captures stop while the embedded store's file system has less free than this."""
RESUME_FREE_BYTES = 3 << 30
"""... and once stopped for it, start again only with this much free: a disk hovering
at the threshold (parts written and merged away) does not pause and resume the capture
every check."""
REFRESH_S = 1.0
"""Longest an answer is reused."""
_GB = 1e9


def directory_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist), each file once
    however many links it has (the engine hard-links a part's files into new parts)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # a part merged away meanwhile
                continue
            if st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


class StoreBudget:
    """Says why new requests must not be captured now (None: they may).

    Args:
        store: the run's store.
        max_gb: the cap in GB (10^9 bytes); 0: none.
        stored_bytes: payload bytes the run handed its sink so far.
        free_bytes: free bytes of a path's file system (a seam for tests).
        clock: seconds, monotonic (a seam for tests).
    """

    def __init__(self, store: StoreConfig, max_gb: int, stored_bytes: Callable[[], int], *,
                 free_bytes: Callable[[str], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._embedded = store.kind is StoreKind.EMBEDDED
        self._path = store.path
        self._cap = int(max_gb * _GB) if store.kind is not StoreKind.NONE else 0
        self._stored = stored_bytes
        self._free = free_bytes or _free_bytes
        self._clock = clock
        self.base_bytes = (directory_bytes(store.path)
                           if self._embedded and self._cap and store.path else 0)
        """The embedded store's size when the run began (counted when capped)."""
        self._at = -REFRESH_S
        self._answer: str | None = None
        self._disk_short = False

    def __call__(self) -> str | None:
        now = self._clock()
        if now - self._at < REFRESH_S:
            return self._answer
        self._at = now
        self._answer = None
        if self._cap:
            used = self.base_bytes + self._stored()
            if used >= self._cap:
                self._answer = (f"the store reached its cap: {used / _GB:,.1f} GB of "
                                f"DMX_STORE_MAX_GB={self._cap / _GB:g}")
                return self._answer
        if self._embedded:
            try:
                free = self._free(self._path)
            except OSError as exc:  # the store's directory is gone or unreadable: refuse
                self._answer = f"the store's disk cannot be checked: {exc}"
                return self._answer
            need = RESUME_FREE_BYTES if self._disk_short else MIN_FREE_BYTES
            self._disk_short = free < need
            if self._disk_short:
                self._answer = (f"the store's disk has {free / _GB:,.1f} GB free, below "
                                f"{need / _GB:,.1f} GB")
        return self._answer


def _free_bytes(path: str) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize
