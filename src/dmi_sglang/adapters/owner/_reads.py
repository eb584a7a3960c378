"""Reads through the store owner, over a ZeroMQ IPC socket.

The owner (the store owner process of a capturing run, which holds the embedded store)
runs a :class:`ReadService`: a daemon thread with a REP socket bound at an
``ipc://`` address (the server makes it in a directory only its user can enter).
Each request is JSON naming one read-only ``RecordReader`` method and its arguments
(strings, integers, null): nothing in a request is ever unpickled. The thread calls the
method on a reader of its own (several clients of one process may hold the embedded store
at once) and answers the result pickled, or the error's kind and message; records go as
their fields pickled plus one frame per payload, and an export's record batches
(``batches_within``) as their headers pickled plus one frame per column and payload, all
sent and received without a copy. Queries run off the serving threads and release the
GIL; the Python side of an answer still takes the owner's GIL, which is why an export
reads record batches (no Python object per record) in bounded pieces (``app.export``).

:class:`RemoteReader` is the ``RecordBatchReader`` of the other process: one short-lived REQ
socket per call (thread-safe, and a lost answer cannot be taken for the next one's),
bounded by :data:`READ_TIMEOUT_S`; a missing owner fails within a second. It unpickles the owner's
answers: the owner is a process of the same server, and only ``ipc://`` addresses in a
directory of this user's alone are served (:func:`check_address`).
"""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import structlog

from dmi_sglang.adapters.owner._frames import (
    FRAMES_PER_BATCH,
    batch_from_frames,
    batch_to_frames,
)
from dmi_sglang.adapters.owner._service import (
    SocketService,
    check_address,
    exchange,
    request_socket,
)
from dmi_sglang.columns import RecordBatch, RecordBatchReader
from dmi_sglang.domain.ports import HookTotal, RequestExtents, RequestSummary
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo
from dmi_sglang.errors import StoreError

__all__ = ["READ_TIMEOUT_S", "ReadService", "RemoteReader"]

log = structlog.get_logger(__name__)

READ_TIMEOUT_S = 30.0
"""Longest a remote read waits for the owner's answer."""

_METHODS = frozenset({"runs", "run", "requests", "manifest", "manifests", "records",
                      "batches_within", "ranges", "extents", "hook_totals"})
"""The reader methods the service answers (reads only: no delete)."""
_RECORD_METHODS = frozenset({"records"})
"""The methods whose answers are records: fields pickled, payloads as frames of their own."""
_BATCH_METHODS = frozenset({"batches_within"})
"""The methods whose answers are record batches: headers pickled, columns and payloads as
frames of their own."""
_ABSENT = object()


class ReadService(SocketService):
    """Answers reads of ``reader`` at ``address`` on a daemon thread.

    Raises:
        StoreError: the address is refused (:func:`check_address`) or cannot be bound
            (another owner holds it).
    """

    def __init__(self, reader: RecordBatchReader, address: str) -> None:
        self._reader = reader
        super().__init__(address, "dmi-store-reads")
        log.info("dmi.reads_served", address=address)

    def _answer(self, frames: list[Any]) -> list[Any]:
        try:
            method, args, kwargs = _parse(frames[0].bytes)
            with self._reader.session():
                result = getattr(self._reader, method)(*args, **kwargs)
            if method in _RECORD_METHODS:
                fields = [(r.model_id, r.request_id, r.act_name, r.layer_no, r.shard_rank,
                           r.start_token_idx, r.end_token_idx, r.dtype, r.shape, r.seq)
                          for r in result]
                return [pickle.dumps(("records", fields), protocol=pickle.HIGHEST_PROTOCOL),
                        *(r.payload for r in result)]
            if method in _BATCH_METHODS:
                sent = [batch_to_frames(b) for b in result]
                return [pickle.dumps(("batches", [h for h, _ in sent]),
                                     protocol=pickle.HIGHEST_PROTOCOL),
                        *(f for _, frames in sent for f in frames)]
            return [pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)]
        except Exception as exc:
            kind = "store" if isinstance(exc, StoreError) else type(exc).__name__
            return [pickle.dumps(("error", kind, str(exc)))]


def _parse(request: bytes) -> tuple[str, list[Any], dict[str, Any]]:
    """A request's method and arguments: JSON of plain values only.

    Raises:
        StoreError: not such a request, or a method the owner does not answer.
    """
    try:
        body = json.loads(request)
        method, args, kwargs = body["method"], body["args"], body["kwargs"]
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"not a store read request: {exc}"
        raise StoreError(msg) from None
    refused = f"the store owner does not answer {str(method)[:64]!r} with these arguments"
    if method not in _METHODS or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise StoreError(refused)
    captures = kwargs.pop("captures", _ABSENT) if method == "batches_within" else _ABSENT
    if (not all(_plain(v) for v in (*args, *kwargs.values()))
            or (captures is not _ABSENT and not _captures(captures))):
        raise StoreError(refused)
    if isinstance(captures, list):
        kwargs["captures"] = [(act, layer) for act, layer in captures]
    return method, args, kwargs


def _plain(value: object) -> bool:
    return isinstance(value, (str, int, type(None))) and not isinstance(value, bool)


def _captures(value: object) -> bool:
    """``[[act_name, layer_no], ...]`` with 32-bit layers (the store's column): the one
    structured argument (``batches_within``'s)."""
    return isinstance(value, list) and all(
        isinstance(c, list) and len(c) == 2 and isinstance(c[0], str)
        and isinstance(c[1], int) and not isinstance(c[1], bool)
        and -(1 << 31) <= c[1] < (1 << 31) for c in value)


class RemoteReader:
    """A :class:`~dmi_sglang.columns.RecordBatchReader` that reads through the store
    owner's :class:`ReadService` at ``address``."""

    def __init__(self, address: str, *, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.address = check_address(address)
        self._timeout_ms = max(1, int(timeout_s * 1000))

    @contextlib.contextmanager
    def session(self) -> Iterator[RemoteReader]:
        """Nothing to hold: each call is one exchange with the owner."""
        yield self

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        request = json.dumps({"method": method, "args": list(args), "kwargs": kwargs})
        socket = request_socket(self.address, self._timeout_ms, "reads")
        try:
            frames = exchange(socket, [request.encode()], address=self.address,
                              timeout_ms=self._timeout_ms, channel="reads", method=method)
        finally:
            socket.close()
        answer = pickle.loads(frames[0].buffer)  # the owner is ours (module docstring)
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "records":
            try:  # payloads: read-only views of the frames (each keeps its frame alive)
                return [CaptureRecord(m, r, a, ln, sr, lo, hi, d, shape,
                                      frame.buffer.toreadonly(), seq)
                        for (m, r, a, ln, sr, lo, hi, d, shape, seq), frame
                        in zip(answer[1], frames[1:], strict=True)]
            except (TypeError, ValueError) as exc:
                msg = (f"the store's owner answered {method} with records that do not fit "
                       f"their {len(frames) - 1} payloads: {exc}")
                raise StoreError(msg) from exc
        if answer[0] == "batches":
            headers, body = answer[1], frames[1:]
            try:
                if len(body) != len(headers) * FRAMES_PER_BATCH:
                    msg = f"{len(body)} frames for {len(headers)} batches"
                    raise ValueError(msg)
                return [batch_from_frames(h, body[i * FRAMES_PER_BATCH :
                                                  (i + 1) * FRAMES_PER_BATCH])
                        for i, h in enumerate(headers)]
            except ValueError as exc:
                msg = f"the store's owner answered {method} with batches that do not fit: {exc}"
                raise StoreError(msg) from exc
        _, kind, message = answer
        if kind == "store":
            raise StoreError(message)
        msg = f"the store's owner failed to answer {method}: {kind}: {message}"
        raise StoreError(msg)

    def runs(self) -> Sequence[RunInfo]:
        """Every run in the store, newest first."""
        return self._call("runs")  # type: ignore[no-any-return]

    def run(self, run_id: str) -> RunInfo | None:
        """One run's latest state, or None."""
        return self._call("run", run_id)  # type: ignore[no-any-return]

    def requests(self, run_id: str) -> Sequence[RequestSummary]:
        """Requests of a run with their sizes."""
        return self._call("requests", run_id)  # type: ignore[no-any-return]

    def manifest(self, run_id: str, request_id: str) -> RequestManifest | None:
        """The request's manifest, or None."""
        return self._call("manifest", run_id, request_id)  # type: ignore[no-any-return]

    def manifests(self, run_id: str) -> Sequence[RequestManifest]:
        """The latest manifest of each request of a run."""
        return self._call("manifests", run_id)  # type: ignore[no-any-return]

    def records(self, run_id: str, request_id: str, *, act_name: str | None = None,
                layer_no: int | None = None, start: int | None = None,
                end: int | None = None) -> Sequence[CaptureRecord]:
        """Stored records of a request, filtered as the port says."""
        return self._call(  # type: ignore[no-any-return]
            "records", run_id, request_id, act_name=act_name, layer_no=layer_no,
            start=start, end=end)

    def batches_within(self, run_id: str, request_id: str, *,
                       captures: Sequence[tuple[str, int]], start: int,
                       end: int) -> Sequence[RecordBatch]:
        """The records of the ``captures`` overlapping ``[start, end)``, cut to it, as
        record batches over the received frames (read-only, no copy)."""
        return self._call(  # type: ignore[no-any-return]
            "batches_within", run_id, request_id,
            captures=[[act, layer] for act, layer in captures], start=start, end=end)

    def ranges(self, run_id: str,
               request_id: str) -> Sequence[tuple[str, int, int, int, int]]:
        """Distinct ``(act_name, layer_no, shard_rank, start, end)`` of a request's
        records."""
        return self._call("ranges", run_id, request_id)  # type: ignore[no-any-return]

    def extents(self, run_id: str, request_id: str) -> RequestExtents:
        """A request's stored ranges and row layouts."""
        return self._call("extents", run_id, request_id)  # type: ignore[no-any-return]

    def hook_totals(self, run_id: str) -> Sequence[HookTotal]:
        """Per act_name of a run, its footprint."""
        return self._call("hook_totals", run_id)  # type: ignore[no-any-return]

    def delete_run(self, run_id: str) -> int:
        """Refused: a serving process deletes nothing.

        Raises:
            StoreError: always.
        """
        msg = f"run {run_id!r} cannot be deleted through a serving process's reads"
        raise StoreError(msg)
