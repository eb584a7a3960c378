"""The sink's bounded record queue: byte-bounded, blocking, batch-forming.

Records get consecutive indices as they are put. Writers take batches in index order
and report each batch done; ``done_below`` is the low-water mark (every record with a
smaller index is durable), which is what ``flush`` waits on, even when several writers
finish their batches out of order. Queued bytes count until the batch holding them is
done, so the bound covers records in flight too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.errors import StoreError

__all__ = ["Batch", "RecordQueue", "record_bytes"]

_ROW_OVERHEAD = 128  # keys, shape and framing of one row, roughly


def record_bytes(record: CaptureRecord) -> int:
    """Bytes a record is charged in the queue bound."""
    return len(record.payload) + _ROW_OVERHEAD


class Batch:
    """Records ``[first, first + len(records))`` taken by one writer."""

    __slots__ = ("first", "nbytes", "records")

    def __init__(self, first: int, records: list[CaptureRecord], nbytes: int) -> None:
        self.first = first
        self.records = records
        self.nbytes = nbytes


class RecordQueue:
    """A FIFO of records bounded in bytes (see the module docstring).

    Args:
        max_bytes: the bound; ``put`` blocks while it would be exceeded (a single put
            larger than the bound is admitted alone into an empty queue).
        batch_rows: most records per batch.
        linger_s: longest the oldest queued record waits for a batch to fill.
        batch_bytes: most bytes per batch (a batch holds at least one record);
            default a quarter of ``max_bytes``, at most 256 MiB, so that several
            batches can be in flight and no insert builds a huge block.
    """

    def __init__(
        self, *, max_bytes: int, batch_rows: int, linger_s: float, batch_bytes: int = 0
    ) -> None:
        self._max_bytes = max(1, max_bytes)
        self._batch_rows = max(1, batch_rows)
        self._batch_bytes = batch_bytes or min(max(1, self._max_bytes // 4), 256 << 20)
        self._linger_s = max(0.0, linger_s)
        self._cond = threading.Condition()
        self._records: deque[CaptureRecord] = deque()
        self._arrivals: deque[list[float]] = deque()  # [records left, put time] per put
        self._bytes = 0  # queued + in flight
        self._waiting_bytes = 0  # queued, not taken yet
        self._next_index = 0  # index the next put record gets
        self._taken = 0  # index of the next record a writer takes
        self._done_below = 0
        self._done: dict[int, int] = {}  # finished batches ahead of the low-water mark
        self._urgent = 0  # flushers and blocked putters waiting: send partial batches now
        self._closing = False
        self._failure: StoreError | None = None

    # -- producers ---------------------------------------------------------------------

    def put(self, records: Sequence[CaptureRecord]) -> None:
        """Append records, blocking while the byte bound would be exceeded.

        Raises:
            StoreError: the sink failed (sticky) or is closed.
        """
        nbytes = sum(record_bytes(r) for r in records)
        with self._cond:
            if self._bytes and self._bytes + nbytes > self._max_bytes:
                self._urgent += 1
                self._cond.notify_all()
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
            self._raise_if_unusable()
            if not records:
                return
            self._records.extend(records)
            self._arrivals.append([len(records), time.monotonic()])
            self._bytes += nbytes
            self._waiting_bytes += nbytes
            self._next_index += len(records)
            self._cond.notify_all()

    def wait_done(self) -> None:
        """Block until every record put so far is durable.

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

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closing:
            msg = "the capture sink is closed"
            raise StoreError(msg)

    # -- writers ---------------------------------------------------------------------

    def take(self) -> Batch | None:
        """The next batch, waiting for it to fill or linger out; None when closing
        and drained, or after a failure."""
        with self._cond:
            while True:
                if self._failure is not None:
                    return None
                n = len(self._records)
                if n:
                    wait = self._arrivals[0][1] + self._linger_s - time.monotonic()
                    full = n >= self._batch_rows or self._waiting_bytes >= self._batch_bytes
                    if full or self._urgent or self._closing or wait <= 0:
                        return self._pop()
                    self._cond.wait(wait)
                elif self._closing:
                    return None
                else:
                    self._cond.wait()

    def _pop(self) -> Batch:
        records: list[CaptureRecord] = []
        nbytes = 0
        while self._records and len(records) < self._batch_rows:
            size = record_bytes(self._records[0])
            if records and nbytes + size > self._batch_bytes:
                break
            records.append(self._records.popleft())
            nbytes += size
        self._waiting_bytes -= nbytes
        k = left = len(records)
        while left:
            head = self._arrivals[0]
            used = min(left, int(head[0]))
            head[0] -= used
            left -= used
            if head[0] == 0:
                self._arrivals.popleft()
        first = self._taken
        self._taken += k
        return Batch(first, records, nbytes)

    def done(self, batch: Batch) -> None:
        """A writer stored ``batch``."""
        with self._cond:
            if self._failure is not None:
                return  # everything was dropped when the sink failed
            self._bytes -= batch.nbytes
            self._done[batch.first] = batch.first + len(batch.records)
            while self._done_below in self._done:
                self._done_below = self._done.pop(self._done_below)
            self._cond.notify_all()

    def fail(self, failure: StoreError) -> None:
        """Make ``failure`` sticky: queued records are dropped, everyone is woken."""
        with self._cond:
            if self._failure is None:
                self._failure = failure
            self._records.clear()
            self._arrivals.clear()
            self._bytes = self._waiting_bytes = 0  # queued and in-flight records are dropped
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

    @property
    def queued_bytes(self) -> int:
        """Bytes queued or in flight (for statistics and tests)."""
        return self._bytes
