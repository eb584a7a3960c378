"""The shared ring a remote sink hands the store owner its batches through: regions never
overlap one the owner still reads, come back once the owner's last view of them is gone,
and every batch reaches the store whole, also through a ring much smaller than the data;
where no ring can be made or the owner refuses one, batches cross the socket as before."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import structlog
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.adapters.owner import RemoteSink, SinkService, _shared, _writes
from dmi_sglang.adapters.owner._frames import batch_from_frames, batch_to_frames
from dmi_sglang.adapters.owner._shared import SLOTS, SharedRegions, SharedRing
from dmi_sglang.app.null_sink import NullSink
from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.domain.records import RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError

pytestmark = pytest.mark.skipif(not os.path.isdir(_shared.SHARED_DIRECTORY),
                                reason="no /dev/shm")

KEY = CaptureKey("resid_pre", 0, "torch.bfloat16", (256,))
ROW = 512  # bytes of one 256-wide bf16 row


def _batch(step: int, rows: int = 64, run_id: str = "ring") -> RecordBatch:
    """``rows`` records of one row each, request ``r`` of ``step``, payload bytes that
    say which (step, request) they are."""
    payload = np.empty((rows, ROW), np.uint8)
    payload[:] = ((np.arange(rows) * 7 + step * 13) % 251).astype(np.uint8)[:, None]
    return RecordBatch(run_id, tuple(f"req-{r}" for r in range(rows)), (KEY,),
                       np.arange(rows, dtype=np.int32), np.zeros(rows, np.int32),
                       np.full(rows, step, np.int32), np.full(rows, step + 1, np.int32),
                       np.full(rows, step, np.int64),
                       np.arange(rows + 1, dtype=np.int64) * ROW, payload.reshape(-1))


@pytest.fixture
def private(tmp_path: Path) -> Path:
    tmp_path.chmod(0o700)
    return tmp_path


@contextlib.contextmanager
def _owner(private: Path, sink: Any, **remote: Any) -> Iterator[tuple[SinkService, RemoteSink]]:
    """An owner's write channel over ``sink`` in ``private`` and a remote sink of it
    (``remote``: its keywords); the channel is closed after."""
    service = SinkService(sink, f"ipc://{private}/writes")
    try:
        yield service, RemoteSink(service.address, **remote)
    finally:
        service.close()


def _ring_files() -> list[str]:
    """This process's ring files left in /dev/shm."""
    return [f for f in os.listdir(_shared.SHARED_DIRECTORY)
            if f.startswith(f"dmi-ring-{os.getpid()}-")]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30_000), st.booleans(), st.integers(0, 10)),
                min_size=1, max_size=120))
@example([(14785, False, 0), (25217, True, 0), (25217, True, 0)])  # the only view released
def test_regions_never_overlap_one_still_held(ops: list[tuple[int, bool, int]]) -> None:
    """Places of random sizes, with the owner releasing random held regions in between:
    each region lies in the ring, and every region still held keeps its bytes."""
    ring = SharedRing(SLOTS + 65_536)
    try:
        regions = SharedRegions()
        ring_id = regions.attach(ring.path, ring.size)
        ring.unlink()
        views: list[tuple[int, list[object]]] = []  # (fill byte, the owner's pieces)
        for count, (n, release, pick) in enumerate(ops):
            if release and views:
                del views[pick % len(views)]  # the owner's last view of it is gone
                gc.collect()
            fill = count % 255 + 1  # no two regions alive fill alike (at most 120 are)
            try:
                region = ring.place([np.full(n, fill, np.uint8), np.full(7, fill, np.uint8)],
                                    timeout_s=0)
            except StoreError:  # full: every older region is still held
                assert views
                continue
            _, offset, lengths = region
            assert lengths == (n, 7)
            assert ring._start <= offset
            assert offset + n <= ring.size
            views.append((fill, regions.pieces(ring_id, region)))
            _assert_each_holds_its_fill(views)
    finally:
        ring.close()


def _assert_each_holds_its_fill(views: list[tuple[int, list[object]]]) -> None:
    """Every piece still held holds its region's fill byte (checked in a frame of its
    own: a loop variable left in the test's frame would keep the last region's view
    alive, so deleting it from ``views`` would not release that region)."""
    for value, pieces in views:
        for piece in pieces:
            assert set(bytes(piece.buffer)) == {value}  # type: ignore[attr-defined]


def test_a_region_comes_back_when_the_owners_last_view_of_it_is_gone() -> None:
    ring = SharedRing(SLOTS + 4096)
    try:
        regions = SharedRegions()
        ring_id = regions.attach(ring.path, ring.size)
        header, frames = batch_to_frames(_batch(0, rows=4))
        region = ring.place(frames, timeout_s=0)
        batch = batch_from_frames(header, regions.pieces(ring_id, region))
        payload = batch.payload
        del batch
        gc.collect()
        assert ring._flags[region[0]] == 1  # a view of the payload is still alive
        with pytest.raises(StoreError, match="released none of the shared ring's 1 regions"):
            ring.place(frames, timeout_s=0.01)  # no room for a second while it is held
        del payload
        gc.collect()
        assert ring._flags[region[0]] == 0
        assert ring.place(frames, timeout_s=0)[1] == region[1]  # the same memory again
    finally:
        ring.close()


def test_the_owner_maps_only_a_private_ring_file_in_dev_shm(tmp_path: Path) -> None:
    ring = SharedRing(SLOTS + 4096)
    try:
        regions = SharedRegions()
        outside = tmp_path / "dmi-ring-x"
        outside.write_bytes(b"\0" * ring.size)
        with pytest.raises(ValueError, match="accepted: a dmi-ring-\\* file in /dev/shm"):
            regions.attach(str(outside), ring.size)
        with pytest.raises(ValueError, match=f"of {ring.size} bytes, mode 600.*accepted: a "
                                             f"file of {ring.size + 1} bytes"):
            regions.attach(ring.path, ring.size + 1)
        os.chmod(ring.path, 0o644)
        with pytest.raises(ValueError, match="mode 644"):
            regions.attach(ring.path, ring.size)
        os.chmod(ring.path, 0o600)
        ring_id = regions.attach(ring.path, ring.size)
        with pytest.raises(ValueError, match=r"shared region .* outside ring"):
            regions.pieces(ring_id, [0, ring.size - 64, [128]])
    finally:
        ring.close()


def _run(run_id: str) -> RunInfo:
    return RunInfo(run_id, "/models/m", (), (("resid_pre", 0),), "2026-12-05T00:00:00Z")


def _stored(store: StoreConfig, run_id: str) -> dict[tuple[str, int], bytes]:
    with ClickHouseReader(store).session() as reader:
        out = {}
        for b in reader.batches_within(run_id, "req-3", captures=[("resid_pre", 0)],
                                       start=0, end=10_000):
            for i in range(len(b)):
                out[(b.request_ids[b.request[i]], int(b.start[i]))] = bytes(
                    b.payload[b.offsets[i]:b.offsets[i + 1]])
        return out


def test_batches_cross_a_ring_much_smaller_than_them_and_are_stored_whole(
        private: Path, store: StoreConfig) -> None:
    """40 batches of 32 KiB through a 64 KiB ring into the real embedded store: puts wait
    for the owner's inserts to release regions, and every row reads back as written."""
    sink = ClickHouseSink(store)
    try:
        with _owner(private, sink, timeout_s=60, shared_bytes=SLOTS + (64 << 10)) as (_, remote):
            remote.start_run(_run("ring"))
            for step in range(40):
                remote.put(_batch(step))
            assert remote.shared
            remote.finish_run(attrs.evolve(_run("ring"), status=RunStatus.COMMITTED), [])
            remote.close()
    finally:
        sink.close()
    rows = _stored(store, "ring")
    assert sorted(rows) == [("req-3", step) for step in range(40)]
    for step in range(40):
        assert rows[("req-3", step)] == bytes([(3 * 7 + step * 13) % 251]) * ROW


class _Keeps:
    """A sink that takes every batch and keeps it (never releasing its memory)."""

    def __init__(self) -> None:
        self.batches: list[RecordBatch] = []

    def start_run(self, run: RunInfo) -> None:
        del run

    def put(self, batch: RecordBatch) -> None:
        self.batches.append(batch)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_batch_crosses_a_ring_it_fits_whole_and_the_socket_in_pieces(
        private: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the ring a put is one region (pieces held until their inserts would fill
    a ring smaller than an insert); once the ring is refused, puts go in pieces."""
    from dmi_sglang.adapters.owner import PUT_PIECE_BYTES

    big = _batch(0, rows=3 * PUT_PIECE_BYTES // ROW)  # three pieces' worth
    kept = _Keeps()
    with _owner(private, kept, timeout_s=30, shared_bytes=SLOTS + (64 << 20)) as (_, remote):
        remote.put(big)
        assert remote.shared
        assert [b.nbytes for b in kept.batches] == [big.nbytes]
        remote.close()

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_shared.os, "posix_fallocate", full)
    kept = _Keeps()
    with _owner(private, kept, timeout_s=30, shared_bytes=SLOTS + (64 << 20)) as (_, remote):
        remote.put(big)  # the ring tried, refused: this one goes whole on the socket
        remote.put(big)
        assert not remote.shared
        assert [b.nbytes for b in kept.batches] == [big.nbytes] + [PUT_PIECE_BYTES] * 3
        remote.close()


def test_a_ring_the_owner_never_releases_fails_the_put_after_the_timeout(
        private: Path) -> None:
    kept = _Keeps()
    with _owner(private, kept, timeout_s=0.5, shared_bytes=SLOTS + (80 << 10)) as (_, remote):
        try:
            remote.put(_batch(0))
            remote.put(_batch(1))  # 2 x 32 KiB held: no room for a third
            with pytest.raises(StoreError, match=r"released none of the shared ring's 2 "
                                                 r"regions in 0\.5 s"):
                remote.put(_batch(2))
            with pytest.raises(StoreError, match="released none"):  # sticky
                remote.flush()
            assert [bytes(b.payload) for b in kept.batches] == [
                bytes(_batch(s).payload) for s in (0, 1)]
        finally:
            with pytest.raises(StoreError):
                remote.close()


def test_without_room_for_a_ring_batches_cross_the_socket(
        private: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_shared.os, "posix_fallocate", full)
    kept = _Keeps()
    with _owner(private, kept, timeout_s=30, shared_bytes=1 << 20) as (_, remote):
        with structlog.testing.capture_logs() as logs:
            remote.put(_batch(0))
            remote.put(_batch(1))
        assert not remote.shared
        refused = [e for e in logs if e["event"] == "dmi.shared_ring_refused"]
        assert len(refused) == 1  # tried once
        assert "No space left on device" in refused[0]["reason"]
        assert _ring_files() == []
        assert [bytes(b.payload) for b in kept.batches] == [
            bytes(_batch(s).payload) for s in (0, 1)]
        remote.close()


def test_a_ring_the_owner_refuses_leaves_the_batches_on_the_socket(
        private: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: SharedRegions, path: str, size: int) -> str:
        msg = f"not today: {path} {size}"
        raise ValueError(msg)

    monkeypatch.setattr(SharedRegions, "attach", refuse)
    kept = _Keeps()
    with _owner(private, kept, timeout_s=30, shared_bytes=1 << 20) as (_, remote):
        with structlog.testing.capture_logs() as logs:
            remote.put(_batch(0))
        assert not remote.shared
        assert remote.failure is None
        assert any("not today" in e.get("reason", "") for e in logs)
        assert len(kept.batches) == 1
        remote.close()


def test_a_closed_sink_gives_its_ring_up_and_leaves_no_file(private: Path) -> None:
    kept = _Keeps()
    with _owner(private, kept, timeout_s=30, shared_bytes=1 << 20) as (service, remote):
        remote.put(_batch(0))
        assert remote.shared
        assert _ring_files() == []  # mapped, then removed
        remote.close()
        assert service._shared._rings == {}  # the owner forgot it
        assert bytes(kept.batches[0].payload) == bytes(_batch(0).payload)  # still readable


def test_puts_from_several_threads_each_reach_the_owner(private: Path) -> None:
    kept = _Keeps()
    with _owner(private, kept, timeout_s=30, shared_bytes=1 << 20) as (_, remote):
        threads = [threading.Thread(target=lambda s=s: remote.put(_batch(s)))
                   for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(int(b.start[0]) for b in kept.batches) == list(range(8))
        for b in kept.batches:
            assert bytes(b.payload) == bytes(_batch(int(b.start[0])).payload)
        remote.close()


def test_a_region_released_out_of_order_waits_for_the_older_ones() -> None:
    """The newest region released while older ones are held: its space comes back only
    once they are (the ring hands out memory in order), and theirs is never reused."""
    ring = SharedRing(SLOTS + 64 * 1024)
    try:
        regions = SharedRegions()
        ring_id = regions.attach(ring.path, ring.size)
        held = [regions.pieces(ring_id, ring.place([np.full(16 * 1024, v, np.uint8)], 0))
                for v in (1, 2, 3)]
        del held[2]  # the newest released, the two older still read
        gc.collect()
        with pytest.raises(StoreError, match="released none"):
            ring.place([np.full(32 * 1024, 9, np.uint8)], timeout_s=0)  # fits only over them
        fits = regions.pieces(ring_id, ring.place([np.full(16 * 1024, 4, np.uint8)], 0))
        for value, pieces in ((1, held[0]), (2, held[1]), (4, fits)):
            assert set(bytes(pieces[0].buffer)) == {value}
    finally:
        ring.close()


class _Slow(NullSink):
    """A sink that keeps nothing and takes ``delay_s`` over the put of step ``slow_step``."""

    def __init__(self, slow_step: int, delay_s: float) -> None:
        super().__init__()
        self.slow_step, self.delay_s = slow_step, delay_s

    def put(self, batch: RecordBatch) -> None:
        if int(batch.start[0]) == self.slow_step:
            time.sleep(self.delay_s)
        super().put(batch)


def test_close_waits_for_the_owner_at_most_the_after_loss_timeout(
        private: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer's put holds the owner: a closing sink's unshare gives up after the
    bounded wait, not after the 30 s its puts may wait (the socket's first timeout)."""
    monkeypatch.setattr(_writes, "AFTER_LOSS_TIMEOUT_S", 0.5)
    with _owner(private, _Slow(slow_step=7, delay_s=3.0), timeout_s=30,
                shared_bytes=1 << 20) as (service, ring_sink):
        other = RemoteSink(service.address, timeout_s=30)
        ring_sink.put(_batch(0))
        busy = threading.Thread(target=other.put, args=(_batch(7),))
        busy.start()
        time.sleep(0.3)  # the owner is in the slow put
        began = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            ring_sink.close()
        assert time.monotonic() - began < 2.0
        assert [e["event"] for e in logs] == ["dmi.shared_ring_unshare_failed"]
        busy.join()
        other.close()


def test_the_owner_forgets_the_ring_of_a_writer_that_lost_an_exchange(private: Path) -> None:
    slow = _Slow(slow_step=1, delay_s=1.5)
    with _owner(private, slow, timeout_s=0.5, shared_bytes=1 << 20) as (service, remote):
        remote.put(_batch(0))
        with pytest.raises(StoreError, match="did not take put"):
            remote.put(_batch(1))
        with pytest.raises(StoreError, match="did not take put"):
            remote.close()  # its unshare queued behind the lost put, on a new socket
        deadline = time.monotonic() + 10
        while service._shared._rings and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.batches_put == 2
        assert service._shared._rings == {}


def test_a_ring_smaller_than_its_flags_is_refused_when_the_sink_is_made(private: Path) -> None:
    with pytest.raises(ValueError, match=f"a shared ring of {SLOTS} bytes; accepted: 0 or at "
                                         f"least {SLOTS + 64}"):
        RemoteSink(f"ipc://{private}/writes", shared_bytes=SLOTS)


def test_a_failed_copy_never_lets_two_held_regions_share_a_slot() -> None:
    """Puts that fail while copying take no slot, so after a full cycle of them a new
    region's flag is its own (released with an older region's, its memory was reused)."""
    ring = SharedRing(SLOTS + 64 * 1024)
    try:
        regions = SharedRegions()
        ring_id = regions.attach(ring.path, ring.size)
        old = regions.pieces(ring_id, ring.place([np.full(8192, 1, np.uint8)], 0))
        for _ in range(SLOTS - 1):
            with pytest.raises((TypeError, ValueError)):
                ring.place([np.zeros(8, np.uint8), np.array([object()])], 0)
        new = regions.pieces(ring_id, ring.place([np.full(8192, 2, np.uint8)], 0))
        del old
        gc.collect()
        for value in range(3, 12):
            try:
                ring.place([np.full(8192, value, np.uint8)], 0)
            except StoreError:
                break
        assert set(bytes(new[0].buffer)) == {2}  # type: ignore[attr-defined]
    finally:
        ring.close()


def test_a_ring_file_its_dead_writer_left_is_removed_by_the_next_ring() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = Path(_shared.SHARED_DIRECTORY) / f"dmi-ring-{gone.pid}-0123456789abcdef"
    alive = Path(_shared.SHARED_DIRECTORY) / f"dmi-ring-{os.getpid()}-fedcba9876543210"
    for path in (left, alive):
        path.write_bytes(b"\0" * 64)
    try:
        SharedRing(SLOTS + 4096).close()
        assert not left.exists()
        assert alive.exists()  # a live writer's file is its own
    finally:
        for path in (left, alive):
            path.unlink(missing_ok=True)
