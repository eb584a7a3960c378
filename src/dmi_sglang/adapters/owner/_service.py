"""What the store owner's channels share: a private IPC address, and a daemon thread that
answers one request at a time on a ZeroMQ REP socket bound there."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from typing import Any

import structlog

from dmi_sglang.errors import StoreError
from dmi_sglang.threads import OsNamedThread

__all__ = ["SocketService", "check_address", "exchange", "request_socket"]

log = structlog.get_logger(__name__)

CLOSE_WAIT_S = 30.0
"""Longest :meth:`SocketService.close` waits for the request in hand."""
_SEND_TIMEOUT_MS = 1000
LATE_ANSWER_GRACE_S = 0.02
"""How long after its last answer a closing service keeps its socket: closed at once, it
can lose that answer on its way (a caller with ``IMMEDIATE`` drops what a peer that
vanished meanwhile sent), and the caller waits out its timeout. A closing service first
waits (up to :data:`CLOSE_WAIT_S`) until zmq wrote its last answer out, then for the rest
of this time after it."""
_FLUSH_AT_CLOSE_MS = 1000
"""How long zmq may go on sending what a closing service's socket still holds. zmq
releases a small frame (the last of an answer) once it is copied into its send batch,
before that batch reaches the kernel, so the last answer's tracker can be done while its
tail still waits there: closed with no linger, the answer could lose its tail under load,
and its caller wait out its timeout."""
_WORDS = {"reads": ("answers reads", "answer", "reading"),
          "writes": ("takes writes", "take", "writing")}
"""Per channel, how its errors say it: no owner ``...`` at; did not ``...`` a call;
``...`` through the owner failed."""


def check_address(address: str) -> str:
    """``address`` itself when it is an ``ipc://`` path whose directory belongs to this
    user and admits no one else.

    Raises:
        StoreError: any other address (named, with what is accepted).
    """
    path = address.removeprefix("ipc://")
    directory = os.path.dirname(path)
    if not address.startswith("ipc://") or not os.path.isabs(path):
        msg = (f"the store owner's channels are served only at ipc:///absolute/path "
               f"addresses, got {address!r}")
        raise StoreError(msg)
    try:
        st = os.lstat(directory)
    except OSError as exc:
        msg = f"the directory of the store channel address {address!r} is missing: {exc}"
        raise StoreError(msg) from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        msg = (f"the directory of the store channel address {address!r} must belong to "
               f"this user and admit no one else (mode {oct(st.st_mode & 0o777)})")
        raise StoreError(msg)
    return address


class SocketService:
    """Answers requests at ``address`` on a daemon thread named ``name``, one at a time:
    :meth:`_answer` turns a request's frames into the answer's frames. A failed exchange
    costs that exchange only (the socket is bound afresh: a REP socket left between a
    request and its answer takes no other). :meth:`close` wakes the thread at once (a
    pipe the thread polls beside the socket), waits for the request in hand (an answer sent
    just before gets :data:`LATE_ANSWER_GRACE_S` to reach its caller) and removes the
    socket's file.

    Raises:
        StoreError: the address is refused (:func:`check_address`), or held by another
            service (its socket file exists), or cannot be bound.
    """

    def __init__(self, address: str, name: str) -> None:
        import zmq

        check_address(address)
        if os.path.lexists(address.removeprefix("ipc://")):  # a bind would take it over
            msg = f"cannot serve {name} at {address}: another owner holds it"
            raise StoreError(msg)
        self.address = address
        self._wake_read, self._wake_write = os.pipe()
        """Written to and closed by :meth:`close`: the thread's poll of the read end returns
        at once (the byte wakes it even where a forked child holds a copy of the pipe)."""
        try:
            self._socket: Any = self._bound(zmq)
        except BaseException as exc:
            os.close(self._wake_read)
            os.close(self._wake_write)
            if isinstance(exc, zmq.ZMQError):
                msg = f"cannot serve {name} at {address}: {exc}"
                raise StoreError(msg) from exc
            raise
        self._inode = os.lstat(address.removeprefix("ipc://")).st_ino
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._no_grace = False
        self.answered = 0
        """Requests answered so far."""
        self._thread = OsNamedThread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def close(self, *, wait_forever: bool = False, answered: bool = False) -> bool:
        """Stop answering: returns once the request in hand (if any) is answered, or
        after :data:`CLOSE_WAIT_S` unless ``wait_forever`` (a timeout is logged and the
        thread ends when that request does); the socket's file is removed, so the address
        can be served again. ``answered``: every caller has its answers (the only one
        ended the service after its last call returned), so the last answer needs no
        grace (:data:`LATE_ANSWER_GRACE_S`) before the socket closes. Closing twice, or
        from the service's own thread, does no harm. True when the service's thread
        ended (what a request in hand held, a store client say, is let go); False while
        it still runs, or when called from that thread."""
        with self._close_lock:  # one caller closes the pipe's write end, once
            if self._closed.is_set():
                return self._ended()
            self._no_grace = answered
            self._closed.set()
            with contextlib.suppress(OSError):  # a thread that ended closed the read end
                os.write(self._wake_write, b"\0")
            os.close(self._wake_write)
        wait_s = None if wait_forever else CLOSE_WAIT_S
        if threading.current_thread() is not self._thread:
            self._thread.join(wait_s)
            if self._thread.is_alive():
                log.warning("dmi.store_service_busy_at_close", service=self._thread.name,
                            waited_s=wait_s)
        path = self.address.removeprefix("ipc://")
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(path).st_ino == self._inode:  # ours, not a later service's
                os.unlink(path)
        return self._ended()

    def _ended(self) -> bool:
        return threading.current_thread() is not self._thread and not self._thread.is_alive()

    def _answer(self, frames: list[Any]) -> list[Any]:
        raise NotImplementedError

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        answered_at = float("-inf")
        last: Any = None  # the last answer's tracker: done once zmq has written it out
        try:
            while not self._closed.is_set():
                try:
                    ready = dict(poller.poll())
                    if self._socket not in ready:
                        continue  # woken by close
                    frames = self._socket.recv_multipart(copy=False)
                    last = self._socket.send_multipart(self._answer(frames), copy=False,
                                                       track=True)
                    self.answered += 1
                    answered_at = time.monotonic()
                except Exception as exc:  # one exchange lost; the channel goes on
                    log.error("dmi.store_exchange_failed", service=self._thread.name,
                              error=repr(exc))
                    poller.unregister(self._socket)
                    self._socket.close()
                    self._socket = self._bound(zmq)
                    poller.register(self._socket, zmq.POLLIN)
        finally:
            if last is not None:  # a large answer (an export's) takes longer than the
                with contextlib.suppress(Exception):  # grace to write out: wait for it
                    last.wait(CLOSE_WAIT_S)
            left = answered_at + LATE_ANSWER_GRACE_S - time.monotonic()
            if left > 0 and not self._no_grace:  # let the last answer reach its caller
                time.sleep(left)
            self._socket.close(linger=_FLUSH_AT_CLOSE_MS)
            os.close(self._wake_read)

    def _bound(self, zmq: Any) -> Any:
        """A REP socket bound at the service's address (closed again if the bind fails)."""
        socket = zmq.Context.instance().socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        socket.copy_threshold = 0  # every answer frame tracked, a small last one too
        try:
            socket.bind(self.address)
        except zmq.ZMQError:
            socket.close()
            raise
        return socket


def request_socket(address: str, timeout_ms: int, channel: str) -> Any:
    """A REQ socket connected to the owner's ``channel`` (``reads`` or ``writes``) at
    ``address``: a send with no owner listening fails at once, an answer is awaited at
    most ``timeout_ms``.

    Raises:
        StoreError: the socket cannot be made or connected.
    """
    import zmq

    socket: Any = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
    socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
    try:
        socket.connect(address)
    except zmq.ZMQError as exc:
        socket.close()
        raise _failed(address, channel, exc) from exc
    return socket


def exchange(socket: Any, frames: list[Any], *, address: str, timeout_ms: int,
             channel: str, method: str) -> list[Any]:
    """Send a request's ``frames`` on a :func:`request_socket` and return its answer's
    frames (received without a copy).

    Raises:
        StoreError: no owner listens at ``address``, none answered ``method`` within
            ``timeout_ms``, or the socket failed (the socket is unusable after any).
    """
    import zmq

    listens, answers, _ = _WORDS[channel]
    try:
        socket.setsockopt(zmq.RCVTIMEO, timeout_ms)  # this exchange's bound, not the first's
        try:
            socket.send_multipart(frames, copy=False)
        except zmq.Again as exc:
            msg = f"no store owner {listens} at {address}"
            raise StoreError(msg) from exc
        try:
            return socket.recv_multipart(copy=False)  # type: ignore[no-any-return]
        except zmq.Again as exc:
            msg = (f"the store's owner did not {answers} {method} within "
                   f"{timeout_ms / 1000:g} s ({address})")
            raise StoreError(msg) from exc
    except zmq.ZMQError as exc:
        raise _failed(address, channel, exc) from exc


def _failed(address: str, channel: str, exc: Exception) -> StoreError:
    return StoreError(f"{_WORDS[channel][2]} through the store's owner at {address!r} "
                      f"failed: {exc}")
