"""Merges held while a run captures, TOO_MANY_PARTS survived, and the run's files synced
to disk before ``finish_run`` returns (embedded store)."""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import torch
from clickhouse_connect.driver.exceptions import DatabaseError

from dmi_sglang.adapters.clickhouse import (
    ClickHouseReader,
    ClickHouseSink,
    _durable,
    _merges,
    _sink,
    connect,
)
from dmi_sglang.adapters.clickhouse._client import (
    disk_full,
    error_code,
    is_transient,
    too_many_parts,
)
from dmi_sglang.adapters.clickhouse._durable import sync_tree
from dmi_sglang.adapters.clickhouse._insert import open_inserter
from dmi_sglang.domain.records import RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError

from ._support import RESID, FaultyInserter, batch_of, commit, handle, manifest, run_info

TOO_MANY_PARTS = RuntimeError(
    "Code: 252. DB::Exception: Too many parts (5 with average size of 1.00 KiB) in table "
    "'default.offload'. Merges are processing significantly slower than inserts. "
    "(TOO_MANY_PARTS)"
)


@pytest.fixture
def client(store: StoreConfig) -> Iterator[Any]:
    """A client of this process on the store, beside the sink's own (as a reader would)."""
    opened: list[Any] = []

    def make() -> Any:
        opened.append(connect(store))
        return opened[-1]

    yield make
    for c in opened:
        c.close()


def _optimize(client: Any) -> str | None:
    """Merge the records table now; the error text when merges are stopped."""
    try:
        client.command("OPTIMIZE TABLE default.offload FINAL")
    except DatabaseError as exc:
        return str(exc)
    return None


def _active_parts(client: Any) -> int:
    return int(client.query("SELECT count() FROM system.parts WHERE database = 'default' "
                            "AND table = 'offload' AND active").result_rows[0][0])


def _put_flushed(sink: ClickHouseSink, request: str, inserts: int) -> torch.Tensor:
    """``inserts`` one-record batches of ``request``, each flushed (one part each)."""
    t = torch.randn(inserts, 8)
    for k in range(inserts):
        sink.put(batch_of("run", request, RESID, 0, t[k:k + 1], [k, k + 1], base=k, seq=k + 1))
        sink.flush()
    return t


# -- error classification --------------------------------------------------------------


def test_embedded_engine_errors_are_classified_by_their_code() -> None:
    assert error_code(TOO_MANY_PARTS) == 252
    assert too_many_parts(TOO_MANY_PARTS)
    assert not is_transient(TOO_MANY_PARTS)  # handled by waiting for merges instead
    assert is_transient(RuntimeError("Code: 241. DB::Exception: Memory limit exceeded"))
    assert not is_transient(RuntimeError("Code: 60. DB::Exception: Unknown table"))
    assert disk_full(RuntimeError("Code: 243. DB::Exception: Cannot reserve 1.00 MiB"))
    assert error_code(ValueError("Code: 252")) is None  # only the engine's errors are parsed
    assert too_many_parts(DatabaseError("Too many parts", code=252))


# -- merges ----------------------------------------------------------------------------


def test_merges_are_stopped_while_a_run_captures_and_started_when_it_finishes(
    open_sink: Callable[..., ClickHouseSink], client: Callable[[], Any]
) -> None:
    sink = open_sink()
    other = client()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    _put_flushed(sink, "r", 3)
    stopped = _optimize(other)
    assert stopped is not None
    assert "Cancelled merging parts" in stopped
    assert _active_parts(other) == 3
    commit(sink, run, [manifest("run", "r", 3, 1)])
    assert _optimize(other) is None
    assert _active_parts(other) == 1


def test_merges_start_again_when_the_sink_closes_without_finishing_the_run(
    open_sink: Callable[..., ClickHouseSink], client: Callable[[], Any]
) -> None:
    sink = open_sink()
    other = client()
    sink.start_run(run_info("run", [(RESID, 0)]))
    _put_flushed(sink, "r", 2)
    assert _optimize(other) is not None
    sink.close()
    assert _optimize(other) is None


def test_merges_start_again_once_the_run_made_many_parts(
    open_sink: Callable[..., ClickHouseSink], client: Callable[[], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_merges, "HELD_PARTS", 3)
    sink = open_sink()
    other = client()
    with structlog.testing.capture_logs() as logs:
        sink.start_run(run_info("run", [(RESID, 0)]))
        _put_flushed(sink, "r", 2)
        assert _optimize(other) is not None
        _put_flushed(sink, "r2", 1)  # the third part: merges run again, mid-run
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (  # the writer starts them, then logs it,
                _optimize(other) is not None  # right after its insert is done
                or not any(e["event"] == "store.merges_started" for e in logs)):
            time.sleep(0.01)
    assert _optimize(other) is None
    assert {"event": "store.merges_started", "reason": "parts"}.items() <= next(
        e for e in logs if e["event"] == "store.merges_started").items()


def test_too_many_parts_restarts_merges_and_every_record_is_stored(
    open_sink: Callable[..., ClickHouseSink], client: Callable[[], Any], store: StoreConfig
) -> None:
    sink = open_sink(retries=0, backoff_s=0.02)  # no ordinary retry at all
    other = client()
    # few parts (ClickHouse merges 10 small ones at once, fewer only after a while)
    other.command("ALTER TABLE default.offload MODIFY SETTING parts_to_throw_insert = 10, "
                  "parts_to_delay_insert = 0")
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    with structlog.testing.capture_logs() as logs:
        t = _put_flushed(sink, "r", 12)  # the 11th insert finds 10 parts: TOO_MANY_PARTS
    stats = sink.stats()
    assert stats.parts_waits >= 1
    assert (stats.retries, stats.records_stored, stats.inserts) == (0, 12, 12)
    assert [e["reason"] for e in logs if e["event"] == "store.merges_started"] == [
        "too many parts"]
    assert any(e["event"] == "store.too_many_parts" for e in logs)
    commit(sink, run, [manifest("run", "r", 12, 1)])
    got = handle(store, "run", "r").get("resid_pre", 0)
    assert torch.equal(got, t)


def test_too_many_parts_becomes_the_sticky_failure_after_the_wait(
    open_sink: Callable[..., ClickHouseSink], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_sink, "TOO_MANY_PARTS_WAIT_S", 0.3)
    made: list[FaultyInserter] = []

    def factory(config: StoreConfig) -> Any:
        made.append(FaultyInserter(open_inserter(config), lambda n: TOO_MANY_PARTS))
        return made[-1]

    sink = open_sink(inserter_factory=factory, retries=5, backoff_s=0.01, writers=1)
    sink.put(batch_of("run", "r", RESID, 0, torch.ones(2, 2), [0, 2]))
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"TOO_MANY_PARTS\) after 0.3 s of waiting for merg"):
        sink.flush()
    assert 0.25 < time.monotonic() - started < 5
    assert made[0].calls > 2
    assert sink.stats().retries == 0


# -- sync ------------------------------------------------------------------------------


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(_durable.os, "fsync", fsync)
    return synced


def _age(*paths: Path, seconds: int = 60) -> None:
    """Set the modification times of ``paths`` ``seconds`` into the past."""
    past = time.time_ns() - seconds * 10**9
    for p in paths:
        os.utime(p, ns=(past, past))


def test_sync_tree_syncs_files_changed_since_and_their_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "a.bin").write_bytes(b"x")
    (tmp_path / "b.bin").write_bytes(b"y")
    _age(old_dir / "a.bin", tmp_path / "b.bin", old_dir, tmp_path)
    since = time.time_ns() - 10**9
    new_dir = tmp_path / "new" / "part"
    new_dir.mkdir(parents=True)
    (new_dir / "data.bin").write_bytes(b"z" * 100)
    (old_dir / "changed.txt").write_bytes(b"w")
    os.symlink(new_dir / "data.bin", tmp_path / "link")
    synced = _record_fsyncs(monkeypatch)
    report = sync_tree(str(tmp_path), since)
    files = [str(new_dir / "data.bin"), str(old_dir / "changed.txt")]
    dirs = [str(new_dir), str(tmp_path / "new"), str(old_dir), str(tmp_path)]
    assert sorted(synced[:2]) == sorted(files)  # files first
    assert set(synced[2:]) == set(dirs)
    assert synced[2] == str(new_dir)  # deepest directory first, the root last
    assert synced[-1] == str(tmp_path)
    assert (report.files, report.directories, report.nbytes) == (2, 4, 101)


def test_a_record_of_synced_files_leaves_out_what_is_unchanged_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    part = tmp_path / "part"
    part.mkdir()
    (part / "a.bin").write_bytes(b"a")
    (part / "b.bin").write_bytes(b"b")
    _age(part / "a.bin", part / "b.bin", part, tmp_path)
    record = _durable.SyncedFiles(slack_ns=10**9)
    synced = _record_fsyncs(monkeypatch)
    first = sync_tree(str(tmp_path), 0, record)
    assert set(synced) == {str(part / "a.bin"), str(part / "b.bin"), str(part), str(tmp_path)}
    assert (first.files, first.directories, first.skipped) == (2, 2, 0)
    synced.clear()
    again = sync_tree(str(tmp_path), 0, record)  # nothing changed: nothing to sync
    assert synced == []
    assert (again.files, again.directories, again.skipped) == (0, 0, 4)
    before = os.stat(part / "b.bin")
    (part / "b.bin").write_bytes(b"B")  # rewritten in place, as long: its directory as is
    os.utime(part / "b.bin", ns=(before.st_atime_ns, before.st_mtime_ns))  # its old time
    same_size = sync_tree(str(tmp_path), 0, record)
    assert set(synced) == {str(part / "b.bin"), str(part)}
    assert (same_size.files, same_size.directories, same_size.skipped) == (1, 1, 2)
    synced.clear()
    (part / "a.bin").write_bytes(b"changed")  # rewritten: synced again
    (part / "new.bin").write_bytes(b"n")  # a new file: it and its directory
    third = sync_tree(str(tmp_path), 0, record)
    assert set(synced) == {str(part / "a.bin"), str(part / "new.bin"), str(part)}
    assert third.skipped == 2  # b.bin and the root
    synced.clear()
    fourth = sync_tree(str(tmp_path), 0, record)  # changed within the slack: not recorded
    assert set(synced) == {str(part / "a.bin"), str(part / "new.bin"), str(part)}
    assert fourth.skipped == 2
    _age(part / "a.bin", part / "new.bin", part)  # settled now (as a later sync sees it)
    synced.clear()
    sync_tree(str(tmp_path), 0, record)
    assert set(synced) == {str(part / "a.bin"), str(part / "new.bin"), str(part)}
    synced.clear()
    sync_tree(str(tmp_path), 0, record)
    assert synced == []


def test_a_record_survives_a_later_cutoff_and_a_failed_sync_leaves_it_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "old.bin").write_bytes(b"o")
    _age(tmp_path / "old.bin", tmp_path)
    record = _durable.SyncedFiles(slack_ns=10**9)
    sync_tree(str(tmp_path), 0, record)
    late = time.time_ns()
    sync_tree(str(tmp_path), late, record)  # old.bin is before this cutoff: still recorded
    synced = _record_fsyncs(monkeypatch)
    assert sync_tree(str(tmp_path), 0, record).skipped == 2
    assert synced == []
    (tmp_path / "new.bin").write_bytes(b"n")
    _age(tmp_path / "new.bin", tmp_path)
    kept = dict(record.keys)

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_durable.os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        sync_tree(str(tmp_path), 0, record)
    assert record.keys == kept  # new.bin and the root are not taken for durable


def _unlistable(monkeypatch: pytest.MonkeyPatch, which: Callable[[str], bool]) -> list[str]:
    """Directories for which ``which`` is true fail to list (EIO); the list of those
    asked for."""
    real = os.scandir
    asked: list[str] = []

    def scandir(path: Any = ".") -> Any:
        if which(os.fspath(path)):
            asked.append(os.fspath(path))
            raise OSError(errno.EIO, "Input/output error", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    return asked


def test_a_directory_the_sync_cannot_list_fails_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Found in review: os.walk skipped such a directory silently, its files unsynced
    part = tmp_path / "store" / "part"
    part.mkdir(parents=True)
    (part / "data.bin").write_bytes(b"x" * 100)
    _unlistable(monkeypatch, lambda p: p.endswith("/part"))
    with pytest.raises(OSError, match="Input/output error"):
        sync_tree(str(tmp_path / "store"), 0)
    with pytest.raises(FileNotFoundError, match="the store's directory is gone"):
        sync_tree(str(tmp_path / "gone"), 0)  # a vanished store is not "synced"


def _capturing(open_sink: Callable[..., ClickHouseSink],
               monkeypatch: pytest.MonkeyPatch) -> tuple[ClickHouseSink, RunInfo]:
    """A sink whose run ``run`` captures request ``r`` (4 positions of resid_pre layer 0,
    put, not flushed), with no background sync pass: finish_run's syncs alone."""
    monkeypatch.setattr(_sink, "SYNC_PASS_S", 3600.0)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    sink.put(batch_of("run", "r", RESID, 0, torch.randn(4, 8), [0, 4]))
    return sink, run


def test_a_run_whose_parts_cannot_be_listed_is_not_finished(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink, run = _capturing(open_sink, monkeypatch)
    sink.flush()
    parts = {part for part, in _part_paths(store)}
    asked = _unlistable(monkeypatch, lambda p: os.path.realpath(p).rstrip("/") in parts)
    with pytest.raises(StoreError, match="syncing the files of run run"):
        commit(sink, run, [manifest("run", "r", 4, 1)])
    assert asked
    monkeypatch.undo()
    recorded = ClickHouseReader(store).run("run")
    assert recorded is not None
    assert recorded.status is RunStatus.FAILED


def test_finish_run_syncs_the_runs_parts_to_disk(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink, run = _capturing(open_sink, monkeypatch)
    synced = _record_fsyncs(monkeypatch)
    with structlog.testing.capture_logs() as logs:
        commit(sink, run, [manifest("run", "r", 4, 1)])
    assert sink.stats().sync_seconds > 0
    events = [e for e in logs if e["event"] == "store.synced"]
    assert len(events) == 2  # the data, then the manifests and the run's status
    assert sum(e["files"] for e in events) == len([p for p in synced if os.path.isfile(p)])
    assert all(e["files"] > 0 and e["seconds"] >= 0 for e in events)
    parts = [str(p) for p, in _part_paths(store)]
    assert parts
    for part in parts:  # every file of every part of the records table, and the part
        names = [os.path.join(part, n) for n in os.listdir(part)]
        assert set(names) <= set(synced), set(names) - set(synced)
        assert os.path.realpath(part).rstrip("/") in synced
    assert len(ClickHouseReader(store).records("run", "r")) == 1


def test_finish_run_reports_its_time_and_what_it_waited_for(
    open_sink: Callable[..., ClickHouseSink], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stop of a stored capture waits in ``finish_run``: the stats say how long, how
    much of it went to inserting what was still queued or in flight, and how much that
    was (the rest: the syncs and the final rows)."""
    gate = threading.Event()
    insert = ClickHouseSink._insert

    def held(self: ClickHouseSink, *args: Any) -> None:
        gate.wait(10)  # the run's batch stays in flight until finish_run waits for it
        insert(self, *args)

    monkeypatch.setattr(ClickHouseSink, "_insert", held)
    sink, run = _capturing(open_sink, monkeypatch)
    queued = sink.stats().queued_bytes
    assert queued > 0
    threading.Timer(0.3, gate.set).start()
    commit(sink, run, [manifest("run", "r", 4, 1)])
    s = sink.stats()
    assert s.finish_queued_bytes == queued
    assert s.finish_flush_seconds >= 0.25
    assert s.finish_seconds >= s.finish_flush_seconds + s.sync_seconds
    gate.set()
    sink.start_run(run_info("next", [(RESID, 0)]))  # a second run adds to the sums
    commit(sink, run_info("next", [(RESID, 0)]), [])
    again = sink.stats()
    assert again.finish_queued_bytes == queued  # nothing was queued at its start
    assert again.finish_seconds > s.finish_seconds


def test_the_data_is_on_disk_before_a_row_says_the_run_is_complete(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found in review: the committed status was written before the sync, so a power
    # loss between the two could leave a committed run over data that never reached disk
    sink, run = _capturing(open_sink, monkeypatch)
    sink.flush()
    data = _part_files(store)
    events = _record_fsyncs(monkeypatch)
    write = sink._write_control

    def recorded(table: str, rows: list[Any], what: str) -> None:
        events.append(f"write {what}")
        write(table, rows, what)

    monkeypatch.setattr(sink, "_write_control", recorded)
    commit(sink, run, [manifest("run", "r", 4, 1)])
    writes = [i for i, e in enumerate(events) if e.startswith("write ")]
    assert len(writes) == 2  # the manifests, then the run's status
    assert data <= set(events[: writes[0]]), data - set(events[: writes[0]])
    status_parts = _part_files(store, "offload_runs") | _part_files(store, "offload_manifest")
    late = status_parts - data
    assert late  # the final rows' parts, synced after they were written
    assert late <= set(events[writes[-1]:]), late - set(events[writes[-1]:])


def _part_paths(store: StoreConfig, table: str = "offload") -> list[tuple[str]]:
    c = connect(store)
    try:
        rows = c.query("SELECT path FROM system.parts WHERE database = 'default' "
                       f"AND table = '{table}' AND active").result_rows
        return [(os.path.realpath(str(r[0]).rstrip("/")),) for r in rows]
    finally:
        c.close()


def _part_files(store: StoreConfig, table: str = "offload") -> set[str]:
    return {os.path.join(part, n) for part, in _part_paths(store, table)
            for n in os.listdir(part)}


def _wait_until(done: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _record_passes(monkeypatch: pytest.MonkeyPatch, *, blind: bool = False) -> list[int]:
    """Background passes every 0.05 s, each recorded (its cutoff); ``blind`` ones see
    nothing and sync nothing (as a pass that missed every part)."""
    monkeypatch.setattr(_sink, "SYNC_PASS_S", 0.05)
    real = _sink.sync_tree
    passes: list[int] = []

    def sync_tree(root: str, since_ns: int,
                  synced: _durable.SyncedFiles | None = None) -> _durable.SyncReport:
        if threading.current_thread().name == "dmi-sink-sync":
            passes.append(since_ns)
            if blind:
                return _durable.SyncReport(0, 0, 0, 0.001)
        return real(root, since_ns, synced)

    monkeypatch.setattr(_sink, "sync_tree", sync_tree)
    return passes


def _sync_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dmi-sink-sync"]


def test_a_capturing_run_is_synced_in_the_background_and_finish_run_syncs_the_rest(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The passes sync what is written while the run captures; finish_run syncs what
    came after them, and leaves out the files a pass made durable that have not
    changed since (settled: written longer than the slack before that pass)."""
    monkeypatch.setattr(_sink, "SYNC_PASS_S", 0.05)
    monkeypatch.setattr(_sink, "_MTIME_SLACK_NS", 200_000_000)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    synced = _record_fsyncs(monkeypatch)
    sink.put(batch_of("run", "early", RESID, 0, torch.randn(4, 8), [0, 4]))
    sink.flush()
    early = _part_files(store)
    assert early
    assert _wait_until(lambda: early <= set(synced)
                       and sink.stats().background_sync_seconds > 0), early - set(synced)
    time.sleep(0.3)  # the early part settles; a write makes a pass see it so
    settled_by = len(synced)
    sink.put(batch_of("run", "mid", RESID, 0, torch.randn(4, 8), [0, 4]))
    sink.flush()
    assert _wait_until(lambda: len(synced) > settled_by + 1)  # a pass after the write
    earlier = _part_files(store)
    sink.put(batch_of("run", "late", RESID, 0, torch.randn(4, 8), [0, 4]))
    sink.flush()
    late = _part_files(store) - earlier
    assert late
    before = len(synced)
    commit(sink, run, [manifest("run", r, 4, 1) for r in ("early", "mid", "late")])
    final = set(synced[before:])
    assert not early & final, early & final  # durable and unchanged: left out
    assert late <= final, late - final  # not settled, whatever the passes did
    assert sink.stats().sync_seconds > 0
    assert not _sync_threads()  # the passes end with the run
    assert len(ClickHouseReader(store).records("run", "late")) == 1


def test_finish_run_syncs_what_the_background_passes_missed(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass can miss a part whose directory is renamed into place during its walk:
    the sync at finish does not rely on the passes."""
    passes = _record_passes(monkeypatch, blind=True)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    sink.put(batch_of("run", "r", RESID, 0, torch.randn(4, 8), [0, 4]))
    sink.flush()
    assert _wait_until(lambda: bool(passes))
    time.sleep(0.2)  # any pass the insert still asked for ran (and saw nothing)
    synced = _record_fsyncs(monkeypatch)
    commit(sink, run, [manifest("run", "r", 4, 1)])
    files = _part_files(store)
    assert files
    assert files <= set(synced), files - set(synced)


def test_a_pass_slower_than_the_period_is_followed_shortly_while_writes_go_on(
    open_sink: Callable[..., ClickHouseSink], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capture that writes faster than the disk syncs keeps the disk busy: the next
    pass starts a tenth of the period after the previous one ends, not a period later
    (what finish_run is left to sync stays about one pass's worth)."""
    monkeypatch.setattr(_sink, "SYNC_PASS_S", 0.3)
    real = _sink.sync_tree
    spans: list[tuple[float, float]] = []

    def slow(root: str, since_ns: int,
             synced: _durable.SyncedFiles | None = None) -> _durable.SyncReport:
        if threading.current_thread().name != "dmi-sink-sync":
            return real(root, since_ns, synced)
        began = time.monotonic()
        time.sleep(0.4)  # a disk slower than the capture
        report = real(root, since_ns, synced)
        spans.append((began, time.monotonic()))
        return report

    monkeypatch.setattr(_sink, "sync_tree", slow)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    ends = time.monotonic() + 1.9
    n = 0
    while time.monotonic() < ends:  # a write during every pass
        sink.put(batch_of("run", f"r{n}", RESID, 0, torch.randn(4, 8), [0, 4]))
        sink.flush()
        n += 1
        time.sleep(0.02)
    commit(sink, run, [])
    assert len(spans) >= 3
    gaps = [b - a for (_, a), (b, _) in itertools.pairwise(spans)]
    assert all(gap >= 0.03 for gap in gaps), gaps  # a tenth of the period's rest
    assert max(gaps) < 0.15, gaps  # not a period after the previous pass ended: 0.3


def test_background_passes_wait_for_writes(
    open_sink: Callable[..., ClickHouseSink], monkeypatch: pytest.MonkeyPatch,
) -> None:
    passes = _record_passes(monkeypatch)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)  # the run's row: one write
    assert _wait_until(lambda: len(passes) >= 1)
    time.sleep(0.5)  # ten periods without a write
    idle = len(passes)
    assert idle <= 2  # the pass of the run's row (and one racing it), no more
    sink.put(batch_of("run", "r", RESID, 0, torch.randn(4, 8), [0, 4]))
    sink.flush()
    assert _wait_until(lambda: len(passes) > idle)
    sink.close()
    assert not _sync_threads()


def test_a_failed_background_sync_leaves_its_files_to_the_next_one(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_sink, "SYNC_PASS_S", 0.05)
    monkeypatch.setattr(_sink, "_MTIME_SLACK_NS", 200_000_000)
    synced: list[str] = []
    failing = [True]
    real = os.fsync

    def fsync(fd: int) -> None:  # a file gone meanwhile (a merge removed its part)
        if failing[0]:
            raise OSError(errno.ENOENT, "No such file or directory")
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(_durable.os, "fsync", fsync)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    with structlog.testing.capture_logs() as logs:
        sink.start_run(run)
        sink.put(batch_of("run", "r", RESID, 0, torch.randn(4, 8), [0, 4]))
        sink.flush()
        files = _part_files(store)
        assert _wait_until(lambda: any(e["event"] == "store.sync_pass_failed" for e in logs))
        time.sleep(0.6)  # failing passes for longer than the slack and a pass period
        failing[0] = False
        assert _wait_until(lambda: files <= set(synced) and any(
            e["event"] == "store.sync_pass_recovered" for e in logs)), files - set(synced)
    failed = [e for e in logs if e["event"] == "store.sync_pass_failed"]
    assert len(failed) == 1  # once, not every second
    assert failed[0]["log_level"] == "warning"
    assert "No such file or directory" in failed[0]["error"]
    commit(sink, run, [manifest("run", "r", 4, 1)])
    assert len(ClickHouseReader(store).records("run", "r")) == 1


def test_a_write_back_error_seen_by_a_background_pass_fails_the_commit(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EIO from a background pass's fsync: the kernel reports a failed write-back once
    and marks the pages clean, so the final sync passes over data that may be lost; the
    commit fails on the error the pass saw, and the run is not recorded committed."""
    monkeypatch.setattr(_sink, "SYNC_PASS_S", 0.05)
    real = os.fsync
    failed = threading.Event()

    def fsync(fd: int) -> None:  # EIO once, from the background pass, then "clean"
        if threading.current_thread().name == "dmi-sink-sync" and not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(_durable.os, "fsync", fsync)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    sink.put(batch_of("run", "r", RESID, 0, torch.randn(4, 8), [0, 4]))
    sink.flush()
    assert failed.wait(10)
    with pytest.raises(StoreError, match="Input/output error"):
        commit(sink, run, [manifest("run", "r", 4, 1)])
    sink.close()
    got = ClickHouseReader(store).run("run")
    assert got is not None
    assert got.status is not RunStatus.COMMITTED


def test_finish_run_raises_when_the_files_cannot_be_synced(
    open_sink: Callable[..., ClickHouseSink], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_sink, "SYNC_PASS_S", 0.05)

    def fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_durable.os, "fsync", fsync)
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    sink.put(batch_of("run", "r", RESID, 0, torch.randn(4, 8), [0, 4]))
    time.sleep(0.2)  # background passes fail meanwhile
    with pytest.raises(StoreError, match="syncing the files of run run"):
        commit(sink, run, [manifest("run", "r", 4, 1)])
    s = sink.stats()  # a failed finish is timed too, its flush apart from the rest
    assert s.finish_seconds > s.finish_flush_seconds > 0


class _StartFailsOnce:
    """The sink's control client; its first ``SYSTEM START MERGES`` fails with a
    transient engine error, everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.failed = False

    def command(self, sql: str, *args: Any, **kw: Any) -> Any:
        if "START MERGES" in sql and not self.failed:
            self.failed = True
            raise RuntimeError("Code: 241. DB::Exception: Memory limit exceeded "
                               "(MEMORY_LIMIT_EXCEEDED)")
        return self._inner.command(sql, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _start_fails_once() -> tuple[Callable[[StoreConfig], Any], list[_StartFailsOnce]]:
    made: list[_StartFailsOnce] = []

    def factory(config: StoreConfig) -> Any:
        made.append(_StartFailsOnce(connect(config)))
        return made[-1]

    return factory, made


def test_merges_start_at_close_when_the_finishs_start_failed(
        open_sink: Callable[..., ClickHouseSink], client: Callable[[], Any]) -> None:
    factory, controls = _start_fails_once()
    sink = open_sink(client_factory=factory)
    other = client()  # the engine stays open in this process (reads, the store owner)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    _put_flushed(sink, "r", 3)
    commit(sink, run, [manifest("run", "r", 3, 1)])  # its START MERGES fails once
    assert controls[0].failed
    sink.close()  # "finish_run and close start them again"
    assert _optimize(other) is None


def test_too_many_parts_survives_a_failed_start_of_merges(
        open_sink: Callable[..., ClickHouseSink], client: Callable[[], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sink, "TOO_MANY_PARTS_WAIT_S", 5.0)
    factory, controls = _start_fails_once()
    sink = open_sink(client_factory=factory, retries=0, backoff_s=0.02)
    client().command("ALTER TABLE default.offload MODIFY SETTING parts_to_throw_insert = 10, "
                     "parts_to_delay_insert = 0")
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    _put_flushed(sink, "r", 12)  # the 11th insert finds 10 parts: TOO_MANY_PARTS
    assert controls[0].failed
    commit(sink, run, [manifest("run", "r", 12, 1)])


def test_a_sink_closed_without_finishing_its_run_syncs_what_it_committed(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store owner closes its sink when the capturing process died: the requests
    committed while the run went on are as durable as a finished run's."""
    sink, _run = _capturing(open_sink, monkeypatch)  # no background pass
    sink.commit_requests([manifest("run", "r", 4, 1)])
    sink.flush()
    synced = _record_fsyncs(monkeypatch)
    sink.close()
    written = _part_files(store) | _part_files(store, "offload_manifest")
    assert written <= set(synced), written - set(synced)


def test_a_server_error_no_retry_changes_is_not_retried_whatever_its_class() -> None:
    from clickhouse_connect.driver.exceptions import OperationalError

    refused = OperationalError("connection refused")  # the network: retried
    assert is_transient(refused)
    unknown = OperationalError("HTTP driver received HTTP status 404: Unknown table")
    unknown.code = 60  # type: ignore[attr-defined]  # clickhouse-connect sets it when known
    assert not is_transient(unknown)
    busy = OperationalError("too many simultaneous queries")
    busy.code = 202  # type: ignore[attr-defined]
    assert is_transient(busy)  # TOO_MANY_SIMULTANEOUS_QUERIES: retried


class _ManifestsFail:
    """The sink's control client; writing the manifests table fails (not transient)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def insert(self, table: str, *args: Any, **kw: Any) -> Any:
        if table.endswith("_manifest`"):
            raise DatabaseError("Code: 49. DB::Exception: a logical error (LOGICAL_ERROR)")
        return self._inner.insert(table, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_run_whose_manifests_cannot_be_written_is_recorded_failed(
        open_sink: Callable[..., ClickHouseSink], store: StoreConfig) -> None:
    sink = open_sink(client_factory=lambda config: _ManifestsFail(connect(config)), retries=0)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    _put_flushed(sink, "r", 2)
    with pytest.raises(StoreError, match="writing manifests of run"):
        commit(sink, run, [manifest("run", "r", 2, 1)])
    sink.close()
    h = handle(store, "run", "r")
    assert not h.available
    assert h.missing[0].startswith("run 'run' is failed, not committed: writing manifests")
