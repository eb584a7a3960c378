""":class:`NullSink`: the record sink of runs without persistence (``DMX_DB_URL=none``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import RequestManifest, RunInfo

__all__ = ["NullSink"]


class NullSink:
    """A :class:`~dmi_sglang.columns.RecordSink` that stores nothing and never fails.

    It counts what it is given, so a benchmark can check that every record reached the
    sink; capture-only runs thus do all the work of a stored run up to the sink call.

    Attributes:
        records_put / bytes_put / batches_put: records, payload bytes and non-empty
            batches handed to ``put``.
        runs_started / runs_finished: ``start_run`` and ``finish_run`` arguments.
        requests_committed: manifests given to ``commit_requests``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records_put = 0
        self.bytes_put = 0
        self.batches_put = 0
        self.runs_started: list[RunInfo] = []
        self.runs_finished: list[RunInfo] = []
        self.requests_committed = 0

    def start_run(self, run: RunInfo) -> None:
        """Remember the run (nothing is stored)."""
        self.runs_started.append(run)

    def put(self, batch: RecordBatch) -> None:
        """Count the batch's records and bytes and drop it."""
        if not len(batch):
            return
        with self._lock:
            self.records_put += len(batch)
            self.bytes_put += batch.nbytes
            self.batches_put += 1

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        """Count the manifests (nothing is stored)."""
        with self._lock:
            self.requests_committed += len(manifests)

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
