"""Captured records as columns, the sink port that takes them and the reader port that
reads them back so (:class:`RecordBatchReader`).

The hot path never builds one Python object per record: the transport hands the sink
:class:`RecordBatch` values, a few numpy columns over one contiguous payload buffer (record
``i``'s bytes are ``payload[offsets[i]:offsets[i + 1]]``), which the store inserts as one
columnar block without copying the payload. :class:`~dmi_sglang.domain.records.CaptureRecord`
stays the unit of reading and of small writes (:meth:`RecordBatch.from_records`,
:meth:`RecordBatch.records`).

This module sits beside the domain (which never imports numpy), like
:mod:`dmi_sglang.tensor_ports`; it imports numpy and the domain only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from dmi_sglang.domain.ports import RecordReader
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo
from dmi_sglang.domain.shapes import DType

__all__ = ["CaptureKey", "RecordBatch", "RecordBatchReader", "RecordSink"]

Int32s = npt.NDArray[np.int32]
Int64s = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]


@attrs.frozen
class CaptureKey:
    """What one captured tensor is: hook name, layer, dtype and the dims of one row."""

    act_name: str
    layer_no: int
    dtype: str
    dims: tuple[int, ...]
    _row_nbytes: int = attrs.field(init=False, default=-1, eq=False, hash=False, repr=False)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row."""
        n = self._row_nbytes
        if n < 0:  # every batch's check reads it (per capture, per batch): computed once
            n = math.prod(self.dims) * DType.parse(self.dtype).itemsize
            object.__setattr__(self, "_row_nbytes", n)
        return n


def _column(values: object, dtype: type[np.generic], name: str, n: int) -> np.ndarray:
    # Contiguous and aligned to the element: a column received over a socket may start at
    # any byte (zmq slices messages out of its read buffer); such a column is copied (a
    # few bytes a record), since Arrow's readers expect aligned values and warn otherwise.
    arr = np.ascontiguousarray(values, dtype=dtype)
    if not arr.flags.aligned:
        arr = arr.copy()
    if arr.ndim != 1 or arr.shape[0] != n:
        msg = f"RecordBatch column {name!r} has shape {arr.shape}, expected ({n},)"
        raise ValueError(msg)
    return arr


@attrs.frozen(eq=False)
class RecordBatch:
    """Records of one run (one shard) as columns over one payload buffer.

    Each record is one row of the store's records table: ``request_ids[request[i]]``,
    ``captures[capture[i]]``, positions ``[start[i], end[i])``, capture step ``seq[i]``
    and payload ``payload[offsets[i]:offsets[i + 1]]`` (raw, native-endian rows). Payloads
    are contiguous and in record order, so a store reads them as one binary column
    (offsets plus data) without a copy. The batch keeps ``payload`` alive; pooled memory
    it is a view of returns when the last batch (or columnar block) over it is gone.

    The constructor checks the columns (one length, offsets rising from where they start,
    every payload exactly ``rows x row bytes`` of its capture) in vectorised numpy.

    Raises:
        ValueError: inconsistent columns (a bug in whoever built the batch).
    """

    run_id: str
    request_ids: tuple[str, ...]
    captures: tuple[CaptureKey, ...]
    request: Int32s = attrs.field(repr=False)
    capture: Int32s = attrs.field(repr=False)
    start: Int32s = attrs.field(repr=False)
    end: Int32s = attrs.field(repr=False)
    seq: Int64s = attrs.field(repr=False)
    offsets: Int64s = attrs.field(repr=False)
    payload: Bytes = attrs.field(repr=False)
    shard_rank: int = 0

    def __attrs_post_init__(self) -> None:
        n = len(self.request)
        set_ = object.__setattr__
        set_(self, "request", _column(self.request, np.int32, "request", n))
        set_(self, "capture", _column(self.capture, np.int32, "capture", n))
        set_(self, "start", _column(self.start, np.int32, "start", n))
        set_(self, "end", _column(self.end, np.int32, "end", n))
        set_(self, "seq", _column(self.seq, np.int64, "seq", n))
        set_(self, "offsets", _column(self.offsets, np.int64, "offsets", n + 1))
        payload = self.payload
        if payload.dtype != np.uint8 or payload.ndim != 1:
            msg = f"RecordBatch payload must be 1-D uint8, got {payload.dtype} {payload.shape}"
            raise ValueError(msg)
        if not n:
            return
        if self.request.min() < 0 or self.request.max() >= len(self.request_ids):
            msg = "RecordBatch request index out of range"
            raise ValueError(msg)
        if self.capture.min() < 0 or self.capture.max() >= len(self.captures):
            msg = "RecordBatch capture index out of range"
            raise ValueError(msg)
        rows = self.end.astype(np.int64) - self.start
        if rows.min() < 1:
            msg = "RecordBatch holds a record without rows (end <= start)"
            raise ValueError(msg)
        sizes = np.diff(self.offsets)
        row_nbytes = np.array([c.row_nbytes for c in self.captures], dtype=np.int64)
        if not np.array_equal(sizes, rows * row_nbytes[self.capture]):
            msg = "RecordBatch payload sizes differ from rows x row bytes of their capture"
            raise ValueError(msg)
        if self.offsets[0] < 0 or self.offsets[-1] > payload.shape[0]:
            msg = (f"RecordBatch offsets [{self.offsets[0]}, {self.offsets[-1]}] leave its "
                   f"payload of {payload.shape[0]} bytes")
            raise ValueError(msg)

    def __len__(self) -> int:
        return len(self.request)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the records."""
        return int(self.offsets[-1] - self.offsets[0]) if len(self) else 0

    @property
    def rows(self) -> int:
        """Tensor rows of the records (positions x records)."""
        return int((self.end.astype(np.int64) - self.start).sum())

    def split(self, max_bytes: int) -> list[RecordBatch]:
        """The records, in order, as batches of at most ``max_bytes`` payload bytes each
        (a record larger than that makes a batch alone), over this batch's columns and
        payload: views, nothing copied; the batch itself when it fits.

        Raises:
            ValueError: ``max_bytes`` is not positive.
        """
        if max_bytes < 1:
            msg = f"RecordBatch.split: max_bytes={max_bytes}; expected at least 1"
            raise ValueError(msg)
        n = len(self)
        if self.nbytes <= max_bytes:
            return [self]
        out: list[RecordBatch] = []
        first = 0
        while first < n:  # the most records from `first` whose payloads fit, one at least
            limit = int(self.offsets[first]) + max_bytes
            last = max(first + 1, int(np.searchsorted(self.offsets, limit, side="right")) - 1)
            out.append(self._records_between(first, last))
            first = last
        return out

    def _records_between(self, first: int, last: int) -> RecordBatch:
        """Records ``first:last`` over the same columns and payload (views), made without
        the constructor's checks: a slice of a checked batch passes them (they cost about
        40 µs a piece, on the drain's thread)."""
        piece = object.__new__(RecordBatch)
        set_ = object.__setattr__
        for name in ("run_id", "request_ids", "captures", "payload", "shard_rank"):
            set_(piece, name, getattr(self, name))
        for name in ("request", "capture", "start", "end", "seq"):
            set_(piece, name, getattr(self, name)[first:last])
        set_(piece, "offsets", self.offsets[first:last + 1])
        return piece

    def records(self) -> Iterator[CaptureRecord]:
        """The records one by one, payloads as read-only views of the batch's buffer
        (for reading and tests; the hot path never does this)."""
        view = memoryview(self.payload).toreadonly()  # type: ignore[arg-type]
        for i in range(len(self)):
            key = self.captures[self.capture[i]]
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            start, end = int(self.start[i]), int(self.end[i])
            yield CaptureRecord(self.run_id, self.request_ids[self.request[i]], key.act_name,
                                key.layer_no, self.shard_rank, start, end, key.dtype,
                                (end - start, *key.dims), view[a:b], int(self.seq[i]))

    def shapes(self) -> tuple[Int32s, Int64s]:
        """The ``shape`` column as list offsets (``n + 1``) and flat values: record ``i``
        has shape ``(rows, *dims of its capture)``."""
        ndim = np.array([1 + len(c.dims) for c in self.captures], dtype=np.int32)
        per = ndim[self.capture]
        list_offsets = np.zeros(len(self) + 1, dtype=np.int32)
        np.cumsum(per, out=list_offsets[1:])
        values = np.empty(int(list_offsets[-1]), dtype=np.int64)
        values[list_offsets[:-1]] = self.end.astype(np.int64) - self.start
        for c, key in enumerate(self.captures):
            at = list_offsets[:-1][self.capture == c]
            for j, d in enumerate(key.dims, start=1):
                values[at + j] = d
        return list_offsets, values

    @classmethod
    def from_records(cls, records: Sequence[CaptureRecord], *,
                     payload: Bytes | None = None) -> RecordBatch:
        """A batch of ``records`` (small writes, held rows, tests). The records must share
        one run and shard.

        Args:
            payload: the records' payloads already back to back in one 1-D uint8 buffer,
                in record order: the batch is a view of it (no copy). None: the payloads
                are copied into a new buffer.

        Raises:
            ValueError: records of several runs or shards, an inconsistent record, or a
                ``payload`` of another size than the records' payloads together.
        """
        if not records:
            msg = "RecordBatch.from_records needs at least one record"
            raise ValueError(msg)
        first = records[0]
        requests: dict[str, int] = {}
        captures: dict[CaptureKey, int] = {}
        n = len(records)
        request = np.empty(n, dtype=np.int32)
        capture = np.empty(n, dtype=np.int32)
        start = np.empty(n, dtype=np.int32)
        end = np.empty(n, dtype=np.int32)
        seq = np.empty(n, dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        for i, r in enumerate(records):
            if r.model_id != first.model_id or r.shard_rank != first.shard_rank:
                msg = (f"records of runs/shards {first.model_id!r}/{first.shard_rank} and "
                       f"{r.model_id!r}/{r.shard_rank} in one batch")
                raise ValueError(msg)
            key = CaptureKey(r.act_name, r.layer_no, r.dtype, tuple(r.shape[1:]))
            request[i] = requests.setdefault(r.request_id, len(requests))
            capture[i] = captures.setdefault(key, len(captures))
            start[i], end[i], seq[i] = r.start_token_idx, r.end_token_idx, r.seq
            offsets[i + 1] = offsets[i] + len(r.payload)
        if payload is None:
            payload = np.empty(int(offsets[-1]), dtype=np.uint8)
            for i, r in enumerate(records):
                payload[offsets[i] : offsets[i + 1]] = np.frombuffer(r.payload, dtype=np.uint8)
        elif payload.shape != (int(offsets[-1]),):
            msg = (f"payload of shape {payload.shape} given for records of "
                   f"{int(offsets[-1])} payload bytes")
            raise ValueError(msg)
        return cls(first.model_id, tuple(requests), tuple(captures), request, capture, start,
                   end, seq, offsets, payload, shard_rank=first.shard_rank)


@runtime_checkable
class RecordSink(Protocol):
    """**Port**: accepts record batches for durable storage.

    ``put`` may block (backpressure) but never drops. Failures are sticky: once the sink
    failed, ``put``, ``flush`` and ``close`` raise the original cause.
    """

    def start_run(self, run: RunInfo) -> None:
        """Record that a run started (before any record of it)."""
        ...

    def put(self, batch: RecordBatch) -> None:
        """Queue a batch for insertion; blocks while the queue is full. The sink may keep
        the batch (and its payload memory) until it is stored."""
        ...

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        """Store these committed manifests once every batch put before this call is
        stored (never earlier: a committed manifest says the request's rows are all
        there). Does not block; ``flush`` waits for them too."""
        ...

    def flush(self) -> None:
        """Block until everything queued is stored, manifests of ``commit_requests``
        included; raise the sticky failure if any."""
        ...

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """Flush, make the run's files durable, then write the manifests and the run's
        final status."""
        ...

    def close(self) -> None:
        """Release the store (the embedded engine admits one process at a time)."""
        ...


@runtime_checkable
class RecordBatchReader(RecordReader, Protocol):
    """**Port**: a :class:`~dmi_sglang.domain.ports.RecordReader` that also reads rows
    as record batches (an export's reads: no Python object per record)."""

    def batches_within(self, run_id: str, request_id: str, *,
                       captures: Sequence[tuple[str, int]], start: int,
                       end: int) -> Sequence[RecordBatch]:
        """The records of the ``captures`` (``(act_name, layer_no)`` pairs) overlapping
        positions ``[start, end)``, each cut to that range (only those rows' bytes are
        read back), as one batch per ``shard_rank`` (in ``shard_rank`` order), records
        in act_name, layer, start and ``seq`` order: an export's memory is bounded by
        what it asks at once, not by the records' sizes, and the hooks and layers asked
        together are read in one pass over the store."""
        ...
