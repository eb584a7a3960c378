"""The store owner process: the embedded store of a capturing run is held by a process of
its own, not by SGLang's scheduler (docs/architecture.md, "Store owner").

The scheduler starts it when its capture opens (:func:`open_owned_sink`) and writes through
it (:class:`~dmi_sglang.adapters.owner.RemoteSink`): the store's insert threads, the
embedded engine's CPU and a server's reads (``GET /dmi/...``: the owner answers them at
the server's read address) stay off the scheduler's interpreter and its GIL.

Lifetime: the owner ends when its parent closes the owner's stdin, which also happens when
the parent dies (its descriptors close): it stops taking calls, closes its sink (what it
took is inserted and synced) and exits. Without a read channel the parent ends it when
the run's sink closes (:meth:`OwnedSink.close`), so the run is durable and the store free
when the scheduler's stop returns, as before. With a read channel (a server) it keeps
answering reads until the scheduler process ends. It ignores SIGINT and SIGTERM: Ctrl-C
reaches every process of the terminal's group, and the run is stopped durably through the
scheduler, which then ends the owner.

Run as ``python -m dmi_sglang.app.store_owner_main --writes ADDRESS [--reads ADDRESS]
--ready-fd N`` (:func:`run_owner` with the composition root's channels), the run's
resolved ``DMX_*`` settings in its environment (never on its command line: a store
password must not show in a process listing).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog

from dmi_sglang.columns import RecordBatch, RecordSink
from dmi_sglang.domain.records import RequestManifest, RunInfo
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import StoreError

__all__ = ["OWNER_EXIT_S", "OWNER_MODULE", "OWNER_READY_S", "OpenServices", "OwnedSink",
           "Service", "open_owned_sink", "run_owner"]

log = structlog.get_logger(__name__)

OWNER_READY_S = 120.0
"""Longest the parent waits for a new owner to open the store and bind its channels."""
OWNER_EXIT_S = 600.0
"""Longest :meth:`OwnedSink.close` waits for the owner to insert what it took and exit."""
OWNER_MODULE = "dmi_sglang.app.store_owner_main"
"""The module the owner process runs (``python -m``)."""
_READY = b"ready\n"
_CHANNELS_PREFIX = "dmi-owner-"


class OwnedSink:
    """The :class:`~dmi_sglang.columns.RecordSink` of a run whose embedded store a store
    owner process holds: every call goes through the owner's write channel; :meth:`close`
    ends the owner too (unless it answers a server's reads: then it ends with this
    process)."""

    def __init__(self, remote: RecordSink, process: subprocess.Popen[bytes],
                 directory: str, *, serves_reads: bool) -> None:
        self._remote = remote
        self._process = process
        self._directory = directory
        self._serves_reads = serves_reads
        self.pid = process.pid
        """The owner process's pid."""

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
        """The owner's sink flushes, syncs, and writes the manifests and the run's end."""
        self._remote.finish_run(run, manifests)

    def close(self) -> None:
        """End this process's writes; without a read channel, end the owner and wait
        until it closed the store (what it took inserted and synced).

        Raises:
            StoreError: a call through the owner failed, or the owner failed to close
                its sink (its exit status), or did not exit within :data:`OWNER_EXIT_S`.
        """
        try:
            self._remote.close()
        finally:
            if not self._serves_reads:
                self.end()

    def end(self) -> None:
        """End the owner now (its reads too) and wait for it; idempotent.

        Raises:
            StoreError: the owner failed to close its sink, or did not exit in time.
        """
        process = self._process
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
        try:
            code = process.wait(OWNER_EXIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            msg = (f"the store owner (pid {process.pid}) did not close the store within "
                   f"{OWNER_EXIT_S:g} s and was killed; the run may miss rows")
            raise StoreError(msg) from None
        finally:
            _remove_directory(self._directory)
        if code != 0:
            msg = (f"the store owner (pid {process.pid}) failed to close the store (exit "
                   f"status {code}); its log says why")
            raise StoreError(msg)


def open_owned_sink(settings: Settings, read_address: str,
                    remote: Callable[[str], RecordSink]) -> OwnedSink:
    """Start a store owner for ``settings``' embedded store and return the sink that writes
    through it (``remote(address)``: the proxy of its write channel); with
    ``read_address`` the owner also answers a server's reads there.

    Raises:
        StoreError: the owner could not open the store or bind its channels (its own
            message), or did not get ready within :data:`OWNER_READY_S`.
    """
    directory = tempfile.mkdtemp(prefix=_CHANNELS_PREFIX)  # mode 0700: this user's alone
    writes = f"ipc://{os.path.join(directory, 'writes')}"
    argv = [sys.executable, "-m", OWNER_MODULE, "--writes", writes]
    if read_address:
        argv += ["--reads", read_address]
    ready_r, ready_w = os.pipe()
    try:
        process = subprocess.Popen(
            [*argv, "--ready-fd", str(ready_w)], stdin=subprocess.PIPE, pass_fds=(ready_w,),
            env={**os.environ, **settings.to_env()})
    except BaseException:
        os.close(ready_r)
        os.close(ready_w)
        _remove_directory(directory)
        raise
    os.close(ready_w)
    try:
        answer = _read_ready(ready_r, OWNER_READY_S)
    finally:
        os.close(ready_r)
    if answer != _READY:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _remove_directory(directory)
        why = answer.decode(errors="replace").strip() or (
            f"it exited with status {process.returncode} before it was ready")
        msg = f"the store owner could not open the store: {why}"
        raise StoreError(msg)
    log.info("dmi.store_owner_started", pid=process.pid, writes=writes,
             reads=read_address or None)
    return OwnedSink(remote(writes), process, directory, serves_reads=bool(read_address))


def _read_ready(fd: int, timeout_s: float) -> bytes:
    """What the owner wrote on its ready pipe until it closed it (or the deadline)."""
    deadline = time.monotonic() + timeout_s
    got = b""
    poller = select.poll()  # not select(): a busy process's descriptors pass 1024
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return got or f"not ready within {timeout_s:g} s".encode()
        if not poller.poll(left * 1000):
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return got
        got += chunk


def _remove_directory(directory: str) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


# -- the owner process -----------------------------------------------------------------
class Service(Protocol):
    """One of the owner's channels: it stops answering at :meth:`close`."""

    def close(self) -> None:
        """Stop answering (the call in hand is answered first)."""


OpenServices = Callable[[Settings, str, str], tuple[RecordSink, Sequence[Service]]]
"""``(settings, write address, read address or "") -> (the store's sink, its channels)``,
the write channel first (the composition root names the adapters)."""


def run_owner(argv: Sequence[str], open_services: OpenServices) -> int:
    """The owner process: open the store and its channels, tell the parent, serve until
    stdin ends, then close the channels and the sink; 0 when the sink closed cleanly."""
    parser = argparse.ArgumentParser(prog=f"python -m {OWNER_MODULE}")
    parser.add_argument("--writes", required=True)
    parser.add_argument("--reads", default="")
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it (module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        sink, services = open_services(Settings.from_env(), args.writes, args.reads)
    except Exception as exc:  # told to the parent, which raises it
        _tell(args.ready_fd, str(exc))
        return 1
    _tell(args.ready_fd, _READY.decode(), raw=True)
    while sys.stdin.buffer.read(65536):  # until the parent closes it, or dies
        pass
    services[0].close()  # no more writes; the call in hand is answered first
    code = 0
    try:
        sink.close()
    except Exception as exc:  # the parent sees the exit status
        log.error("dmi.store_owner_close_failed", error=repr(exc))
        code = 1
    for service in services[1:]:
        service.close()
    channels = os.path.dirname(args.writes.removeprefix("ipc://"))
    if os.path.basename(channels).startswith(_CHANNELS_PREFIX):  # a parent that died left it
        _remove_directory(channels)
    log.info("dmi.store_owner_ended", pid=os.getpid(), status=code)
    return code


def _tell(fd: int, text: str, *, raw: bool = False) -> None:
    os.write(fd, (text if raw else text.replace("\n", " ") + "\n").encode())
    os.close(fd)
