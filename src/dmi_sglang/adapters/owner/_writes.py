"""Writes through the store owner, over a ZeroMQ IPC socket: the records of several
processes (the ranks of a tensor-parallel run) reach one run in one embedded store, which
admits one process at a time.

The owner runs a :class:`SinkService` over the ``RecordSink`` it holds: a daemon thread
with a REP socket bound at an ``ipc://`` address in a directory only its user can enter
(:func:`~dmi_sglang.adapters.owner.check_address`). :class:`RemoteSink` is the
``RecordSink`` of another process: each call is one exchange, answered once the owner's
sink returned, so the sink's backpressure (``put`` blocks while its queue is full) and its
sticky failures reach the caller as they are. Nothing a client sends is unpickled: a
request is a JSON header (the method; runs and manifests as their fields; a batch's run,
request ids and capture keys) plus, for ``put``, one frame per column and the payload,
received without a copy and kept alive by the batch the owner's sink stores.

``close`` ends the caller's use only: the owner's sink stays open for the other processes
and its owner closes it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import structlog

from dmi_sglang.adapters.owner._frames import batch_from_frames, batch_to_frames
from dmi_sglang.adapters.owner._reads import check_address
from dmi_sglang.columns import RecordBatch, RecordSink
from dmi_sglang.domain.records import RequestManifest, RunInfo, RunStatus
from dmi_sglang.errors import StoreError

__all__ = ["WRITE_TIMEOUT_S", "RemoteSink", "SinkService"]

log = structlog.get_logger(__name__)

WRITE_TIMEOUT_S = 300.0
"""Longest a remote sink call waits for the owner (a ``put`` waits while the owner's
queue is full; a ``finish_run`` syncs the run's files)."""

_SEND_TIMEOUT_MS = 1000


def _run_fields(run: RunInfo) -> dict[str, Any]:
    return {**attrs.asdict(run, recurse=False), "status": run.status.value}


def _run(fields: Any) -> RunInfo:
    return RunInfo(
        run_id=str(fields["run_id"]), model_path=str(fields["model_path"]),
        settings=tuple((str(k), str(v)) for k, v in fields["settings"]),
        captures=tuple((str(a), int(n)) for a, n in fields["captures"]),
        started_at=str(fields["started_at"]), stopped_at=str(fields["stopped_at"]),
        status=RunStatus(fields["status"]), error=str(fields["error"]),
        owner=str(fields["owner"]))


def _manifest(fields: Any) -> RequestManifest:
    return RequestManifest(
        model_id=str(fields["model_id"]), request_id=str(fields["request_id"]),
        prompt_tokens=int(fields["prompt_tokens"]),
        completion_tokens=int(fields["completion_tokens"]),
        computed_from=int(fields["computed_from"]),
        overlap_extra_forward=bool(fields["overlap_extra_forward"]),
        committed=bool(fields["committed"]))


class SinkService:
    """Takes other processes' ``RecordSink`` calls for ``sink`` at ``address``, on a
    daemon thread, one call at a time.

    Raises:
        StoreError: the address is refused (``check_address``) or cannot be bound.
    """

    def __init__(self, sink: RecordSink, address: str) -> None:
        import zmq

        check_address(address)
        if os.path.lexists(address.removeprefix("ipc://")):  # a bind would take it over
            msg = f"cannot take store writes at {address}: another owner holds it"
            raise StoreError(msg)
        self._sink = sink
        self.address = address
        self._socket: Any = zmq.Context.instance().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close()
            msg = f"cannot take store writes at {address}: {exc}"
            raise StoreError(msg) from exc
        self._closed = threading.Event()
        self.calls = 0
        self._thread = threading.Thread(target=self._serve, name="dmi-store-writes",
                                        daemon=True)
        self._thread.start()
        log.info("dmi.writes_taken", address=address)

    def close(self) -> None:
        """Stop taking calls (the thread ends within its poll interval, or once the call
        it is in returns)."""
        self._closed.set()
        self._thread.join(5)

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._closed.is_set():
                if not poller.poll(200):
                    continue
                frames = self._socket.recv_multipart(copy=False)
                answer = self._answer(frames)
                try:
                    self._socket.send(answer)
                except zmq.ZMQError as exc:  # the caller went away: its call is lost
                    log.error("dmi.write_answer_failed", error=repr(exc))
                self.calls += 1
        finally:
            self._socket.close()

    def _answer(self, frames: list[Any]) -> bytes:
        try:
            header = json.loads(frames[0].bytes)
            method = header["method"]
            if method == "put":
                self._sink.put(batch_from_frames(header, frames[1:]))
            elif method == "start_run":
                self._sink.start_run(_run(header["run"]))
            elif method == "commit_requests":
                self._sink.commit_requests([_manifest(m) for m in header["manifests"]])
            elif method == "flush":
                self._sink.flush()
            elif method == "finish_run":
                self._sink.finish_run(_run(header["run"]),
                                      [_manifest(m) for m in header["manifests"]])
            else:
                msg = f"the store owner takes no {str(method)[:64]!r} call"
                raise StoreError(msg)
        except StoreError as exc:
            return json.dumps(["store", str(exc)]).encode()
        except Exception as exc:  # a malformed call, or the sink's own failure
            return json.dumps([type(exc).__name__, str(exc)]).encode()
        return b'["ok"]'


class RemoteSink:
    """A :class:`~dmi_sglang.columns.RecordSink` that writes through the store owner's
    :class:`SinkService` at ``address`` (one exchange per call, on one socket; calls of
    several threads take turns)."""

    def __init__(self, address: str, *, timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self.address = check_address(address)
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._lock = threading.Lock()
        self._socket: Any = None
        self._failure: StoreError | None = None

    def start_run(self, run: RunInfo) -> None:
        """The owner's sink records the run's start."""
        self._call({"method": "start_run", "run": _run_fields(run)})

    def put(self, batch: RecordBatch) -> None:
        """Hand the batch to the owner's sink; returns once it took it (blocks while the
        owner's queue is full). The batch's memory is free again on return."""
        header, frames = batch_to_frames(batch)
        self._call({"method": "put", **header}, frames)

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        """The owner's sink commits these manifests after what was put before."""
        self._call({"method": "commit_requests",
                    "manifests": [attrs.asdict(m) for m in manifests]})

    def flush(self) -> None:
        """Block until the owner's sink stored everything queued."""
        self._call({"method": "flush"})

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """The owner's sink flushes, syncs, and writes the manifests and the run's end."""
        self._call({"method": "finish_run", "run": _run_fields(run),
                    "manifests": [attrs.asdict(m) for m in manifests]})

    def close(self) -> None:
        """End this process's use of the owner (its sink stays open for the others)."""
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None
        if self._failure is not None:
            raise self._failure

    def _call(self, header: dict[str, Any], frames: Sequence[Any] = ()) -> None:
        import zmq

        with self._lock:
            if self._failure is not None:
                raise self._failure
            try:
                socket = self._connected(zmq)
                try:
                    socket.send_multipart([json.dumps(header).encode(), *frames], copy=False)
                except zmq.Again as exc:
                    msg = f"no store owner takes writes at {self.address}"
                    raise StoreError(msg) from exc
                try:
                    answer = json.loads(socket.recv())
                except zmq.Again as exc:
                    msg = (f"the store's owner did not take {header['method']} within "
                           f"{self._timeout_ms / 1000:g} s ({self.address})")
                    raise StoreError(msg) from exc
            except zmq.ZMQError as exc:
                msg = f"writing through the store's owner at {self.address!r} failed: {exc}"
                self._failure = StoreError(msg)
                raise self._failure from exc
            except StoreError as exc:
                self._failure = exc  # a lost exchange leaves the REQ socket unusable
                raise
        if answer[0] == "ok":
            return
        if answer[0] == "store":
            raise StoreError(answer[1])
        msg = f"the store's owner failed {header['method']}: {answer[0]}: {answer[1]}"
        raise StoreError(msg)

    def _connected(self, zmq: Any) -> Any:
        if self._socket is None:
            socket = zmq.Context.instance().socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # no owner listening: the send fails at once
            socket.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
            socket.connect(self.address)
            self._socket = socket
        return self._socket
