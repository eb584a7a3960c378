"""Writes through the store owner, over a ZeroMQ IPC socket: the records of several
processes (the ranks of a tensor-parallel run) reach one run in one embedded store, which
admits one process at a time.

The owner runs a :class:`SinkService` over the ``RecordSink`` it holds: a daemon thread
with a REP socket bound at an ``ipc://`` address in a directory only its user can enter
(:func:`~dmi_sglang.adapters.owner.check_address`), taking one call at a time.
:class:`RemoteSink` is the ``RecordSink`` of another process: each call is one exchange,
answered once the owner's sink returned, so the sink's backpressure (``put`` blocks while
its queue is full) reaches the caller, and a failure the owner's sink reports is the
remote sink's sticky failure too (every later call and ``close`` raise it; only
``finish_run`` still reaches an owner that answers, which records the run failed as a
local sink does). Nothing a
client sends is unpickled: a request is a JSON header (the method; runs and manifests as
their fields; a batch's run, request ids and capture keys) plus, for ``put`` through the
socket, one frame of its columns and one frame per piece of its payload (through a shared
ring: none, the header names the region), received without a copy and kept alive by the
batches the owner's sink stores.

Where it differs from a local sink: every call waits for its exchange, behind the calls
ahead of it (of this process, and of the owner's other writers), so ``commit_requests``
can wait while another writer's ``put`` (all its pieces) is held by backpressure; a call
the owner does not answer within :data:`WRITE_TIMEOUT_S` fails the remote sink for good
(the owner may still store what it was given). Only ``finish_run`` is still sent after
that, on a new socket, waiting at most :data:`AFTER_LOSS_TIMEOUT_S`: an owner that got
through the lost call records the run failed (a server's owner outlives the capture, and
a run left running there would read live for as long as the server lives); one that did
not answer leaves the run unfinished, ``interrupted`` once the owner is gone. None of it
reads as complete. ``close`` ends this process's use only: the owner's sink stays open
and its owner closes it. With several writers (the ranks of a tensor-parallel run) one
of them starts and finishes the run and commits requests; the others put and flush only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import structlog

from dmi_sglang.adapters.owner._frames import (
    batch_from_frames,
    batch_to_frames,
    pieces_from_frames,
    pieces_to_frames,
)
from dmi_sglang.adapters.owner._service import (
    SocketService,
    check_address,
    exchange,
    request_socket,
)
from dmi_sglang.adapters.owner._shared import MIN_BYTES, SharedRegions, SharedRing
from dmi_sglang.columns import RecordBatch, RecordSink
from dmi_sglang.domain.records import RequestManifest, RunInfo, RunStatus
from dmi_sglang.errors import StoreError

__all__ = ["PUT_PIECE_BYTES", "WRITE_TIMEOUT_S", "RemoteSink", "SinkService"]

log = structlog.get_logger(__name__)

WRITE_TIMEOUT_S = 300.0
"""Longest a remote sink call waits for the owner (a ``put``, all its pieces together,
waits while the owner's queue is full; a ``finish_run`` syncs the run's files)."""
AFTER_LOSS_TIMEOUT_S = 30.0
"""Longest the ``finish_run`` sent after a lost exchange waits (behind the lost call)."""
PUT_PIECE_BYTES = 8 << 20
"""Most payload bytes of one piece of a ``put`` (whole records): one frame each, which
the owner's sink takes as a batch of its own. The owner's libzmq receives each frame
into memory it allocates for it (for tens of MB, fresh pages every time: one page fault
per 4 KiB): with batches of at most 80 MiB (a served window flush's size) the channel
alone moved 1.1 GB/s whole and 3.9 GB/s in pieces on the dev box, the owner's CPU 0.65
and 0.17 s per GB (then one exchange per piece: ``python -m harness store --batch-mb
80``, ``docs/evidence/2026-12-05-cpu-owner-put-pieces/``). A put's pieces go in one
exchange: every call into libzmq lets go of the GIL, and beside a busy Python thread
(SGLang's scheduler) each costs the caller a wait for it back
(``docs/evidence/2026-12-07-cpu-one-exchange-puts/``)."""



def _run_fields(run: RunInfo) -> dict[str, Any]:
    return {**attrs.asdict(run, recurse=False), "status": run.status.value}


def _typed(fields: Any, cls: type, conversions: dict[str, Any]) -> dict[str, Any]:
    """``fields`` checked against ``cls``'s fields: exactly its names, each value of its
    JSON type (``conversions`` turn the structured ones back); anything else is refused,
    so a bad call never reaches (and fails) the shared sink.

    Raises:
        ValueError: a missing or unknown field, or a value of another type.
    """
    if not isinstance(fields, dict):
        msg = (f"{cls.__name__} fields as {type(fields).__name__}; accepted: an object of "
               "its fields")
        raise ValueError(msg)
    names = {f.name: f for f in attrs.fields(cls)}
    if set(fields) - set(names) or {n for n, f in names.items()
                                    if f.default is attrs.NOTHING} - set(fields):
        msg = f"{cls.__name__} fields {sorted(fields)}; accepted: {sorted(names)}"
        raise ValueError(msg)
    out = {}
    for name, value in fields.items():
        if name in conversions:
            out[name] = conversions[name](value)
            continue
        want = names[name].type
        kind = {"str": str, "int": int, "bool": bool}.get(str(want))
        ok = isinstance(value, kind) if kind is not None else False
        if kind is int and isinstance(value, bool):
            ok = False
        if not ok:
            msg = f"{cls.__name__}.{name}={value!r}; accepted: a {want}"
            raise ValueError(msg)
        out[name] = value
    return out


def _pairs(kind: type) -> Any:
    def convert(value: Any) -> tuple[tuple[str, Any], ...]:
        if not isinstance(value, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                and isinstance(p[1], kind) and not isinstance(p[1], bool) for p in value):
            msg = f"{value!r}; accepted: a list of [text, {kind.__name__}] pairs"
            raise ValueError(msg)
        return tuple((p[0], p[1]) for p in value)
    return convert


def _run(fields: Any) -> RunInfo:
    """A run from :func:`_run_fields`' JSON (every field of ``RunInfo``, each checked)."""
    return RunInfo(**_typed(fields, RunInfo, {"settings": _pairs(str), "captures": _pairs(int),
                                              "status": RunStatus}))


def _manifest(fields: Any) -> RequestManifest:
    """A manifest from its fields' JSON (each checked)."""
    return RequestManifest(**_typed(fields, RequestManifest, {}))


class SinkService(SocketService):
    """Takes other processes' ``RecordSink`` calls for ``sink`` at ``address``, on a
    daemon thread, one call at a time (:meth:`close` waits for the call in hand, so the
    owner closes its sink only after it).

    Raises:
        StoreError: the address is refused (``check_address``) or cannot be bound.
    """

    def __init__(self, sink: RecordSink, address: str) -> None:
        self._sink = sink
        self._shared = SharedRegions()
        super().__init__(address, "dmi-store-writes")
        log.info("dmi.writes_taken", address=address)

    def _answer(self, frames: list[Any]) -> list[Any]:
        return [self._outcome(frames)]

    def _outcome(self, frames: list[Any]) -> bytes:
        try:
            header = json.loads(frames[0].bytes)
            method = header["method"]
            if method == "put":  # in order, stopping at a failure
                for batch in self._batches(header, frames[1:]):
                    self._sink.put(batch)
            elif method == "share":
                self._shared.attach(header["path"], header["size"])
            elif method == "unshare":
                self._shared.detach(header["path"])
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

    def _batches(self, header: Any, frames: Sequence[Any]) -> list[RecordBatch]:
        """A put's batches: its pieces (``records`` in the header: the socket's way),
        or one batch in a shared ring's region (``region``) or as frames (a batch that
        did not fit the ring)."""
        if "records" in header:
            return pieces_from_frames(header, frames)
        if "region" in header:
            frames = self._shared.pieces(header["ring"], header["region"])
        return [batch_from_frames(header, frames)]


class RemoteSink:
    """A :class:`~dmi_sglang.columns.RecordSink` that writes through the store owner's
    :class:`SinkService` at ``address`` (one exchange per call, on one socket; calls of
    several threads take turns; see the module for where it differs from a local sink).

    With ``shared_bytes``, batches cross through a :class:`~._shared.SharedRing` of that
    size made at the first put (copied into it once, read in place by the owner). Where
    the ring cannot be made (no ``/dev/shm``, or too little room there) or the owner
    refuses it, and for a batch larger than the whole ring, they go as frames."""

    def __init__(self, address: str, *, timeout_s: float = WRITE_TIMEOUT_S,
                 shared_bytes: int = 0) -> None:
        if shared_bytes and shared_bytes < MIN_BYTES:
            msg = f"a shared ring of {shared_bytes} bytes; accepted: 0 or at least {MIN_BYTES}"
            raise ValueError(msg)
        self.address = check_address(address)
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._lock = threading.RLock()
        """One exchange at a time (a ``put``'s pieces are one exchange, so another
        thread's call never lands between them)."""
        self._socket: Any = None
        self._failure: StoreError | None = None
        self._lost = False
        """An exchange got no answer (the socket is unusable, the owner gone or hung)."""
        self._closed = False
        self._shared_bytes = shared_bytes
        """The ring's size (0: none)."""
        self._ring: SharedRing | None = None
        self._ring_tried = False
        """The ring was made and shared, or refused (then puts go as frames)."""

    @property
    def failure(self) -> StoreError | None:
        """The sticky failure of an earlier call (None while every call succeeded)."""
        return self._failure

    @property
    def shared(self) -> bool:
        """Whether puts cross through a shared ring now."""
        return self._ring is not None

    @property
    def ring_waits(self) -> int:
        """Puts that waited for the owner to release ring space (0 without a ring)."""
        ring = self._ring
        return ring.waits if ring is not None else 0

    def start_run(self, run: RunInfo) -> None:
        """The owner's sink records the run's start."""
        self._call({"method": "start_run", "run": _run_fields(run)})

    def put(self, batch: RecordBatch) -> None:
        """Hand the batch to the owner's sink; returns once it took it (blocks while the
        owner's queue, or the shared ring, is full). The batch's memory is free again on
        return.

        Through the socket it goes in one exchange, as pieces of at most
        :data:`PUT_PIECE_BYTES` of whole records (one frame each), which the owner's sink
        takes one by one, in order; a failure stops it at the piece that failed (the
        pieces before were taken, and the run is failed from there on: the sticky
        failure). Through a shared ring it goes
        whole, as one region (the ring's regions are held until their insert, so pieces
        would fill a ring smaller than an insert and wait for the insert's linger), and as
        whole frames where it does not fit the ring."""
        with self._lock:  # one call to the other threads, whatever its pieces
            if self._shared_bytes and not (self._ring_tried and self._ring is None):
                header, frames = batch_to_frames(batch)
                self._call({"method": "put", **header}, frames, shared=True)
                return
            header, frames = pieces_to_frames(batch, PUT_PIECE_BYTES)
            self._call({"method": "put", **header}, frames)

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        """The owner's sink commits these manifests after what was put before."""
        self._call({"method": "commit_requests",
                    "manifests": [attrs.asdict(m) for m in manifests]})

    def flush(self) -> None:
        """Block until the owner's sink stored everything queued."""
        self._call({"method": "flush"})

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """The owner's sink flushes, syncs, and writes the manifests and the run's end.

        Sent also after the owner's sink reported a failure, with the run's status
        failed (the owner records it so, as a local sink does), and after a lost exchange
        (on a new socket, waiting at most :data:`AFTER_LOSS_TIMEOUT_S`)."""
        failure = self._failure
        if failure is not None and run.status is RunStatus.COMMITTED:
            run = attrs.evolve(run, status=RunStatus.FAILED, error=run.error or str(failure))
        self._call({"method": "finish_run", "run": _run_fields(run),
                    "manifests": [attrs.asdict(m) for m in manifests]}, past_failure=True)

    def close(self) -> None:
        """End this process's use of the owner (its sink stays open for the others); a
        shared ring is given up (the owner forgets it once its batches are stored).

        Raises:
            StoreError: the sticky failure, if a call failed.
        """
        with self._lock:
            self._closed = True
            ring, self._ring = self._ring, None
            if ring is not None:  # after a lost call too: the owner may still map the ring
                try:
                    self._exchange({"method": "unshare", "path": ring.path}, (),
                                   min(self._timeout_ms, int(AFTER_LOSS_TIMEOUT_S * 1000)))
                except StoreError as exc:  # the owner is gone or hung: nothing to tell
                    log.warning("dmi.shared_ring_unshare_failed", error=str(exc))
                ring.close()
            if self._socket is not None:
                self._socket.close()
                self._socket = None
        if self._failure is not None:
            raise self._failure

    def _exchange(self, header: dict[str, Any], frames: Sequence[Any],
                  timeout_ms: int) -> list[Any]:
        """One exchange on this sink's socket (made on first use, and made anew after a
        lost exchange: the old one still waits for the lost answer, and the owner answers
        the new one after the lost call, one call at a time), under the lock: the answer's
        JSON.

        Raises:
            StoreError: no answer (the socket is unusable after it: ``_lost``).
        """
        if self._lost and self._socket is not None:
            self._socket.close()
            self._socket = None
        try:
            if self._socket is None:
                self._socket = request_socket(self.address, timeout_ms, "writes")
            answer: list[Any] = json.loads(exchange(
                self._socket, [json.dumps(header).encode(), *frames], address=self.address,
                timeout_ms=timeout_ms, channel="writes",
                method=header["method"])[0].bytes)
        except StoreError:
            self._lost = True  # a lost exchange leaves the REQ socket unusable
            raise
        return answer

    def _shared_ring(self, timeout_ms: int) -> SharedRing | None:
        """The ring (made and shared with the owner on first use, under the lock), or
        None where it is refused (then never tried again).

        Raises:
            StoreError: the share exchange got no answer.
        """
        if self._ring_tried:
            return self._ring
        self._ring_tried = True
        size = self._shared_bytes
        try:
            ring = SharedRing(size)
        except StoreError as exc:
            log.warning("dmi.shared_ring_refused", reason=str(exc), size=size)
            return None
        try:
            answer = self._exchange({"method": "share", "path": ring.path, "size": size}, (),
                                    timeout_ms)
        except StoreError:
            ring.close()
            raise
        ring.unlink()  # mapped on both sides (or refused): the file is not needed
        if answer[0] != "ok":
            ring.close()
            log.warning("dmi.shared_ring_refused", reason=str(answer[1:]), size=size)
            return None
        self._ring = ring
        log.info("dmi.shared_ring", size=size)
        return ring

    def _through_ring(self, header: dict[str, Any], frames: Sequence[Any],
                      timeout_ms: int) -> tuple[dict[str, Any], Sequence[Any]]:
        """A put's header and frames with its frames copied into the shared ring (the
        header names the region, no frames are left); unchanged without a ring, or for a
        batch larger than the whole ring.

        Raises:
            StoreError: the ring stayed full for ``timeout_ms``, or sharing it got no
                answer.
        """
        ring = self._shared_ring(timeout_ms)
        if ring is None:
            return header, frames
        try:
            region = ring.place(frames, timeout_ms / 1000)
        except ValueError:
            return header, frames
        return {**header, "ring": ring.path, "region": list(region)}, ()

    def _call(self, header: dict[str, Any], frames: Sequence[Any] = (), *,
              past_failure: bool = False, shared: bool = False) -> None:
        """One exchange; a ``shared`` put's frames go through the ring where there is
        one. After a failure every call raises it at once, except one made
        ``past_failure``, which is still sent (after a lost exchange on a new socket,
        waiting at most :data:`AFTER_LOSS_TIMEOUT_S`) and raises the first failure after
        its exchange."""
        with self._lock:
            earlier = self._failure
            if earlier is not None and not past_failure:
                raise earlier
            if self._closed:
                msg = f"the remote sink of {self.address} is closed"
                raise StoreError(msg)
            timeout_ms = self._timeout_ms
            if self._lost:  # a new socket (_exchange), served after the lost call
                timeout_ms = int(AFTER_LOSS_TIMEOUT_S * 1000)
            try:
                if shared:
                    header, frames = self._through_ring(header, frames, timeout_ms)
                answer = self._exchange(header, frames, timeout_ms)
            except StoreError as exc:
                self._failure = earlier or exc
                if earlier is not None:
                    raise earlier from exc
                raise
            if answer[0] == "ok":
                if earlier is None:
                    return
                raise earlier
            if answer[0] == "store":
                failure = StoreError(answer[1])
            else:
                msg = f"the store's owner failed {header['method']}: {answer[0]}: {answer[1]}"
                failure = StoreError(msg)
            self._failure = earlier or failure
            raise self._failure
