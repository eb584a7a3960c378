"""Sink statistics."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from dmi_sglang.domain.records import CaptureRecord

if TYPE_CHECKING:
    from dmi_sglang.adapters.clickhouse._queue import Batch

__all__ = ["SinkStats", "StatsCounter"]


@attrs.frozen
class SinkStats:
    """What a sink has done so far.

    Attributes:
        records_put / bytes_put: records and payload bytes handed to ``put``.
        records_stored / bytes_stored: records and payload bytes inserted.
        inserts: insert statements that succeeded.
        retries: insert attempts retried after a transient error.
        insert_seconds: wall time the writers spent encoding and inserting.
        writer_cpu_seconds: CPU time of the writer threads themselves (encoding and
            the client's Python work; the embedded engine's own threads not included).
        queued_bytes: bytes queued or in flight now (payload plus a row overhead).
    """

    records_put: int = 0
    bytes_put: int = 0
    records_stored: int = 0
    bytes_stored: int = 0
    inserts: int = 0
    retries: int = 0
    insert_seconds: float = 0.0
    writer_cpu_seconds: float = 0.0
    queued_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (for logs and JSON)."""
        return attrs.asdict(self)


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

    def put(self, records: Sequence[CaptureRecord]) -> None:
        """Records were queued."""
        self._add(records_put=len(records), bytes_put=sum(len(r.payload) for r in records))

    def inserted(self, batch: Batch) -> None:
        """A batch was stored."""
        self._add(
            records_stored=len(batch.records),
            bytes_stored=sum(len(r.payload) for r in batch.records),
            inserts=1,
        )

    def retried(self) -> None:
        """An insert is being retried."""
        self._add(retries=1)

    def insert_time(self, wall_s: float, cpu_s: float) -> None:
        """Time one insert (with its retries) took."""
        self._add(insert_seconds=wall_s, writer_cpu_seconds=cpu_s)

    def snapshot(self, *, queued_bytes: int = 0) -> SinkStats:
        """The counters now."""
        with self._lock:
            return attrs.evolve(self._s, queued_bytes=queued_bytes)
