"""Public test doubles for dmi-sglang (in-memory fakes of the domain ports).

They hold their state in plain attributes so tests assert on state, not on calls.
Importing this module is free (no torch, SGLang or ClickHouse).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo
from dmi_sglang.errors import StoreError

__all__ = ["MemorySink"]


class MemorySink:
    """A :class:`~dmi_sglang.domain.ports.RecordSink` that keeps records in a list.

    Thread-safe (the transport's drain thread calls ``put``). Failures are sticky, as the
    port requires: once it failed, ``put``, ``flush`` and ``close`` raise the same error.

    Args:
        delay_s: sleep this long in every ``put`` (a slow store, to force backpressure).
        fail_on_put: fail the n-th ``put`` call (1-based) instead of storing it.
        fail_on_flush: fail every ``flush``.
        keep_records: False keeps only the counters (benchmarks: no memory growth).

    Attributes:
        records: every stored record, in arrival order.
        rows / payload_bytes: rows and payload bytes stored.
        puts / flushes: calls seen.
        runs / finished: ``start_run`` and ``finish_run`` arguments.
        closed: ``close`` was called.
    """

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        fail_on_put: int | None = None,
        fail_on_flush: bool = False,
        keep_records: bool = True,
    ) -> None:
        self.delay_s = delay_s
        self.fail_on_put = fail_on_put
        self.fail_on_flush = fail_on_flush
        self.keep_records = keep_records
        self.records: list[CaptureRecord] = []
        self.payload_bytes = 0
        self.rows = 0
        self.puts = 0
        self.flushes = 0
        self.runs: list[RunInfo] = []
        self.finished: list[tuple[RunInfo, tuple[RequestManifest, ...]]] = []
        self.closed = False
        self.failure: StoreError | None = None
        self._lock = threading.Lock()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def start_run(self, run: RunInfo) -> None:
        """Remember the run."""
        with self._lock:
            self._raise_if_failed()
            self.runs.append(run)

    def put(self, records: Sequence[CaptureRecord]) -> None:
        """Store ``records`` (after ``delay_s``), or fail as configured."""
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self._raise_if_failed()
            self.puts += 1
            if self.fail_on_put is not None and self.puts >= self.fail_on_put:
                self.failure = StoreError(f"injected failure on put #{self.puts}")
                raise self.failure
            for r in records:
                self.payload_bytes += len(r.payload)
                self.rows += r.end_token_idx - r.start_token_idx
            if self.keep_records:
                self.records.extend(records)

    def flush(self) -> None:
        """Nothing is buffered; fails as configured."""
        with self._lock:
            self._raise_if_failed()
            self.flushes += 1
            if self.fail_on_flush:
                self.failure = StoreError("injected failure on flush")
                raise self.failure

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """Flush, then remember the run's end and manifests."""
        self.flush()
        with self._lock:
            self.finished.append((run, tuple(manifests)))

    def close(self) -> None:
        """Mark the sink closed."""
        with self._lock:
            self._raise_if_failed()
            self.closed = True

