"""Reads through the store owner, over a ZeroMQ IPC socket.

The owner (today a server's scheduler, which holds the embedded store while its run
captures) runs a :class:`ReadService`: a daemon thread with a REP socket bound at an
``ipc://`` address (the server makes it in a directory only its user can enter).
Each request names one read-only ``RecordReader`` method and its arguments; the thread
calls it on a reader of its own (several clients of one process may hold the embedded
store at once) and answers the result, or the error's kind and message. Queries run off
the scheduler's thread; the engine's query work runs outside the GIL.

:class:`RemoteReader` is the ``RecordReader`` of the other process: one short-lived REQ
socket per call (thread-safe, and a lost answer cannot be taken for the next one's),
bounded by :data:`READ_TIMEOUT_S`. Answers are pickled: both ends are this library in
processes of one server, and the socket's directory admits no other user.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import structlog

from dmi_sglang.domain.ports import HookTotal, RecordReader, RequestSummary, RowLayout
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo
from dmi_sglang.errors import StoreError

__all__ = ["READ_TIMEOUT_S", "ReadService", "RemoteReader"]

log = structlog.get_logger(__name__)

READ_TIMEOUT_S = 120.0
"""Longest a remote read waits for the owner's answer."""

_METHODS = frozenset({"runs", "run", "requests", "manifest", "records", "ranges",
                      "row_layouts", "hook_totals"})
"""The reader methods the service answers (reads only: no delete)."""


class ReadService:
    """Answers reads of ``reader`` at ``address`` on a daemon thread.

    Raises:
        StoreError: the address cannot be bound (another owner holds it).
    """

    def __init__(self, reader: RecordReader, address: str) -> None:
        import zmq

        self._reader = reader
        self.address = address
        self._socket: Any = zmq.Context.instance().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close()
            msg = f"cannot answer store reads at {address}: {exc}"
            raise StoreError(msg) from exc
        self._closed = threading.Event()
        self.answered = 0
        self._thread = threading.Thread(target=self._serve, name="dmi-store-reads",
                                        daemon=True)
        self._thread.start()
        log.info("dmi.reads_served", address=address)

    def close(self) -> None:
        """Stop answering (the thread ends within its poll interval)."""
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
                request = self._socket.recv()
                self._socket.send(self._answer(request))
                self.answered += 1
        except Exception as exc:  # the channel is gone: readers get timeouts, serving goes on
            log.error("dmi.reads_failed", error=repr(exc))
        finally:
            self._socket.close()

    def _answer(self, request: bytes) -> bytes:
        try:
            method, args, kwargs = pickle.loads(request)  # both ends are ours (module docstring)
            if method not in _METHODS:
                msg = f"the store owner does not answer {method!r}"
                raise StoreError(msg)
            with self._reader.session():
                result = getattr(self._reader, method)(*args, **kwargs)
            return pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            kind = "store" if isinstance(exc, StoreError) else type(exc).__name__
            return pickle.dumps(("error", kind, str(exc)))


class RemoteReader:
    """A :class:`~dmi_sglang.domain.ports.RecordReader` that reads through the store
    owner's :class:`ReadService` at ``address``."""

    def __init__(self, address: str, *, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.address = address
        self._timeout_ms = max(1, int(timeout_s * 1000))

    @contextlib.contextmanager
    def session(self) -> Iterator[RemoteReader]:
        """Nothing to hold: each call is one exchange with the owner."""
        yield self

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import zmq

        socket: Any = zmq.Context.instance().socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        try:
            socket.connect(self.address)
            socket.send(pickle.dumps((method, args, kwargs)))
            answer = pickle.loads(socket.recv())  # both ends are ours (module docstring)
        except zmq.Again as exc:
            msg = (f"the store's owner did not answer {method} within "
                   f"{self._timeout_ms / 1000:g} s ({self.address})")
            raise StoreError(msg) from exc
        finally:
            socket.close()
        if answer[0] == "ok":
            return answer[1]
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

    def records(self, run_id: str, request_id: str, *, act_name: str | None = None,
                layer_no: int | None = None, start: int | None = None,
                end: int | None = None) -> Sequence[CaptureRecord]:
        """Stored records of a request, filtered as the port says."""
        return self._call(  # type: ignore[no-any-return]
            "records", run_id, request_id, act_name=act_name, layer_no=layer_no,
            start=start, end=end)

    def ranges(self, run_id: str, request_id: str) -> Sequence[tuple[str, int, int, int]]:
        """Distinct ``(act_name, layer_no, start, end)`` of a request's records."""
        return self._call("ranges", run_id, request_id)  # type: ignore[no-any-return]

    def row_layouts(self, run_id: str, request_id: str) -> Sequence[RowLayout]:
        """Per stored hook and layer of a request, its dtype and row shape."""
        return self._call("row_layouts", run_id, request_id)  # type: ignore[no-any-return]

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
