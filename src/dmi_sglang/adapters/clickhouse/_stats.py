"""Sink statistics."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import attrs

from dmi_sglang.columns import RecordBatch

if TYPE_CHECKING:
    from dmi_sglang.adapters.clickhouse._queue import Taken

__all__ = ["SinkStats", "StatsCounter"]


@attrs.frozen
class SinkStats:
    """What a sink has done so far.

    Attributes:
        records_put / bytes_put / batches_put: records, payload bytes and record batches
            handed to ``put`` (in the store owner, the batches as they arrived: a remote
            sink sends a batch of more than 8 MiB over the owner's socket as several, each
            counted here).
        records_stored / bytes_stored / batches_stored: those inserted.
        inserts: insert statements that succeeded (each holds one or more batches).
        retries: insert attempts retried after a transient error.
        parts_waits: insert attempts repeated after TOO_MANY_PARTS (waiting for merges;
            not counted in ``retries``).
        insert_seconds: wall time the writers spent encoding and inserting.
        writer_cpu_seconds: CPU time of the writer threads themselves (encoding, and the
            embedded engine's work that runs on the inserting thread; the engine's own
            threads not included).
        sync_seconds: time ``finish_run`` spent syncing the embedded store's new files.
        background_sync_seconds: time the background passes spent syncing them while
            runs captured (each pass what was written since the previous one).
        finish_seconds: time ``finish_run`` took, summed over runs.
        finish_flush_seconds: of that, the time it waited for what was queued or in
            flight when it began to be inserted.
        finish_queued_bytes: what was queued or in flight when ``finish_run`` began
            (payload plus a row overhead), summed over runs.
        put_wait_seconds: time ``put`` blocked for room in the queue (the sink's
            backpressure on the capture).
        writer_idle_empty_seconds: time the writers waited with nothing queued.
        writer_idle_partial_seconds: time the writers waited with batches queued that did
            not fill an insert yet (for more to come, or the oldest to linger out).
        queued_bytes: bytes queued or in flight now (payload plus a row overhead).
    """

    records_put: int = 0
    bytes_put: int = 0
    batches_put: int = 0
    records_stored: int = 0
    bytes_stored: int = 0
    batches_stored: int = 0
    inserts: int = 0
    retries: int = 0
    parts_waits: int = 0
    insert_seconds: float = 0.0
    writer_cpu_seconds: float = 0.0
    sync_seconds: float = 0.0
    background_sync_seconds: float = 0.0
    finish_seconds: float = 0.0
    finish_flush_seconds: float = 0.0
    finish_queued_bytes: int = 0
    put_wait_seconds: float = 0.0
    writer_idle_empty_seconds: float = 0.0
    writer_idle_partial_seconds: float = 0.0
    queued_bytes: int = 0

    @property
    def cpu_s_per_gb(self) -> float | None:
        """Writer CPU seconds per GB (1e9 bytes) of payload inserted; None before any."""
        if not self.bytes_stored:
            return None
        return self.writer_cpu_seconds / (self.bytes_stored / 1e9)

    def as_dict(self) -> dict[str, float | None]:
        """The counters (and ``cpu_s_per_gb``) as a plain dict (for logs and JSON)."""
        return {**attrs.asdict(self), "cpu_s_per_gb": self.cpu_s_per_gb}


class StatsCounter:
    """Thread-safe accumulation of :class:`SinkStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s = SinkStats()

    def _add(self, **delta: float) -> None:
        with self._lock:
            self._s = attrs.evolve(
                self._s, **{k: getattr(self._s, k) + v for k, v in delta.items()}
            )

    def put(self, batch: RecordBatch) -> None:
        """A batch was queued."""
        self._add(records_put=len(batch), bytes_put=batch.nbytes, batches_put=1)

    def inserted(self, taken: Taken) -> None:
        """An insert was stored."""
        self._add(records_stored=taken.records, bytes_stored=taken.payload_bytes,
                  batches_stored=len(taken.batches), inserts=1)

    def retried(self) -> None:
        """An insert is being retried."""
        self._add(retries=1)

    def waited_for_parts(self) -> None:
        """An insert is being repeated after TOO_MANY_PARTS."""
        self._add(parts_waits=1)

    def insert_time(self, wall_s: float, cpu_s: float) -> None:
        """Time one insert (with its retries) took."""
        self._add(insert_seconds=wall_s, writer_cpu_seconds=cpu_s)

    def synced(self, seconds: float, *, background: bool = False) -> None:
        """A sync of the store's new files took ``seconds`` (``background``: a pass
        while a run captured, else ``finish_run``'s)."""
        if background:
            self._add(background_sync_seconds=seconds)
        else:
            self._add(sync_seconds=seconds)

    def finished(self, seconds: float, *, flush_seconds: float, queued_bytes: int) -> None:
        """``finish_run`` took ``seconds``, ``flush_seconds`` of them waiting for the
        ``queued_bytes`` queued or in flight when it began."""
        self._add(finish_seconds=seconds, finish_flush_seconds=flush_seconds,
                  finish_queued_bytes=queued_bytes)

    def snapshot(self, *, queued_bytes: int = 0,
                 waits: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> SinkStats:
        """The counters now, with the queue's bytes and its waits (put, writers idle
        with nothing queued, with a partial insert queued)."""
        put, empty, partial = waits
        with self._lock:
            return attrs.evolve(self._s, queued_bytes=queued_bytes, put_wait_seconds=put,
                                writer_idle_empty_seconds=empty,
                                writer_idle_partial_seconds=partial)
