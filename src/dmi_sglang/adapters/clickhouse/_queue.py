"""The sink's bounded queue of record batches: byte-bounded, blocking, insert-forming.

Batches get consecutive indices as they are put. Writers take one or more whole batches
in index order (an *insert*) and report each insert done; ``done_below`` is the low-water
mark (every batch with a smaller index is stored), which is what ``flush`` waits on, even
when several writers finish their inserts out of order. Queued bytes count until the
insert holding them is done, so the bound covers batches in flight too.

The queue also times its waits (:class:`QueueWaits`): producers blocked for room, and
writers idle with nothing queued or with batches queued that do not fill an insert yet.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.store_config import default_insert_bytes
from dmi_sglang.errors import StoreError

__all__ = ["QueueWaits", "RecordQueue", "Taken", "charge"]

_ROW_OVERHEAD = 128  # keys, shape and framing of one row, roughly


def charge(batch: RecordBatch) -> int:
    """Bytes a batch is charged in the queue bound: its payload plus a row overhead per
    record."""
    return batch.nbytes + _ROW_OVERHEAD * len(batch)


class Taken:
    """Batches ``[first, first + len(batches))`` taken by one writer for one insert."""

    __slots__ = ("batches", "first", "nbytes", "records")

    def __init__(self, first: int, batches: list[RecordBatch], nbytes: int, records: int) -> None:
        self.first = first
        self.batches = batches
        self.nbytes = nbytes
        self.records = records

    @property
    def payload_bytes(self) -> int:
        """Payload bytes of the batches."""
        return sum(b.nbytes for b in self.batches)


class QueueWaits:
    """Seconds spent waiting in a :class:`RecordQueue`, summed over threads.

    Attributes:
        put_seconds: producers blocked in ``put`` for room (the sink's backpressure).
        idle_empty_seconds: writers waiting with nothing queued, from the first batch on
            (not while the sink waits for its capture to begin).
        idle_partial_seconds: writers waiting with batches queued that do not fill an
            insert yet (until more come, the oldest lingered out, or a producer blocks).
    """

    __slots__ = ("idle_empty_seconds", "idle_partial_seconds", "put_seconds")

    def __init__(self) -> None:
        self.put_seconds = 0.0
        self.idle_empty_seconds = 0.0
        self.idle_partial_seconds = 0.0


class RecordQueue:
    """A FIFO of record batches bounded in bytes (see the module docstring).

    Args:
        max_bytes: the bound; ``put`` blocks while it would be exceeded (a single batch
            larger than the bound is admitted alone into an empty queue).
        batch_rows: most records per insert, unless one batch alone holds more (a batch
            is never split).
        linger_s: longest the oldest queued batch waits for an insert to fill.
        batch_bytes: most bytes per insert, unless one batch alone holds more; default
            :func:`~dmi_sglang.domain.store_config.default_insert_bytes` of ``max_bytes``
            (an eighth, at most 128 MiB).
    """

    def __init__(
        self, *, max_bytes: int, batch_rows: int, linger_s: float, batch_bytes: int = 0
    ) -> None:
        self._max_bytes = max(1, max_bytes)
        self._batch_rows = max(1, batch_rows)
        self._batch_bytes = batch_bytes or default_insert_bytes(self._max_bytes)
        self._linger_s = max(0.0, linger_s)
        self._cond = threading.Condition()
        self._batches: deque[tuple[RecordBatch, int, float]] = deque()  # batch, charge, put at
        self._bytes = 0  # queued + in flight
        self._waiting_bytes = 0  # queued, not taken yet
        self._waiting_records = 0
        self._next_index = 0  # index the next put batch gets
        self._taken = 0  # index of the next batch a writer takes
        self._done_below = 0
        self._done: dict[int, int] = {}  # finished inserts ahead of the low-water mark
        self._urgent = 0  # flushers and blocked putters waiting: send partial inserts now
        self._closing = False
        self._failure: StoreError | None = None
        self._waits = QueueWaits()

    # -- producers ---------------------------------------------------------------------

    def put(self, batch: RecordBatch) -> None:
        """Append a batch, blocking while the byte bound would be exceeded. An empty
        batch is accepted and dropped.

        Raises:
            StoreError: the sink failed (sticky) or is closed.
        """
        nbytes = charge(batch)
        with self._cond:
            if self._bytes and self._bytes + nbytes > self._max_bytes:
                self._urgent += 1
                self._cond.notify_all()
                blocked = time.monotonic()
                try:
                    while (
                        self._failure is None
                        and not self._closing
                        and self._bytes
                        and self._bytes + nbytes > self._max_bytes
                    ):
                        self._cond.wait()
                finally:
                    self._urgent -= 1
                    self._waits.put_seconds += time.monotonic() - blocked
            self._raise_if_unusable()
            if not len(batch):
                return
            self._batches.append((batch, nbytes, time.monotonic()))
            self._bytes += nbytes
            self._waiting_bytes += nbytes
            self._waiting_records += len(batch)
            self._next_index += 1
            self._cond.notify_all()

    def wait_done(self) -> None:
        """Block until every batch put so far is stored.

        Raises:
            StoreError: the sink failed before they were.
        """
        with self._cond:
            target = self._next_index
            self._urgent += 1
            self._cond.notify_all()
            try:
                while self._done_below < target and self._failure is None:
                    self._cond.wait()
            finally:
                self._urgent -= 1
            if self._failure is not None:
                raise self._failure

    def mark(self) -> int:
        """The index the next batch put gets: :meth:`wait_stored` of it waits for every
        batch put so far."""
        with self._cond:
            return self._next_index

    def wait_stored(self, index: int) -> None:
        """Block until every batch below ``index`` is stored (without hurrying the
        writers, unlike :meth:`wait_done`).

        Raises:
            StoreError: the sink failed before they were.
        """
        with self._cond:
            while self._done_below < index and self._failure is None:
                self._cond.wait()
            if self._failure is not None:
                raise self._failure

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closing:
            msg = "the capture sink is closed"
            raise StoreError(msg)

    # -- writers ---------------------------------------------------------------------

    def take(self) -> Taken | None:
        """The next insert's batches, waiting for them to fill it or linger out; None
        when closing and drained, or after a failure."""
        with self._cond:
            while True:
                if self._failure is not None:
                    return None
                if self._batches:
                    wait = self._batches[0][2] + self._linger_s - time.monotonic()
                    full = (self._waiting_records >= self._batch_rows
                            or self._waiting_bytes >= self._batch_bytes)
                    if full or self._urgent or self._closing or wait <= 0:
                        return self._pop()
                    idle = time.monotonic()
                    self._cond.wait(wait)
                    self._waits.idle_partial_seconds += time.monotonic() - idle
                elif self._closing:
                    return None
                else:
                    idle = time.monotonic()
                    counted = self._next_index > 0  # not before the first batch
                    self._cond.wait()
                    if counted:
                        self._waits.idle_empty_seconds += time.monotonic() - idle

    def _pop(self) -> Taken:
        batches: list[RecordBatch] = []
        nbytes = records = 0
        while self._batches:
            batch, size, _ = self._batches[0]
            if batches and (nbytes + size > self._batch_bytes
                            or records + len(batch) > self._batch_rows):
                break
            self._batches.popleft()
            batches.append(batch)
            nbytes += size
            records += len(batch)
        self._waiting_bytes -= nbytes
        self._waiting_records -= records
        first = self._taken
        self._taken += len(batches)
        return Taken(first, batches, nbytes, records)

    def done(self, taken: Taken) -> None:
        """A writer stored ``taken``."""
        with self._cond:
            if self._failure is not None:
                return  # everything was dropped when the sink failed
            self._bytes -= taken.nbytes
            self._done[taken.first] = taken.first + len(taken.batches)
            while self._done_below in self._done:
                self._done_below = self._done.pop(self._done_below)
            self._cond.notify_all()

    def fail(self, failure: StoreError) -> None:
        """Make ``failure`` sticky: queued batches are dropped, everyone is woken."""
        with self._cond:
            if self._failure is None:
                self._failure = failure
            self._batches.clear()
            self._bytes = self._waiting_bytes = self._waiting_records = 0
            self._cond.notify_all()

    def close(self) -> None:
        """No more puts; writers drain what is queued, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    @property
    def failure(self) -> StoreError | None:
        """The sticky failure, if any."""
        return self._failure

    def waits(self) -> tuple[float, float, float]:
        """The :class:`QueueWaits` figures so far, as ``(put_seconds,
        idle_empty_seconds, idle_partial_seconds)``."""
        with self._cond:
            w = self._waits
            return w.put_seconds, w.idle_empty_seconds, w.idle_partial_seconds

    @property
    def queued_bytes(self) -> int:
        """Bytes queued or in flight (for statistics and tests)."""
        return self._bytes
