"""Public test doubles for dmi-sglang (in-memory fakes of the domain ports).

They hold their state in plain attributes so tests assert on state, not on calls.
Importing this module is free (no torch, SGLang or ClickHouse).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import attrs

from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.ports import HookTotal, RequestExtents, RequestSummary
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.errors import StoreError

__all__ = ["MemoryReader", "MemorySink"]


class MemorySink:
    """A :class:`~dmi_sglang.columns.RecordSink` that keeps records in a list.

    Thread-safe (the transport's drain thread calls ``put``). Failures are sticky, as the
    port requires: once it failed, ``put``, ``flush`` and ``close`` raise the same error.

    Args:
        delay_s: sleep this long in every ``put`` (a slow store, to force backpressure).
        fail_on_put: fail the n-th ``put`` call (1-based) instead of storing it.
        fail_on_flush: fail every ``flush``.
        keep_records: False keeps only the counters (benchmarks: no memory growth).

    Attributes:
        records: every stored record, in arrival order (payloads are read-only copies
            taken in ``put``: a sink may read a batch any time after it was put, so its
            bytes must be final then, and a test sees what a store would store).
        rows / payload_bytes: rows and payload bytes stored.
        puts: batches put (each ``put`` call, empty batches included); flushes: calls.
        runs / finished: ``start_run`` and ``finish_run`` arguments.
        manifests: every manifest stored, in order (those of ``commit_requests``, then
            those of ``finish_run``, committed only when the run is).
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
        self.manifests: list[RequestManifest] = []
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

    def put(self, batch: RecordBatch) -> None:
        """Store the batch's records (after ``delay_s``), or fail as configured."""
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self._raise_if_failed()
            self.puts += 1
            if self.fail_on_put is not None and self.puts >= self.fail_on_put:
                self.failure = StoreError(f"injected failure on put #{self.puts}")
                raise self.failure
            self.payload_bytes += batch.nbytes
            self.rows += batch.rows
            if self.keep_records:
                self.records.extend(attrs.evolve(batch, payload=batch.payload.copy()).records())

    def flush(self) -> None:
        """Nothing is buffered; fails as configured."""
        with self._lock:
            self._raise_if_failed()
            self.flushes += 1
            if self.fail_on_flush:
                self.failure = StoreError("injected failure on flush")
                raise self.failure

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        """Store committed manifests (every batch put before is stored already)."""
        with self._lock:
            self._raise_if_failed()
            self.manifests.extend(manifests)

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """Flush, then remember the run's end and manifests (a manifest is stored as
        committed only when the run is, as the ClickHouse sink does)."""
        self.flush()
        committed = run.status is RunStatus.COMMITTED
        with self._lock:
            self.finished.append((run, tuple(manifests)))
            self.manifests.extend(attrs.evolve(m, committed=m.committed and committed)
                                  for m in manifests)

    def forget_run(self, run_id: str) -> int:
        """Drop a run's records, run states and manifests; returns the records dropped."""
        with self._lock:
            doomed = sum(1 for r in self.records if r.model_id == run_id)
            self.records = [r for r in self.records if r.model_id != run_id]
            self.runs = [r for r in self.runs if r.run_id != run_id]
            self.finished = [(r, m) for r, m in self.finished if r.run_id != run_id]
            self.manifests = [m for m in self.manifests if m.model_id != run_id]
        return doomed

    def close(self) -> None:
        """Mark the sink closed."""
        with self._lock:
            self._raise_if_failed()
            self.closed = True



class MemoryReader:
    """A :class:`~dmi_sglang.domain.ports.RecordReader` over a :class:`MemorySink`.

    Together they are an in-memory store backend: what the sink was given reads back
    as the ClickHouse reader would return it (latest run state and manifest win).
    """

    def __init__(self, sink: MemorySink) -> None:
        self._sink = sink

    @contextlib.contextmanager
    def session(self) -> Iterator[MemoryReader]:
        """Nothing to open."""
        yield self

    def _states(self) -> list[RunInfo]:
        return [*self._sink.runs, *(run for run, _ in self._sink.finished)]

    def runs(self) -> list[RunInfo]:
        """Every run (latest state of each), newest first."""
        latest: dict[str, RunInfo] = {}
        for run in self._states():
            latest[run.run_id] = run
        return sorted(latest.values(), key=lambda r: r.started_at, reverse=True)

    def run(self, run_id: str) -> RunInfo | None:
        """One run's latest state, or None."""
        states = [r for r in self._states() if r.run_id == run_id]
        return states[-1] if states else None

    def _records(self, run_id: str, request_id: str | None = None) -> list[CaptureRecord]:
        return [r for r in self._sink.records if r.model_id == run_id
                and (request_id is None or r.request_id == request_id)]

    def requests(self, run_id: str) -> list[RequestSummary]:
        """Requests of a run with their stored records and payload bytes."""
        by_request: dict[str, list[CaptureRecord]] = {}
        for r in self._records(run_id):
            by_request.setdefault(r.request_id, []).append(r)
        return [RequestSummary(run_id, rid, len(recs), sum(len(r.payload) for r in recs))
                for rid, recs in sorted(by_request.items())]

    def manifest(self, run_id: str, request_id: str) -> RequestManifest | None:
        """The request's latest manifest, or None."""
        found = [m for m in self._sink.manifests
                 if m.model_id == run_id and m.request_id == request_id]
        return found[-1] if found else None

    def manifests(self, run_id: str) -> list[RequestManifest]:
        """The latest manifest of each request of a run, by request id."""
        latest = {m.request_id: m for m in self._sink.manifests if m.model_id == run_id}
        return [latest[k] for k in sorted(latest)]

    def records(
        self,
        run_id: str,
        request_id: str,
        *,
        act_name: str | None = None,
        layer_no: int | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> list[CaptureRecord]:
        """Stored records of a request, filtered as the port says."""
        return [r for r in self._records(run_id, request_id)
                if (act_name is None or r.act_name == act_name)
                and (layer_no is None or r.layer_no == layer_no)
                and (start is None or r.end_token_idx > start)
                and (end is None or r.start_token_idx < end)]

    def batches_within(self, run_id: str, request_id: str, *,
                       captures: Sequence[tuple[str, int]], start: int,
                       end: int) -> list[RecordBatch]:
        """The records of the ``captures`` overlapping ``[start, end)``, cut to it, one
        batch per shard_rank."""
        if end <= start:
            return []
        wanted = set(captures)
        cut = []
        for r in self.records(run_id, request_id, start=start, end=end):
            if (r.act_name, r.layer_no) not in wanted:
                continue
            lo, hi = max(start, r.start_token_idx), min(end, r.end_token_idx)
            row = len(r.payload) // max(1, r.rows)
            first = lo - r.start_token_idx
            cut.append(attrs.evolve(
                r, start_token_idx=lo, end_token_idx=hi, shape=(hi - lo, *r.shape[1:]),
                payload=bytes(memoryview(r.payload)[first * row : (first + hi - lo) * row])))
        cut.sort(key=lambda r: (r.shard_rank, r.act_name, r.layer_no, r.start_token_idx, r.seq))
        shards = sorted({r.shard_rank for r in cut})
        return [RecordBatch.from_records([r for r in cut if r.shard_rank == k]) for k in shards]

    def ranges(self, run_id: str, request_id: str) -> list[tuple[str, int, int, int, int]]:
        """Distinct ``(act_name, layer_no, shard_rank, start, end)`` of a request's
        records."""
        return sorted({(r.act_name, r.layer_no, r.shard_rank, r.start_token_idx,
                        r.end_token_idx) for r in self._records(run_id, request_id)})

    def extents(self, run_id: str, request_id: str) -> RequestExtents:
        """A request's stored ranges and row layouts."""
        return RequestExtents.from_rows(
            (r.act_name, r.layer_no, r.shard_rank, r.start_token_idx, r.end_token_idx,
             r.dtype, tuple(r.shape[1:])) for r in self._records(run_id, request_id))

    def hook_totals(self, run_id: str) -> list[HookTotal]:
        """Per act_name of a run: layers, records, rows and payload bytes."""
        by_act: dict[str, list[CaptureRecord]] = {}
        for r in self._records(run_id):
            by_act.setdefault(r.act_name, []).append(r)
        return [HookTotal(act, len({r.layer_no for r in recs}), len(recs),
                          sum(r.end_token_idx - r.start_token_idx for r in recs),
                          sum(len(r.payload) for r in recs))
                for act, recs in sorted(by_act.items())]

    def delete_run(self, run_id: str) -> int:
        """Forget a run; returns the records deleted."""
        return self._sink.forget_run(run_id)
