"""Per-request commits: a finished request's manifest, stored once its rows are.

The drain hands the sink a request's committed manifest after the last batch holding
its rows (:meth:`ClickHouseSink.commit_requests`). The manifest must not reach the store
before those rows do, or a reader would call the request complete while rows are still
in flight. :class:`RequestCommits` keeps each manifest with the record queue's index at
the time it came (:meth:`RecordQueue.mark`) and writes it, on its own thread, once every
batch below that index is stored. Manifests that become ready together go in one insert,
and inserts are at least :data:`COMMIT_INTERVAL_S` apart, so a server finishing hundreds of
requests a second adds a few small parts a second to the manifests table, not hundreds;
a caller waiting for them (:meth:`RequestCommits.wait_idle`: a flush, the run's stop) or
closing cuts that interval short.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import structlog

from dmi_sglang.adapters.clickhouse._queue import RecordQueue
from dmi_sglang.domain.records import RequestManifest
from dmi_sglang.errors import StoreError
from dmi_sglang.threads import OsNamedThread

__all__ = ["COMMIT_INTERVAL_S", "RequestCommits"]

log = structlog.get_logger(__name__)

COMMIT_INTERVAL_S = 0.2
"""Shortest time between two inserts of committed manifests."""

Write = Callable[[Sequence[RequestManifest]], None]
"""Stores committed manifests (raises StoreError)."""


class RequestCommits:
    """The per-request commit thread of one sink (see the module docstring).

    Args:
        queue: the sink's record queue (its indices order manifests after batches).
        write: stores manifests; a failure is made the queue's sticky failure.
    """

    def __init__(self, queue: RecordQueue, write: Write) -> None:
        self._queue = queue
        self._write = write
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, tuple[RequestManifest, ...]]] = deque()
        self._busy = False
        self._waiters = 0
        """Callers in :meth:`wait_idle`: the next insert does not wait for the interval."""
        self._closing = False
        self._failure: StoreError | None = None
        self.committed = 0
        """Manifests stored so far."""
        self._thread = OsNamedThread(target=self._loop, name="dmi-sink-commits",
                                     daemon=True)
        self._thread.start()

    def add(self, manifests: Sequence[RequestManifest]) -> None:
        """Queue manifests behind every batch put so far (never blocks).

        Raises:
            StoreError: an earlier commit failed, or the sink is closed.
        """
        if not manifests:
            return
        with self._cond:  # marks and appends in one order, whoever calls
            index = self._queue.mark()
            if self._failure is not None:
                raise self._failure
            if self._closing:
                msg = "the capture sink is closed: request commits are refused"
                raise StoreError(msg)
            self._pending.append((index, tuple(manifests)))
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every manifest added so far is stored (an insert waiting for the
        interval since the previous one goes at once).

        Raises:
            StoreError: a commit (or the sink) failed.
        """
        with self._cond:
            self._waiters += 1
            self._cond.notify_all()
            try:
                while (self._pending or self._busy) and self._failure is None:
                    self._cond.wait()
            finally:
                self._waiters -= 1
            if self._failure is not None:
                raise self._failure

    def close(self) -> None:
        """Store what can still be stored, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        last = 0.0
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                index = self._pending[-1][0]
                self._busy = True
            try:
                wait = last + COMMIT_INTERVAL_S - time.monotonic()
                if wait > 0:
                    with self._cond:
                        self._cond.wait_for(lambda: self._waiters > 0 or self._closing, wait)
                self._queue.wait_stored(index)
                with self._cond:
                    ready = [m for i, ms in self._pending if i <= index for m in ms]
                    while self._pending and self._pending[0][0] <= index:
                        self._pending.popleft()
                self._write(ready)
                last = time.monotonic()
                with self._cond:
                    self.committed += len(ready)
                    self._busy = False
                    self._cond.notify_all()
            except BaseException as exc:
                failure = exc if isinstance(exc, StoreError) else StoreError(
                    f"committing finished requests failed: {exc!r}")
                log.error("store.commit_failed", error=str(failure))
                with self._cond:
                    self._failure = failure
                    self._pending.clear()
                    self._busy = False
                    self._cond.notify_all()
                self._queue.fail(failure)
                return
