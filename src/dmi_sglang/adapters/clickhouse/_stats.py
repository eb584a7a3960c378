"""Sink statistics, and :class:`NullSink` (no persistence, counts only)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo

if TYPE_CHECKING:
    from dmi_sglang.adapters.clickhouse._queue import Batch

__all__ = ["NullSink", "SinkStats", "StatsCounter"]


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


class NullSink:
    """A :class:`~dmi_sglang.domain.ports.RecordSink` that stores nothing.

    For transport-only runs (``DMX_DB_URL=none``): it counts what it is given, so a
    benchmark can check that every record reached the sink, and never fails.
    """

    def __init__(self) -> None:
        self._stats = StatsCounter()
        self.runs_started: list[RunInfo] = []
        self.runs_finished: list[RunInfo] = []

    def start_run(self, run: RunInfo) -> None:
        """Remember the run (nothing is stored)."""
        self.runs_started.append(run)

    def put(self, records: Sequence[CaptureRecord]) -> None:
        """Count the records and drop them."""
        self._stats.put(records)

    def flush(self) -> None:
        """Nothing to flush."""

    def finish_run(
        self,
        run: RunInfo,
        manifests: Sequence[RequestManifest],  # noqa: ARG002 -- the port's signature
    ) -> None:
        """Remember the run's final state (manifests are dropped)."""
        self.runs_finished.append(run)

    def close(self) -> None:
        """Nothing to release."""

    def stats(self) -> SinkStats:
        """Records and bytes put so far (nothing is ever stored)."""
        return self._stats.snapshot()
