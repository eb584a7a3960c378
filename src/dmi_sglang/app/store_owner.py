"""The store owner process: the embedded store of a capturing run is held by a process of
its own, not by SGLang's scheduler (docs/architecture.md, "Store owner").

The scheduler starts it when its capture opens (:func:`open_owned_sink`) and writes through
it (:class:`~dmi_sglang.adapters.owner.RemoteSink`): the store's insert threads, the
embedded engine's CPU and a server's reads (``GET /dmi/...``: the owner answers them at
the server's read address) stay off the scheduler's interpreter and its GIL.

Lifetime: the owner ends when its parent closes the owner's stdin and sends it
:data:`RELEASE_SIGNAL` (a process the parent forked may hold a copy of the pipe), or when
the parent is gone (checked every second): it finishes the write in hand, stops taking
calls, closes its sink (what it took is inserted; the run's files were synced by
``finish_run``, if the run got that far) and exits. Without a read channel the parent
ends it when the run's sink closes (:meth:`OwnedSink.close`), so the run is durable and
the store free when the scheduler's stop returns, as before. With a read channel (a
server) it keeps answering reads until the scheduler process ends, or until SGLang's
shutdown kills the server's process tree (after the run's stop when the server shuts
down in order; a crash's tree kill can cut the owner short of what it took; its write
channel lives in the server's read-channel directory, which the server removes). It
ignores SIGINT and SIGTERM: Ctrl-C reaches every process of the terminal's group, and
the run is stopped durably through the scheduler, which then ends the owner.

Run as ``python -m dmi_sglang.app.store_owner_main --writes ADDRESS [--reads ADDRESS]
--parent PID --ready-fd N`` (:func:`run_owner` with the composition root's channels), the
run's resolved ``DMX_*`` settings in its environment (never on its command line: a store
password must not show in a process listing). On the pipe ``N`` it tells its parent that
it is ready (or why it is not), and at its end that it closed the store, with the exit
status it will have: the parent's stop goes on from there, while the owner's own exit
(its memory unmapped: tens of milliseconds) completes on its own.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import structlog

from dmi_sglang.columns import RecordBatch, RecordSink
from dmi_sglang.domain.records import RequestManifest, RunInfo
from dmi_sglang.domain.settings import PREFIX as SETTINGS_PREFIX
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.store_config import channel_directory
from dmi_sglang.errors import StoreError
from dmi_sglang.host_malloc import tune_host_malloc
from dmi_sglang.threads import OsNamedThread

__all__ = ["OWNER_EXIT_S", "OWNER_MODULE", "OWNER_READY_S", "RELEASE_SIGNAL", "OpenServices",
           "OwnedSink", "Service", "close_owned", "open_owned_sink", "run_owner"]

log = structlog.get_logger(__name__)

OWNER_READY_S = 120.0
"""Longest the parent waits for a new owner to open the store and bind its channels."""
OWNER_EXIT_S = 600.0
"""Longest :meth:`OwnedSink.end` waits for the owner to close the store and exit."""
OWNER_MODULE = "dmi_sglang.app.store_owner_main"
"""The module the owner process runs (``python -m``)."""
_READY = "ready"
_FAILED = "error: "
_CLOSED = "closed "
"""The owner's last line on its status pipe, before its exit status: its store is closed."""
_CHANNELS_PREFIX = "dmi-owner-"
_PARENT_POLL_S = 1.0
_POLL_MS_MAX = 2**31 - 1
"""The longest timeout ``poll`` takes (ms)."""
_SOLE_WRITER = "--sole-writer"
RELEASE_SIGNAL = signal.SIGUSR1
"""What the parent sends, besides closing stdin, to end an owner it no longer needs."""
_START_FAILED_EXIT_S = 10.0


class OwnedSink:
    """The :class:`~dmi_sglang.columns.RecordSink` of a run whose embedded store a store
    owner process holds: every call goes through the owner's write channel; :meth:`close`
    ends the owner too (unless it answers a server's reads: then it ends with this
    process)."""

    def __init__(self, remote: RecordSink, process: subprocess.Popen[bytes],
                 directory: str | None, *, serves_reads: bool, status_fd: int | None = None,
                 ) -> None:
        self._remote = remote
        self._process = process
        self._directory = directory
        self._status_fd = status_fd
        """The owner's status pipe: it says there when it closed the store."""
        self._ended: bool | StoreError | None = None
        """How :meth:`end` ended the owner (a later call says the same, touching nothing)."""
        self._serves_reads = serves_reads
        self.pid = process.pid
        """The owner process's pid."""
        self._ending = False

    @property
    def shared(self) -> bool:
        """Whether batches reach the owner through shared memory (``DMX_OWNER_RING_MB``,
        once the first was put) rather than its socket."""
        return getattr(self._remote, "shared", False) is True

    @property
    def failure(self) -> StoreError | None:
        """Cheap, for an engine that idles (no call to the owner): an earlier call's
        sticky failure, or the owner process ended before this sink ended it (what it had
        not inserted is lost with it); None while neither."""
        failed = getattr(self._remote, "failure", None)
        if isinstance(failed, StoreError):
            return failed
        code = None if self._ending else self._process.poll()
        if code is None:
            return None
        msg = (f"the store owner (pid {self.pid}) ended with exit status {code} while the "
               f"run was open; what it had not inserted is lost")
        return StoreError(msg)

    def start_run(self, run: RunInfo) -> None:
        """The owner's sink records the run's start."""
        self._remote.start_run(run)

    def put(self, batch: RecordBatch) -> None:
        """Hand the batch to the owner (returns once the owner's sink took it)."""
        self._remote.put(batch)

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        """The owner's sink commits these manifests after what was put before."""
        self._remote.commit_requests(manifests)

    def flush(self) -> None:
        """Block until the owner's sink stored everything queued."""
        self._remote.flush()

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """The owner's sink flushes, writes the manifests and the run's end, and syncs."""
        self._remote.finish_run(run, manifests)

    def close(self) -> None:
        """End this process's writes; without a read channel, end the owner and wait
        until it closed the store.

        Raises:
            StoreError: the first of: a call through the owner failed (the sticky
                failure), the owner failed to close its sink, it did not exit in time
                (a later one is logged).
        """
        self._ending = True
        first: BaseException | None = None
        try:
            self._remote.close()
        except BaseException as exc:  # raised below, after the owner is ended
            first = exc
        if not self._serves_reads:
            try:
                self.end()
            except StoreError as exc:
                if first is None:
                    raise
                log.error("dmi.store_owner_end_failed", pid=self.pid, error=str(exc))
        if first is not None:
            raise first

    def end(self) -> None:
        """End the owner now (its reads too) and wait for it; idempotent.

        Raises:
            StoreError: the owner failed to close its sink, or did not exit in time.
        """
        self._ending = True
        if self._ended is None:
            status_fd, self._status_fd = self._status_fd, None
            try:
                _end_owner(self._process, self._directory, status_fd)
            except StoreError as exc:
                self._ended = exc
                raise
            self._ended = True
        elif isinstance(self._ended, StoreError):
            raise self._ended


def _end_owner(process: subprocess.Popen[bytes], directory: str | None,
               status_fd: int | None = None) -> None:
    """Release the owner and wait until it closed the store (it says so on
    ``status_fd``, and exits on its own time) or exited (killed after
    :data:`OWNER_EXIT_S`); remove its channels' directory.

    Raises:
        StoreError: the owner failed to close its sink, or did not exit in time.
    """
    code = _stop(process, directory, OWNER_EXIT_S, release=True, status_fd=status_fd)
    if code is None:
        msg = (f"the store owner (pid {process.pid}) did not close the store within "
               f"{OWNER_EXIT_S:g} s and was killed; what it had not inserted is lost")
        raise StoreError(msg)
    if code != 0:
        msg = (f"the store owner (pid {process.pid}) failed to close the store (exit "
               f"status {code}; its log line dmi.store_owner_close_failed says why)")
        raise StoreError(msg)


def _stop(process: subprocess.Popen[bytes], directory: str | None, wait_s: float, *,
          release: bool, status_fd: int | None = None) -> int | None:
    """Close the owner's stdin (and with ``release`` send :data:`RELEASE_SIGNAL`: a
    process this one forked may hold a copy of that pipe), wait up to ``wait_s`` for it
    to say on ``status_fd`` (closed here) that it closed the store, or for its exit, else
    kill it; remove its channels' directory. Its exit status (the one it said), or None
    when it had to be killed. An owner that said it is reaped by a thread of its own:
    the rest of its exit (its memory unmapped) holds nothing up."""
    if process.stdin is not None and not process.stdin.closed:
        process.stdin.close()
    if release and process.poll() is None:
        process.send_signal(RELEASE_SIGNAL)
    try:
        began = time.monotonic()
        if status_fd is not None:
            try:
                said = _until_closed(status_fd, process, wait_s)
            finally:
                os.close(status_fd)
            if said is not None:
                log.debug("dmi.store_owner_closed", pid=process.pid, status=said,
                          waited_s=round(time.monotonic() - began, 4))
                OsNamedThread(target=_reap, args=(process,), name="dmi-owner-reaper",
                              daemon=True).start()
                return said
        woken = _until_exit(process, max(0.0, began + wait_s - time.monotonic()))
        code = process.wait(max(0.0, began + wait_s - time.monotonic()))
        log.debug("dmi.store_owner_exited", pid=process.pid, status=code,
                  waited_s=round(time.monotonic() - began, 4), pidfd=woken)
        return code
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None
    finally:
        if directory is not None:
            _remove_directory(directory)


def _without_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without its ``DMX_*`` variables: the owner reads the settings it is
    handed (:meth:`Settings.to_env`), never one of the parent's that a keyword overrode
    (``to_env`` leaves unset values out, so such a variable would come back)."""
    return {k: v for k, v in environ.items() if not k.startswith(SETTINGS_PREFIX)}


def open_owned_sink(settings: Settings, read_address: str,
                    remote: Callable[[str], RecordSink], *,
                    sole_writer: bool = False) -> OwnedSink:
    """Start a store owner for ``settings``' embedded store and return the sink that writes
    through it (``remote(address)``: the proxy of its write channel); with
    ``read_address`` the owner also answers a server's reads there, and its write channel
    shares that address's directory (which the server removes at its end, also when
    SGLang's shutdown kills the owner). ``sole_writer``: the returned sink is the only
    writer through that channel (one rank), so the owner closes it without a grace for
    answers on their way (:func:`close_owned`); ranks sharing an owner must not say so.

    Raises:
        StoreError: the owner could not open the store or bind its channels (its own
            message), or did not get ready within :data:`OWNER_READY_S`.
    """
    directory = _channels_directory(read_address)
    channels = directory or os.path.dirname(read_address.removeprefix("ipc://"))
    writes = f"ipc://{os.path.join(channels, 'writes')}"
    argv = [sys.executable, "-m", OWNER_MODULE, "--writes", writes,
            "--parent", str(os.getpid())]
    if read_address:
        argv += ["--reads", read_address]
    if sole_writer:
        argv.append(_SOLE_WRITER)
    ready_r, ready_w = os.pipe()
    try:
        process = subprocess.Popen(
            [*argv, "--ready-fd", str(ready_w)], stdin=subprocess.PIPE, pass_fds=(ready_w,),
            env={**_without_settings(os.environ), **settings.to_env()})
    except BaseException:
        os.close(ready_r)
        os.close(ready_w)
        if directory is not None:
            _remove_directory(directory)
        raise
    os.close(ready_w)
    try:
        answer = _read_ready(ready_r, OWNER_READY_S)
        if answer == _READY:
            sink = OwnedSink(remote(writes), process, directory,
                             serves_reads=bool(read_address), status_fd=ready_r)
            log.info("dmi.store_owner_started", pid=process.pid, writes=writes,
                     reads=read_address or None)
            return sink
    except BaseException:  # it took nothing: no reason to wait long
        os.close(ready_r)
        _stop(process, directory, _START_FAILED_EXIT_S, release=False)
        raise
    os.close(ready_r)
    _stop(process, directory, _START_FAILED_EXIT_S, release=False)
    why = answer.removeprefix(_FAILED) or (
        f"it exited with status {process.returncode} before it was ready")
    msg = f"the store owner could not open the store: {why}"
    raise StoreError(msg)


def _channels_directory(read_address: str) -> str | None:
    """A new directory for the owner's write channel; None when it goes beside the
    server's read channel."""
    return None if read_address else channel_directory(_CHANNELS_PREFIX)


def _read_ready(fd: int, timeout_s: float) -> str:
    """The owner's first line on its status pipe (without its end), or why none came."""
    line = _read_line(fd, timeout_s)
    return f"{_FAILED}not ready within {timeout_s:g} s" if line is None else line


def _until_closed(fd: int, process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The exit status the owner says on its status pipe once it closed the store; None
    when it exited without saying so (seen at its exit through a pidfd, where there is
    one: another process may hold a copy of the pipe's write end), or did not say it
    within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pidfd = _pidfd(process)
    if pidfd is None and process.returncode is not None and not _readable_now(fd):
        return None  # it exited (reaped already) without a word, or a copy holds the pipe
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready = {f for f, _ in poller.poll(min(int(left * 1000) + 1, _POLL_MS_MAX))}
            if fd in ready:  # its line, or the pipe's end
                break
            if ready:  # it exited: what it said before is in the pipe
                if not _readable_now(fd):
                    return None
                break
    finally:
        if pidfd is not None:
            os.close(pidfd)
    line = _read_line(fd, max(0.0, deadline - time.monotonic()))
    if line is None or not line.startswith(_CLOSED):
        return None
    try:
        return int(line.removeprefix(_CLOSED))
    except ValueError:
        return None


def _readable_now(fd: int) -> bool:
    """Whether a read of ``fd`` returns at once (data, or the pipe's end)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _reap(process: subprocess.Popen[bytes]) -> None:
    """Wait for the exit of an owner that said it closed the store; one that does not
    exit within :data:`OWNER_EXIT_S` is killed (and logged)."""
    try:
        process.wait(OWNER_EXIT_S)
    except subprocess.TimeoutExpired:
        log.error("dmi.store_owner_exit_hung", pid=process.pid, waited_s=OWNER_EXIT_S,
                  why="it said it closed the store, then did not exit: killed")
        process.kill()
        process.wait()


def _read_line(fd: int, timeout_s: float) -> str | None:
    """One line from the pipe ``fd`` (without its end; what came before its end, when it
    ended without one); None when none came within ``timeout_s`` (what is in the pipe
    already is read, however late). Reads one byte at a time: what follows the line
    stays in the pipe for the next read."""
    deadline = time.monotonic() + timeout_s
    got = bytearray()
    poller = select.poll()  # not select(): a busy process's descriptors pass 1024
    poller.register(fd, select.POLLIN)
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        if not poller.poll(min(int(left * 1000) + 1, _POLL_MS_MAX) if left > 0 else 0):
            if left <= 0:
                return None
            continue
        byte = os.read(fd, 1)
        if not byte:
            break
        got += byte
    return got.rstrip(b"\n").decode(errors="replace")


def _remove_directory(directory: str) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


# -- the owner process -----------------------------------------------------------------
class Service(Protocol):
    """One of the owner's channels: it stops answering at :meth:`close`."""

    def close(self, *, wait_forever: bool = False, answered: bool = False) -> bool:
        """Stop answering: the call in hand is answered first (waiting a bounded time,
        or however long it takes with ``wait_forever``); ``answered``: every caller has
        its answers already, so none needs time to reach its caller. True when nothing
        of the channel runs any more (a call still in hand may hold the store open)."""


OpenServices = Callable[[Settings, str, str], tuple[RecordSink, Sequence[Service]]]
"""``(settings, write address, read address or "") -> (the store's sink, its channels)``,
the write channel first (the composition root names the adapters)."""


def run_owner(argv: Sequence[str], open_services: OpenServices) -> int:
    """The owner process: open the store and its channels, tell the parent, serve until
    stdin ends or the parent is gone, then close the channels and the sink; 0 when the
    sink closed cleanly."""
    parser = argparse.ArgumentParser(prog=f"python -m {OWNER_MODULE}")
    parser.add_argument("--writes", required=True)
    parser.add_argument("--reads", default="")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument(_SOLE_WRITER, action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it (module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    released = threading.Event()
    signal.signal(RELEASE_SIGNAL, lambda *_: released.set())
    os.set_inheritable(args.ready_fd, False)  # no child of this process may hold it open
    tuned = tune_host_malloc()  # received pieces are freed once inserted: reuse their pages
    try:
        sink, services = open_services(Settings.from_env(), args.writes, args.reads)
    except Exception as exc:  # told to the parent, which raises it
        _tell(args.ready_fd, _FAILED + " ".join(str(exc).split()))
        return 1
    _tell(args.ready_fd, _READY, last=False)
    _serve_until_released(args.parent, released)
    began = time.perf_counter()
    code, free = close_owned(sink, services, sole_writer=args.sole_writer)
    channels = os.path.dirname(args.writes.removeprefix("ipc://"))
    if os.path.basename(channels).startswith(_CHANNELS_PREFIX):  # a parent that died left it
        _remove_directory(channels)
    log.info("dmi.store_owner_ended", pid=os.getpid(), status=code, store_free=free,
             closing_s=round(time.perf_counter() - began, 4),
             malloc_tuned=tuned)  # before the parent goes on
    if free:  # the store is free: the parent goes on (else it waits for this exit)
        _tell(args.ready_fd, f"{_CLOSED}{code}")
    return code


def close_owned(sink: RecordSink, services: Sequence[Service], *,
                sole_writer: bool) -> tuple[int, bool]:
    """What a released owner closes, in order: its write channel (the call in hand is
    finished first), its sink, its other channels. The status is 0 when the sink closed
    cleanly, else 1 (logged); the flag says the store is free (the sink closed cleanly
    and no channel still runs a call that may hold it open), so the owner may say so
    before its exit. With ``sole_writer`` the write channel's one caller released this
    process after its last call returned (or is gone), so no answer of it is on its way
    and that socket closes without the grace one gets; the read channels keep theirs (a
    server's readers are others)."""
    free = services[0].close(wait_forever=True, answered=sole_writer)
    code = 0
    try:
        sink.close()
    except Exception as exc:  # the parent sees the exit status
        log.error("dmi.store_owner_close_failed", error=repr(exc))
        code = 1
    for service in services[1:]:
        free = service.close() and free
    return code, free and code == 0


def _until_exit(process: subprocess.Popen[bytes], wait_s: float) -> bool:
    """Wait until the child ``process`` exited, or ``wait_s`` passed: woken by the exit
    itself through a pidfd (Linux), where ``Popen.wait`` with a timeout checks at growing
    intervals of up to 50 ms, late by that much. True when it waited on a pidfd; False
    (at once) where there is none, or the child was reaped already (then its pid may
    name another process): the caller's ``Popen.wait`` waits alone."""
    fd = _pidfd(process)
    if fd is None:
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # readable once the process has exited
        poller.poll(min(max(0, int(wait_s * 1000)), _POLL_MS_MAX))
        return True
    finally:
        os.close(fd)


def _pidfd(process: subprocess.Popen[bytes]) -> int | None:
    """A pidfd of the child ``process`` (Linux); None where there is none, or the child
    was reaped already (then its pid may name another process)."""
    if process.returncode is not None:
        return None
    try:
        fd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # no pidfd here, or the pid is gone
        return None
    if process.poll() is not None:  # reaped meanwhile: the pidfd may be another's
        os.close(fd)
        return None
    return fd


def _serve_until_released(parent: int, released: threading.Event) -> None:
    """Return when stdin ends (the parent closed it, or died and every copy of it closed),
    the parent sent :data:`RELEASE_SIGNAL`, or the parent is gone (a process it forked
    that kept a copy of the pipe is no reason to hold the store)."""
    poller = select.poll()
    poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
    while os.getppid() == parent and not released.is_set():
        if poller.poll(_PARENT_POLL_S * 1000) and not os.read(sys.stdin.fileno(), 65536):
            return


def _tell(fd: int, line: str, *, last: bool = True) -> None:
    """Write ``line`` to the parent's status pipe, and close it after the ``last`` one (a
    parent that gave up closed its end: nothing to tell)."""
    try:
        os.write(fd, (line + "\n").encode())
    except BrokenPipeError:
        pass
    finally:
        if last:
            os.close(fd)
