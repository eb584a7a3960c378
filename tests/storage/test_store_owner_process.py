"""The store owner process (``dmi_sglang.app.store_owner``): a capture's writes reach the
embedded store through a process of its own, which ends (store closed, durable) when the
run's sink closes, and never on Ctrl-C (its parent's death:
``tests/reliability/test_runs.py``)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog.testing
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseReader
from dmi_sglang.app.composition import open_capture_sink
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.app.store_owner import OWNER_MODULE, RELEASE_SIGNAL, OwnedSink
from dmi_sglang.domain.records import RunStatus
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import StoreError
from tests.contracts._tp_data import RUN, RUN_INFO, finish, stored, whole_tensors
from tests.reliability._faults import ends


def _settings(url: str) -> Settings:
    return Settings.from_kwargs({"dmx_db_url": url}, env={}).resolve(model_path="/m/toy")


def test_writes_go_through_an_owner_that_ends_durable_at_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The close returns once the owner said its store is closed (its exit, reaped by a
    thread, completes on its own): the store is free at once."""
    from dmi_sglang.app import store_owner

    reaped: list[int] = []
    reaping = threading.Event()
    real_reap = store_owner._reap

    def reap(process: subprocess.Popen[bytes]) -> None:
        reaped.append(process.pid)
        reaping.set()
        real_reap(process)

    monkeypatch.setattr(store_owner, "_reap", reap)
    url = f"chdb://{tmp_path / 'store'}"
    sink = open_capture_sink(_settings(url))
    assert isinstance(sink, OwnedSink)
    assert sink.pid != os.getpid()
    sink.start_run(RUN_INFO)
    for batch in stored(whole_tensors()):
        sink.put(batch)
    finish(sink)
    os.kill(sink.pid, signal.SIGINT)  # Ctrl-C reaches the whole group: the owner stays
    os.kill(sink.pid, signal.SIGTERM)  # so does a group's SIGTERM: the scheduler ends it
    sink.flush()
    sink.close()
    assert reaping.wait(30)  # it said so: only then is a reaper started, the close
    assert reaped == [sink.pid]  # not waiting for its exit
    store = _settings(url).store()  # free at once: this process opens it directly
    handle = CaptureHandle(RUN, "r", lambda: ClickHouseReader(store))
    assert handle.missing == ()
    for name, whole in whole_tensors().items():
        assert torch.equal(handle.get(name, 0), whole), name
    assert ClickHouseReader(store).run(RUN).status is RunStatus.COMMITTED
    assert ends(sink.pid)  # its exit completes on its own


def test_an_ended_owners_exit_is_seen_as_it_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ending an owner waits for its exit on a pidfd, woken by the exit itself:
    ``Popen.wait`` with a timeout sleeps between checks (up to 50 ms each), so a stop
    returned that much after the store was free. Where there is no pidfd it still waits
    for the exit, and the exit status is the owner's either way."""
    from dmi_sglang.app import store_owner

    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        pytest.skip("no pidfd on this system")
    real_sleep = time.sleep
    for pidfd in (True, False):
        owner = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(0.3); "
             "sys.exit(7)"], stdin=subprocess.PIPE)
        slept: list[float] = []
        with monkeypatch.context() as patch:
            patch.setattr(time, "sleep", functools.partial(
                _noted_sleep, slept, real_sleep, threading.get_ident()))
            if not pidfd:
                patch.setattr(os, "pidfd_open", _no_pidfd, raising=False)
            code = store_owner._stop(owner, None, 60.0, release=False)
        assert code == 7
        assert bool(slept) is not pidfd, slept


_SAYS_CLOSED = ("import os, sys; fd, go = int(sys.argv[1]), int(sys.argv[2]); "
                "sys.stdin.read(); os.write(fd, b'closed 4\\n'); os.close(fd); "
                "os.read(go, 1); sys.exit(4)")
"""An owner that says it closed its store, then exits (status 4) once ``go`` ends."""


def _saying_closed() -> tuple[subprocess.Popen[bytes], int, int]:
    """An owner of :data:`_SAYS_CLOSED`, its status pipe's read end and the write end of
    its ``go`` pipe (closed: it exits)."""
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    owner = subprocess.Popen([sys.executable, "-c", _SAYS_CLOSED, str(status_w), str(go_r)],
                             stdin=subprocess.PIPE, pass_fds=(status_w, go_r))
    os.close(status_w)
    os.close(go_r)
    return owner, status_r, go_w


def test_an_owner_that_says_it_closed_the_store_is_not_waited_for_to_exit() -> None:
    """The owner says on its status pipe when its store is closed (free for the next
    opener), with the exit status it will have: the stop goes on from there, while the
    rest of its exit (its memory unmapped) completes on its own; a thread reaps it."""
    from dmi_sglang.app import store_owner

    owner, status_r, go_w = _saying_closed()
    try:
        assert store_owner._stop(owner, None, 60.0, release=False, status_fd=status_r) == 4
        assert owner.poll() is None  # it has not exited: the stop did not wait for it
    finally:
        os.close(go_w)
    deadline = time.monotonic() + 30
    while owner.returncode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.returncode == 4  # reaped: no zombie left behind
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(status_r)  # closed by the stop


def test_an_owner_that_ends_without_saying_so_is_waited_for_and_its_status_stands() -> None:
    """An owner that exits without its last line (it crashed while closing): the stop
    waits for its exit and reports that status."""
    from dmi_sglang.app import store_owner

    status_r, status_w = os.pipe()
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(9)", str(status_w)],
        stdin=subprocess.PIPE, pass_fds=(status_w,))
    os.close(status_w)
    assert store_owner._stop(owner, None, 60.0, release=False, status_fd=status_r) == 9
    assert owner.returncode == 9


def test_an_owner_that_says_nothing_in_time_is_killed() -> None:
    from dmi_sglang.app import store_owner

    status_r, status_w = os.pipe()
    owner = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", str(status_w)],
        stdin=subprocess.PIPE, pass_fds=(status_w,))
    os.close(status_w)
    started = time.monotonic()
    assert store_owner._stop(owner, None, 1.0, release=False, status_fd=status_r) is None
    assert time.monotonic() - started < 10
    assert owner.returncode == -signal.SIGKILL


def test_an_owner_that_dies_is_seen_at_its_exit_while_another_holds_its_pipe() -> None:
    """Another process holding a copy of the status pipe's write end keeps it from
    ending: the owner's exit itself (a pidfd) says it ended without a word."""
    from dmi_sglang.app import store_owner

    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        pytest.skip("no pidfd on this system")
    status_r, status_w = os.pipe()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              pass_fds=(status_w,))
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(9)", str(status_w)],
        stdin=subprocess.PIPE, pass_fds=(status_w,))
    os.close(status_w)
    try:
        started = time.monotonic()
        assert store_owner._stop(owner, None, 30.0, release=False, status_fd=status_r) == 9
        assert time.monotonic() - started < 10  # not the 30 s the pipe alone would take
    finally:
        holder.kill()
        holder.wait()


def test_an_owner_that_said_it_closed_and_never_exits_is_killed_by_its_reaper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.app import store_owner

    monkeypatch.setattr(store_owner, "OWNER_EXIT_S", 1.0)
    owner, status_r, go_w = _saying_closed()
    try:
        with structlog.testing.capture_logs() as logs:
            assert store_owner._stop(owner, None, 30.0, release=False,
                                     status_fd=status_r) == 4
            deadline = time.monotonic() + 20
            while owner.returncode is None and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        os.close(go_w)
    assert owner.returncode == -signal.SIGKILL
    assert any(e["event"] == "dmi.store_owner_exit_hung" for e in logs)


def test_an_owner_reaped_before_its_end_is_not_waited_for_by_its_pid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner that exited and was reaped already (``OwnedSink.failure`` polls it): its
    pid may name another process by now, so no pidfd is opened for it; its status stands."""
    from dmi_sglang.app import store_owner

    owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(5)"],
                             stdin=subprocess.PIPE)
    assert owner.wait(60) == 5
    monkeypatch.setattr(os, "pidfd_open", _must_not_open, raising=False)
    assert store_owner._stop(owner, None, 60.0, release=True) == 5


def test_a_released_owner_closes_its_write_channel_its_sink_then_its_reads() -> None:
    """The write channel closes first (its call in hand finished), without the grace for
    an answer on its way only when the parent said it is the channel's sole writer; then
    the sink; then the read channels, with their grace (a server's readers are others),
    also after a sink that failed to close (status 1)."""
    from dmi_sglang.app.store_owner import close_owned

    for sole_writer, sink_fails in ((True, False), (False, False), (True, True)):
        calls: list[tuple[str, dict[str, bool]]] = []
        code, free = close_owned(_Closing("sink", calls, fails=sink_fails),
                                 [_Closing("writes", calls), _Closing("reads", calls)],
                                 sole_writer=sole_writer)
        assert calls == [("writes", {"wait_forever": True, "answered": sole_writer}),
                         ("sink", {}), ("reads", {})]
        assert code == int(sink_fails)
        assert free is not sink_fails  # a sink that failed to close may hold the store


def test_an_owner_whose_read_is_still_in_hand_does_not_say_its_store_is_free() -> None:
    """A read channel whose call outlasted its close's wait keeps that call's store
    client open: the owner must not tell its parent the store is free (the parent then
    waits for its exit, which releases the store)."""
    from dmi_sglang.app.store_owner import close_owned

    calls: list[tuple[str, dict[str, bool]]] = []
    code, free = close_owned(_Closing("sink", calls),
                             [_Closing("writes", calls), _Closing("reads", calls, ends=False)],
                             sole_writer=True)
    assert (code, free) == (0, False)
    code, free = close_owned(_Closing("sink", calls),
                             [_Closing("writes", calls, ends=False), _Closing("reads", calls)],
                             sole_writer=True)
    assert (code, free) == (0, False)


class _Closing:
    """A sink or a channel that notes its close (and its keywords) in ``calls``; a
    channel whose call in hand outlasts the close does not ``end``."""

    def __init__(self, name: str, calls: list[tuple[str, dict[str, bool]]], *,
                 fails: bool = False, ends: bool = True) -> None:
        self.name, self.calls, self.fails, self.ends = name, calls, fails, ends

    def close(self, **kw: bool) -> bool:
        self.calls.append((self.name, kw))
        if self.fails:
            raise StoreError("the store went away")
        return self.ends


def _noted_sleep(slept: list[float], sleep: Callable[[float], None], thread: int,
                 seconds: float) -> None:
    if threading.get_ident() == thread:  # another test's daemon thread may sleep too
        slept.append(seconds)
    sleep(seconds)


def _no_pidfd(pid: int) -> int:
    raise OSError(38, "Function not implemented")


def _must_not_open(pid: int) -> int:
    raise AssertionError(f"a pidfd was opened for pid {pid}, reaped already")


def test_an_owner_that_died_is_the_sinks_failure_without_a_call(tmp_path: Path) -> None:
    """An engine that idles asks its sink's ``failure`` (no call to the owner): an owner
    killed while the run is open is reported at once; one this sink ended is not a
    failure."""
    url = f"chdb://{tmp_path / 'store'}"
    sink = open_capture_sink(_settings(url))
    assert isinstance(sink, OwnedSink)
    sink.start_run(RUN_INFO)
    assert sink.failure is None
    os.kill(sink.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while sink.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    failure = sink.failure
    assert isinstance(failure, StoreError)
    assert f"pid {sink.pid}" in str(failure)
    assert f"exit status {-signal.SIGKILL}" in str(failure)
    with pytest.raises(StoreError):
        sink.close()
    with pytest.raises(StoreError, match=f"pid {sink.pid}"):
        sink.end()  # again: the same outcome, nothing touched

    healthy = open_capture_sink(_settings(f"chdb://{tmp_path / 'other'}"))
    assert isinstance(healthy, OwnedSink)
    healthy.start_run(RUN_INFO)
    finish(healthy)
    healthy.close()  # ends the owner: its exit is not the run's failure
    healthy.end()  # again: nothing to do
    assert ends(healthy.pid)
    assert healthy.failure is None


def test_the_owner_opens_the_store_of_the_settings_it_is_handed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keywords win over ``DMX_*`` variables: ``dmx_null_mode=False`` and a store URL in a
    shell that exported ``DMX_NULL_MODE=1`` capture into that store; the owner process
    must not read the variable the keyword overrode (it refused to open the store)."""
    monkeypatch.setenv("DMX_NULL_MODE", "1")
    url = f"chdb://{tmp_path / 'store'}"
    settings = Settings.from_kwargs({"dmx_null_mode": False, "dmx_db_url": url}).resolve(
        model_path="/m/toy")
    sink = open_capture_sink(settings)
    try:
        sink.start_run(RUN_INFO)
        finish(sink)
    finally:
        sink.close()
    run = ClickHouseReader(settings.store()).run(RUN)
    assert run is not None
    assert run.status is RunStatus.COMMITTED


def _owner(tmp_path: Path, url: str, *,
           piped: bool = False) -> tuple[subprocess.Popen[bytes], bytes]:
    """An owner process started as :func:`open_owned_sink` starts one (``piped``: its
    stdout and stderr into one pipe), and the first line it wrote to its ready pipe."""
    channels = tmp_path / "channels"
    channels.mkdir(mode=0o700)
    ready_r, ready_w = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", OWNER_MODULE, "--writes", f"ipc://{channels}/writes",
         "--parent", str(os.getpid()), "--ready-fd", str(ready_w)],
        stdin=subprocess.PIPE, pass_fds=(ready_w,),
        stdout=subprocess.PIPE if piped else None,
        stderr=subprocess.STDOUT if piped else None,
        env={**os.environ, **_settings(url).to_env()})
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        return process, ready.readline()


def test_the_owner_process_exits_with_run_owners_status(tmp_path: Path) -> None:
    """The owner's entry point ends with ``os._exit`` (no teardown): its status is still
    :func:`run_owner`'s, and what it wrote before reaches the parent."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a store")
    process, line = _owner(tmp_path, f"chdb://{blocker}")
    assert process.wait(60) == 1
    assert process.stdin is not None
    process.stdin.close()
    assert line.startswith(b"error: ")
    assert b"a-file" in line


def test_a_released_owner_exits_zero_with_its_log_flushed(tmp_path: Path) -> None:
    """The owner ends with ``os._exit`` (no finalization): exit status 0 once its sink
    closed, and its last log lines (the store closed, the owner ended) reach its parent
    through a piped stdout."""
    process, line = _owner(tmp_path, f"chdb://{tmp_path / 's'}", piped=True)
    assert line == b"ready\n"
    process.send_signal(RELEASE_SIGNAL)
    out, _ = process.communicate(timeout=60)  # closes its stdin too
    assert process.returncode == 0
    assert b"store.closed" in out
    assert b"dmi.store_owner_ended" in out


def test_an_owner_that_cannot_open_the_store_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a store")
    with pytest.raises(StoreError, match=r"the store owner could not open the store: .*a-file"):
        open_capture_sink(_settings(f"chdb://{blocker}"))


def test_a_long_tmpdir_still_gives_the_owner_a_channel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """IPC socket paths longer than about 107 bytes cannot bind: the write channel then
    goes under /tmp."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    url = f"chdb://{tmp_path / 'store'}"
    sink = open_capture_sink(_settings(url))
    try:
        sink.start_run(RUN_INFO)
        finish(sink)
    finally:
        sink.close()
    assert ClickHouseReader(_settings(url).store()).run(RUN).status is RunStatus.COMMITTED
    assert list(deep.iterdir()) == []


def test_an_owner_that_dies_before_it_is_ready_is_reported_with_its_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.app import store_owner

    monkeypatch.setattr(store_owner, "OWNER_MODULE", "dmi_sglang.no_such_owner_module")
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"exited with status 1 before it was ready"):
        open_capture_sink(_settings(f"chdb://{tmp_path / 'store'}"))
    assert time.monotonic() - started < 30


def test_closing_ends_the_owner_while_a_forked_child_holds_its_stdin(tmp_path: Path) -> None:
    """A process the scheduler forked keeps a copy of the owner's stdin pipe, so closing it
    alone would not end the owner: the release signal does, at once."""
    sink = open_capture_sink(_settings(f"chdb://{tmp_path / 'store'}"))
    assert isinstance(sink, OwnedSink)
    child = os.fork()
    if child == 0:  # a copy of every descriptor, the pipe's write end among them
        time.sleep(60)
        os._exit(0)
    try:
        sink.start_run(RUN_INFO)
        finish(sink)
        started = time.monotonic()
        sink.close()
        assert time.monotonic() - started < 10  # not the 600 s an unreleased owner takes
        assert ends(sink.pid)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
