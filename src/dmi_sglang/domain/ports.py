"""The ports adapters implement, in domain vocabulary only.

* :class:`RecordSink`: where captured records go (ClickHouse, or nowhere).
* :class:`RecordReader`: reads records and manifests back per (run, request).
* :class:`CaptureTransport`: moves captured tensors from the GPU to the sink, step by step.
* :class:`EngineTap`: the monitored engine's side of the app (attach check, final stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from dmi_sglang.domain.capacity import Preflight
from dmi_sglang.domain.plan import CommitPlan
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo

__all__ = [
    "CaptureTransport",
    "EngineTap",
    "RecordReader",
    "RecordSink",
    "RequestSummary",
    "TransportStats",
]


@runtime_checkable
class RecordSink(Protocol):
    """**Port**: accepts records for durable storage.

    ``put`` may block (backpressure) but never drops. Failures are sticky: once the sink
    failed, ``put``, ``flush`` and ``close`` raise the original cause.
    """

    def start_run(self, run: RunInfo) -> None:
        """Record that a run started (before any record of it)."""
        ...

    def put(self, records: Sequence[CaptureRecord]) -> None:
        """Queue records for insertion; blocks while the queue is full."""
        ...

    def flush(self) -> None:
        """Block until everything queued is durable; raise the sticky failure if any."""
        ...

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """Flush, then write the manifests and the run's final status."""
        ...

    def close(self) -> None:
        """Release the store (the embedded engine admits one process at a time)."""
        ...


@attrs.frozen
class RequestSummary:
    """A request's footprint in the store."""

    run_id: str
    request_id: str
    rows: int
    bytes: int


@runtime_checkable
class RecordReader(Protocol):
    """**Port**: reads captures back. Opens the store per call and closes it after."""

    def runs(self) -> Sequence[RunInfo]:
        """Every run in the store, newest first."""
        ...

    def requests(self, run_id: str) -> Sequence[RequestSummary]:
        """Requests of a run with their sizes."""
        ...

    def run(self, run_id: str) -> RunInfo | None:
        """One run's latest state, or None when the store has no such run."""
        ...

    def manifest(self, run_id: str, request_id: str) -> RequestManifest | None:
        """The request's manifest, or None when the run never wrote one."""
        ...

    def records(
        self,
        run_id: str,
        request_id: str,
        *,
        act_name: str | None = None,
        layer_no: int | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> Sequence[CaptureRecord]:
        """Stored records of a request, optionally of one hook / layer, optionally only
        those overlapping positions ``[start, end)``; superseded copies included."""
        ...

    def ranges(self, run_id: str, request_id: str) -> Sequence[tuple[str, int, int, int]]:
        """Distinct ``(act_name, layer_no, start, end)`` of a request's stored records,
        without payloads (cheap completeness checks)."""
        ...

    def delete_run(self, run_id: str) -> int:
        """Delete a run's records, manifests and run row; returns records deleted."""
        ...


@attrs.frozen
class TransportStats:
    """Per-run statistics of a capture transport.

    Attributes:
        steps: forwards committed with at least one capture.
        tensors: captured tensors.
        rows / bytes: rows and bytes handed to the sink.
        ring_high_water: most payload bytes in flight at once.
        stalls / stall_seconds: times a step waited for the drain, and for how long.
        forced_eager: decode steps run eagerly because their padded plan did not fit.
        piecewise_steps: eager steps committed tensor by tensor.
        discarded_logit_rows: ``final_logits`` rows not stored because they decided no
            generated token (the overlap scheduler's extra forward of a finished request).
    """

    steps: int = 0
    tensors: int = 0
    rows: int = 0
    bytes: int = 0
    ring_high_water: int = 0
    stalls: int = 0
    stall_seconds: float = 0.0
    forced_eager: int = 0
    piecewise_steps: int = 0
    discarded_logit_rows: int = 0


class CaptureTransport(Protocol):
    """**Port**: per-step commits in, records out to a :class:`RecordSink`.

    The tensor-level side (capture points the model calls) belongs to the adapter; this
    is the step protocol the SGLang adapter drives.
    """

    def preflight(self, plan: CommitPlan, eager_plan: CommitPlan | None = None) -> Preflight:
        """How the step would be committed now (see :func:`~.capacity.preflight`)."""
        ...

    def commit(self, plan: CommitPlan, *, step: int) -> None:
        """Reserve ring space for the step (waiting for the drain as needed)."""
        ...

    def seal(self) -> None:
        """The forward finished: hand the step to the drain."""
        ...

    def stop(self) -> TransportStats:
        """Terminal, idempotent: drain everything, flush the sink, raise any failure."""
        ...

    def stats(self) -> TransportStats:
        """Statistics so far."""
        ...


class EngineTap(Protocol):
    """**Port**: the app's handle on monitoring inside a running engine."""

    def assert_active(self, run_id: str) -> None:
        """Raise unless monitoring attached in every scheduler for ``run_id``."""
        ...

    def stop_monitoring(self) -> None:
        """The authoritative flush; terminal; a failure stays failed."""
        ...
