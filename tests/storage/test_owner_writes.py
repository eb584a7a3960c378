"""The store owner's write channel: another process's records reach the run the owner
holds (the embedded store admits one process), with the sink's backpressure and failures.
The whole ``RecordSink`` contract runs through it too (``tests/contracts``,
``clickhouse-through-owner``)."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.adapters.owner import RemoteSink, SinkService
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.domain.records import RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError
from tests.contracts._tp_data import RUN, RUN_INFO, finish, rank_one, stored, whole_tensors


@pytest.fixture
def private(tmp_path: Path) -> Path:
    """A directory of this user's alone (the owner serves only there)."""
    tmp_path.chmod(0o700)
    return tmp_path


def test_two_processes_write_one_tp_run_into_the_owners_store(private: Path,
                                                              store: StoreConfig) -> None:
    sink = ClickHouseSink(store)
    service = SinkService(sink, f"ipc://{private}/writes")
    try:
        sink.start_run(RUN_INFO)
        child = multiprocessing.get_context("spawn").Process(target=rank_one,
                                                             args=(service.address,))
        child.start()
        for batch in stored(whole_tensors(), ranks=range(1)):  # rank 0: the owner itself
            sink.put(batch)
        child.join(120)
        assert child.exitcode == 0
        finish(sink)
    finally:
        service.close()
        sink.close()
    handle = CaptureHandle(RUN, "r", lambda: ClickHouseReader(store))
    assert handle.missing == ()
    for name, whole in whole_tensors().items():
        assert torch.equal(handle.get(name, 0), whole), name
    assert service.answered == 2 + 1  # rank 1's puts (one per forward) and its flush


class _Held:
    """A sink whose ``put`` waits until released, and which fails when told to."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        """Set once a ``put`` began waiting."""
        self.failure: Exception | None = None
        self.batches: list[RecordBatch] = []

    def start_run(self, run: RunInfo) -> None:
        del run

    def put(self, batch: RecordBatch) -> None:
        self.entered.set()
        self.release.wait(30)
        if self.failure is not None:
            raise self.failure
        self.batches.append(batch)

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        del manifests

    def flush(self) -> None:
        if self.failure is not None:
            raise self.failure

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        del run, manifests

    def close(self) -> None:
        pass


@pytest.fixture
def held(private: Path) -> Iterator[tuple[_Held, SinkService]]:
    sink = _Held()
    service = SinkService(sink, f"ipc://{private}/writes")
    yield sink, service
    sink.release.set()
    service.close()


def one_batch() -> RecordBatch:
    return stored(whole_tensors(), ranks=range(1, 2))[0]


def test_a_put_waits_while_the_owners_sink_does(held: tuple[_Held, SinkService]) -> None:
    sink, service = held
    remote = RemoteSink(service.address, timeout_s=30)
    done = threading.Event()
    batch = one_batch()
    thread = threading.Thread(target=lambda: (remote.put(batch), done.set()))
    thread.start()
    assert not done.wait(0.5)  # the owner's queue is full: the caller waits
    sink.release.set()
    assert done.wait(10)
    thread.join()
    (got,) = sink.batches
    assert (got.request_ids, got.captures, got.shard_rank) == (
        batch.request_ids, batch.captures, batch.shard_rank)
    assert bytes(got.payload) == bytes(batch.payload)
    for name in ("request", "capture", "start", "end", "seq", "offsets"):
        assert getattr(got, name).tolist() == getattr(batch, name).tolist()


def test_the_owners_sink_failure_is_the_callers_sticky_failure(
        held: tuple[_Held, SinkService]) -> None:
    sink, service = held
    sink.release.set()
    remote = RemoteSink(service.address, timeout_s=30)
    sink.failure = StoreError("the disk is full")
    with pytest.raises(StoreError, match=r"^the disk is full$"):
        remote.put(one_batch())
    sink.failure = None  # sticky on the caller's side too, as a local sink's failure is
    with pytest.raises(StoreError, match=r"^the disk is full$"):
        remote.flush()
    with pytest.raises(StoreError, match=r"^the disk is full$"):
        remote.close()
    other = RemoteSink(service.address, timeout_s=30)
    sink.failure = ValueError("odd")
    with pytest.raises(StoreError, match="failed flush: ValueError: odd"):
        other.flush()


def test_after_the_owners_sink_failed_the_runs_failure_still_reaches_it(
        held: tuple[_Held, SinkService]) -> None:
    """A local sink records a run failed after its own failure (``finish_run``); through
    the owner that call must still get there, and raise the first failure."""
    sink, service = held
    sink.release.set()
    finished: list[RunInfo] = []
    sink.finish_run = lambda run, manifests: finished.append(run)  # type: ignore[method-assign]
    remote = RemoteSink(service.address, timeout_s=30)
    sink.failure = StoreError("the disk is full")
    with pytest.raises(StoreError, match=r"^the disk is full$"):
        remote.put(one_batch())
    failed = attrs.evolve(RUN_INFO, status=RunStatus.FAILED, error="disk")
    with pytest.raises(StoreError, match=r"^the disk is full$"):
        remote.finish_run(failed, [])
    assert finished == [failed]
    with pytest.raises(StoreError, match=r"^the disk is full$"):
        remote.close()


def _lost_put(held: tuple[_Held, SinkService]) -> tuple[RemoteSink, list[RunInfo]]:
    """A remote sink whose put's answer was lost (the owner's sink holds it), and the
    runs the owner's sink will be asked to finish."""
    sink, service = held
    finished: list[RunInfo] = []
    sink.finish_run = lambda run, manifests: finished.append(run)  # type: ignore[method-assign]
    remote = RemoteSink(service.address, timeout_s=0.3)
    with pytest.raises(StoreError, match="did not take put"):
        remote.put(one_batch())
    return remote, finished


def test_after_a_lost_exchange_only_the_failed_finish_is_sent(
        held: tuple[_Held, SinkService]) -> None:
    """A server's owner outlives the capture: once it got through the call whose answer
    was lost, it records the run failed (else the run would read running, live, for as
    long as the server lives). Nothing else is sent after the loss."""
    sink, _ = held
    remote, finished = _lost_put(held)
    with pytest.raises(StoreError, match="did not take put"):  # raised at once, not sent
        remote.flush()
    sink.release.set()
    failed = attrs.evolve(RUN_INFO, status=RunStatus.FAILED, error="lost")
    with pytest.raises(StoreError, match="did not take put"):  # the first failure, after
        remote.finish_run(failed, [])  # the finish was delivered
    assert finished == [failed]
    assert len(sink.batches) == 1  # the lost put, stored once
    with pytest.raises(StoreError, match="did not take put"):
        remote.close()


def test_a_finish_after_a_lost_exchange_to_an_owner_still_stuck_gives_up(
        held: tuple[_Held, SinkService], monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.adapters.owner import _writes

    monkeypatch.setattr(_writes, "AFTER_LOSS_TIMEOUT_S", 0.3)
    remote, finished = _lost_put(held)
    started = time.monotonic()
    with pytest.raises(StoreError, match="did not take put"):
        remote.finish_run(attrs.evolve(RUN_INFO, status=RunStatus.FAILED), [])
    assert time.monotonic() - started < 10  # bounded by AFTER_LOSS_TIMEOUT_S, not 300 s
    assert finished == []  # the owner is still in the lost put


def test_a_closed_remote_sink_takes_nothing(held: tuple[_Held, SinkService]) -> None:
    sink, service = held
    sink.release.set()
    remote = RemoteSink(service.address, timeout_s=30)
    remote.put(one_batch())
    remote.close()
    with pytest.raises(StoreError, match="is closed"):
        remote.put(one_batch())
    assert len(sink.batches) == 1


def test_runs_and_manifests_cross_whole(held: tuple[_Held, SinkService]) -> None:
    sink, service = held
    seen: list[object] = []
    sink.start_run = seen.append  # type: ignore[method-assign]
    sink.finish_run = lambda run, manifests: seen.extend([run, *manifests])  # type: ignore[method-assign]
    sink.commit_requests = seen.extend  # type: ignore[method-assign]
    remote = RemoteSink(service.address, timeout_s=30)
    run = attrs.evolve(RUN_INFO, owner="host:1", error="e", status=RunStatus.FAILED,
                       stopped_at="later")
    manifests = [RequestManifest(RUN, "r", 3, 2, computed_from=1,
                                 overlap_extra_forward=True, committed=True)]
    remote.start_run(RUN_INFO)
    remote.commit_requests(manifests)
    remote.finish_run(run, manifests)
    assert seen == [RUN_INFO, *manifests, run, *manifests]


def test_an_owner_that_does_not_answer_fails_the_caller_for_good(
        held: tuple[_Held, SinkService]) -> None:
    sink, service = held
    remote = RemoteSink(service.address, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"did not take put within 0.3 s"):
        remote.put(one_batch())
    assert time.monotonic() - t0 < 5
    with pytest.raises(StoreError, match="did not take put"):  # sticky: the exchange is lost
        remote.flush()
    with pytest.raises(StoreError, match="did not take put"):
        remote.close()
    sink.release.set()  # the owner answers the lost call to nobody, then takes the next
    RemoteSink(service.address, timeout_s=30).flush()


def test_no_owner_at_the_address_fails_at_once(private: Path) -> None:
    remote = RemoteSink(f"ipc://{private}/nobody", timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="no store owner takes writes at"):
        remote.flush()
    assert time.monotonic() - t0 < 5


def test_a_call_the_owner_does_not_take_is_answered_and_the_channel_goes_on(
        held: tuple[_Held, SinkService]) -> None:
    import zmq

    sink, service = held
    sink.release.set()
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.RCVTIMEO, 5000)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(service.address)
    for request in ([b'{"method": "delete_run"}'], [b"not json"],
                    [b'{"method": "put", "run_id": "x"}'], [json.dumps(
                        {"method": "put", "run_id": "x", "request_ids": [], "captures": [],
                         "shard_rank": 0}).encode(), b"\0" * 3]):
        socket.send_multipart(request)
        kind, message = json.loads(socket.recv())
        assert kind != "ok"
        assert message
    socket.close()
    RemoteSink(service.address, timeout_s=30).put(one_batch())
    assert len(sink.batches) == 1


def test_the_owner_serves_only_a_private_ipc_address(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    with pytest.raises(StoreError, match="admit no one else"):
        SinkService(_Held(), f"ipc://{tmp_path}/writes")
    with pytest.raises(StoreError, match="ipc:///absolute/path"):
        RemoteSink("tcp://127.0.0.1:5555")


def test_a_bad_run_or_manifest_is_refused_before_the_sink(
        held: tuple[_Held, SinkService]) -> None:
    import zmq

    sink, service = held
    sink.release.set()
    taken: list[object] = []
    sink.commit_requests = taken.extend  # type: ignore[method-assign]
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.RCVTIMEO, 5000)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(service.address)
    good = attrs.asdict(RequestManifest(RUN, "r", 3, 2, committed=True))
    for bad in ({**good, "committed": "yes"}, {**good, "prompt_tokens": "lots"},
                {**good, "prompt_tokens": True}, {**good, "extra": 1},
                {k: v for k, v in good.items() if k != "request_id"}, [1, 2]):
        socket.send(json.dumps({"method": "commit_requests", "manifests": [bad]}).encode())
        kind, message = json.loads(socket.recv())
        assert (kind, "accepted" in message) == ("ValueError", True), message
    socket.send(json.dumps({"method": "commit_requests", "manifests": [good]}).encode())
    assert json.loads(socket.recv()) == ["ok"]
    socket.close()
    assert taken == [RequestManifest(RUN, "r", 3, 2, committed=True)]


def test_a_batch_sends_only_its_own_bytes(held: tuple[_Held, SinkService]) -> None:
    from dmi_sglang.adapters.owner._frames import batch_to_frames

    sink, service = held
    sink.release.set()
    whole = one_batch()
    shifted = RecordBatch(whole.run_id, whole.request_ids, whole.captures, whole.request,
                          whole.capture, whole.start, whole.end, whole.seq,
                          whole.offsets + 5, np.concatenate([np.zeros(5, np.uint8),
                                                             whole.payload,
                                                             np.zeros(7, np.uint8)]),
                          shard_rank=whole.shard_rank)
    frames = batch_to_frames(shifted)[1]
    assert len(frames[-1]) == shifted.nbytes == whole.nbytes  # not the 12 bytes around it
    RemoteSink(service.address, timeout_s=30).put(shifted)
    (got,) = sink.batches
    assert [bytes(r.payload) for r in got.records()] == [
        bytes(r.payload) for r in whole.records()]


def test_a_large_batch_crosses_in_pieces_of_whole_records(
        held: tuple[_Held, SinkService]) -> None:
    """A served window flush makes batches of about 80 MB: they go as pieces of at most
    PUT_PIECE_BYTES (the owner's receive buffers stay small), every record once, in
    order."""
    from dmi_sglang.adapters.owner import PUT_PIECE_BYTES

    sink, service = held
    sink.release.set()
    batch = _megabyte_rows(2 * (PUT_PIECE_BYTES >> 20) + 3)  # 1 MiB records
    RemoteSink(service.address, timeout_s=30).put(batch)
    assert [b.nbytes for b in sink.batches] == [PUT_PIECE_BYTES, PUT_PIECE_BYTES, 3 << 20]
    got = [(r.start_token_idx, bytes(r.payload)) for b in sink.batches for r in b.records()]
    assert got == [(r.start_token_idx, bytes(r.payload)) for r in batch.records()]


def test_a_large_put_is_one_exchange_with_the_owner(
        held: tuple[_Held, SinkService], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call into libzmq lets go of the GIL (a wait to get it back, beside a busy
    thread): a put of many pieces costs one exchange, not one per piece."""
    from dmi_sglang.adapters.owner import PUT_PIECE_BYTES

    exchanges: list[str] = []
    exchange = RemoteSink._exchange

    def counted(self: RemoteSink, header: dict[str, Any], *args: Any) -> list[Any]:
        exchanges.append(header["method"])
        return exchange(self, header, *args)

    monkeypatch.setattr(RemoteSink, "_exchange", counted)
    sink, service = held
    sink.release.set()
    batch = _megabyte_rows(3 * (PUT_PIECE_BYTES >> 20) + 1)
    RemoteSink(service.address, timeout_s=30).put(batch)
    assert exchanges == ["put"]
    assert [b.nbytes for b in sink.batches] == [PUT_PIECE_BYTES] * 3 + [1 << 20]
    got = [(r.start_token_idx, bytes(r.payload)) for b in sink.batches for r in b.records()]
    assert got == [(r.start_token_idx, bytes(r.payload)) for r in batch.records()]


def _megabyte_rows(n: int) -> RecordBatch:
    """``n`` records of one 1 MiB row each, positions 0..n-1, random bytes."""
    key = CaptureKey("resid_pre", 0, "torch.int32", (1 << 18,))
    at = np.arange(n, dtype=np.int32)
    payload = np.random.default_rng(n).integers(0, 256, n << 20, dtype=np.uint8)
    return RecordBatch(RUN, ("r",), (key,), np.zeros(n, np.int32), np.zeros(n, np.int32),
                       at, at + 1, at.astype(np.int64), np.arange(n + 1, dtype=np.int64) << 20,
                       payload)


class _Calls(_Held):
    """Records the calls it takes in order; a ``put`` takes ``delay_s``; the
    ``fail_at``-th put fails."""

    def __init__(self, delay_s: float = 0.0, fail_at: int = 0) -> None:
        super().__init__()
        self.release.set()
        self.calls: list[str] = []
        self.delay_s, self.fail_at = delay_s, fail_at

    def put(self, batch: RecordBatch) -> None:
        self.entered.set()
        time.sleep(self.delay_s)
        self.calls.append("put")
        if len(self.calls) == self.fail_at:
            msg = "the disk is full"
            raise StoreError(msg)
        self.batches.append(batch)

    def flush(self) -> None:
        self.calls.append("flush")


def test_a_failed_piece_stops_the_put_and_fails_the_sink(private: Path) -> None:
    """The pieces before the failed one were taken; the failure is sticky (the run is
    recorded failed at its finish, as for any failed put)."""
    from dmi_sglang.adapters.owner import PUT_PIECE_BYTES

    sink = _Calls(fail_at=2)
    service = SinkService(sink, f"ipc://{private}/writes")
    try:
        remote = RemoteSink(service.address, timeout_s=30)
        with pytest.raises(StoreError, match="the disk is full"):
            remote.put(_megabyte_rows(2 * (PUT_PIECE_BYTES >> 20) + 3))
        assert [b.nbytes for b in sink.batches] == [PUT_PIECE_BYTES]
        with pytest.raises(StoreError, match="the disk is full"):
            remote.flush()  # sticky: not sent
        assert sink.calls == ["put", "put"]
    finally:
        service.close()


def test_another_threads_call_never_lands_between_the_pieces_of_a_put(
        private: Path) -> None:
    sink = _Calls(delay_s=0.05)
    service = SinkService(sink, f"ipc://{private}/writes")
    try:
        remote = RemoteSink(service.address, timeout_s=30)
        putting = threading.Thread(target=remote.put, args=(_megabyte_rows(20),))
        putting.start()
        assert sink.entered.wait(10)
        remote.flush()  # another thread's call, while the put's pieces cross
        putting.join(30)
        assert sink.calls == ["put", "put", "put", "flush"]
    finally:
        service.close()


def test_closing_is_bounded_idempotent_and_leaves_a_later_service_alone(
        private: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.adapters.owner import _service

    monkeypatch.setattr(_service, "CLOSE_WAIT_S", 0.5)
    sink = _Held()  # never released: the call in hand waits
    first = SinkService(sink, f"ipc://{private}/writes")
    threading.Thread(target=lambda: RemoteSink(first.address, timeout_s=5).put(one_batch()),
                     daemon=True).start()
    time.sleep(0.5)
    t0 = time.monotonic()
    first.close()
    assert time.monotonic() - t0 < 3
    sink.release.set()
    second = SinkService(_Held(), first.address)
    first.close()  # again: the second service's socket file stays
    RemoteSink(second.address, timeout_s=30).flush()
    second.close()
    assert not (private / "writes").exists()


def test_closing_an_idle_service_wakes_its_thread(private: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread waits for a request without a timeout: ``close`` must wake it (a
    capture's stop waits for the owner's exit, which waits for this)."""
    from dmi_sglang.adapters.owner import _service

    monkeypatch.setattr(_service, "CLOSE_WAIT_S", 5.0)
    before = set(threading.enumerate())
    service = SinkService(_Held(), f"ipc://{private}/writes")
    (thread,) = (t for t in set(threading.enumerate()) - before if t.name == "dmi-store-writes")
    remote = RemoteSink(service.address, timeout_s=30)
    remote.flush()  # it answers, then waits again
    remote.close()
    time.sleep(0.2)
    service.close()
    assert not thread.is_alive()
    assert not (private / "writes").exists()
    service.close()  # again: nothing left to close


def test_a_service_whose_caller_has_its_answers_closes_without_the_grace(
        private: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``close(answered=True)``: the service's one caller ended it after its last call
    returned (a stop releasing its store owner), so no answer is on its way and the socket
    closes without the grace such an answer gets; a plain close keeps the grace."""
    from dmi_sglang.adapters.owner import _service

    monkeypatch.setattr(_service, "LATE_ANSWER_GRACE_S", 2.0)
    took = {}
    for answered in (True, False):
        service = SinkService(_Held(), f"ipc://{private}/writes-{answered}")
        RemoteSink(service.address, timeout_s=30).flush()  # answered just now
        t0 = time.monotonic()
        service.close(answered=answered)
        took[answered] = time.monotonic() - t0
    assert took[True] < 1.0, took
    assert took[False] >= 1.5, took


def test_a_store_that_fails_behind_the_owner_records_the_run_failed(
        private: Path, store: StoreConfig) -> None:
    """The real sink behind the write channel fails its inserts: the caller's stop, as
    the session makes it (``finish_run`` committed), gets the failure, and the store
    holds the run failed with the reason, as a local sink leaves it."""
    from clickhouse_connect.driver.exceptions import OperationalError

    from dmi_sglang.adapters.clickhouse._insert import open_inserter

    from ._support import FaultyInserter

    def factory(config: StoreConfig) -> FaultyInserter:
        return FaultyInserter(open_inserter(config), lambda n: OperationalError("disk gone"))

    sink = ClickHouseSink(store, inserter_factory=factory, retries=1, backoff_s=0.001,
                          writers=1)
    service = SinkService(sink, f"ipc://{private}/writes")
    try:
        remote = RemoteSink(service.address, timeout_s=60)
        remote.start_run(RUN_INFO)
        remote.put(one_batch())
        with pytest.raises(StoreError, match="disk gone"):
            remote.flush()
        with pytest.raises(StoreError, match="disk gone"):  # committed, as a stop asks
            remote.finish_run(attrs.evolve(RUN_INFO, status=RunStatus.COMMITTED), [])
    finally:
        service.close()
        with pytest.raises(StoreError, match="disk gone"):  # the owner's close says so too
            sink.close()
    run = ClickHouseReader(store).run(RUN)
    assert run is not None
    assert run.status is RunStatus.FAILED
    assert "disk gone" in run.error


def test_the_answer_to_the_call_in_hand_at_close_reaches_its_caller(private: Path) -> None:
    """A close that comes while a call is in hand, or right after its answer was sent:
    the caller gets the answer. The socket closed at once after the send lost it a few
    times in a hundred (the caller then waited out its timeout), so the race runs many
    times, in both orders."""
    for attempt in range(40):
        sink = _Held()
        service = SinkService(sink, f"ipc://{private}/writes{attempt}")
        outcome: list[object] = []

        def call(address: str = service.address, into: list[object] = outcome) -> None:
            try:
                RemoteSink(address, timeout_s=2).put(one_batch())
                into.append("answered")
            except StoreError as exc:
                into.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        assert sink.entered.wait(10)
        closer = threading.Thread(target=service.close, daemon=True)
        if attempt % 2:  # the answer is sent, the close follows at once
            sink.release.set()
            while service.answered == 0 and caller.is_alive():
                pass
            closer.start()
        else:  # the close waits for the call in hand
            closer.start()
            deadline = time.monotonic() + 10
            while not service._closed.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)
            sink.release.set()
        closer.join(10)
        caller.join(10)
        assert outcome == ["answered"], f"attempt {attempt}: {outcome}"
        assert len(sink.batches) == 1



def _numbered(n: int) -> RecordBatch:
    """``n`` one-row records of request ``r`` (one int32 a row), positions 0..n-1."""
    key = CaptureKey("resid_pre", 0, "torch.int32", (1,))
    at = np.arange(n, dtype=np.int32)
    return RecordBatch(RUN, ("r",), (key,), np.zeros(n, np.int32), np.zeros(n, np.int32),
                       at, at + 1, np.full(n, 7, np.int64), np.arange(n + 1, dtype=np.int64) * 4,
                       at.view(np.uint8))


def test_columns_received_over_the_socket_are_aligned_and_insert_without_warnings(
        private: Path, store: StoreConfig, capfd: pytest.CaptureFixture[str]) -> None:
    """zmq hands received frames out of its read buffer at any byte; a batch's integer
    columns must still be aligned (Arrow's readers warn on stderr, once per insert, and
    read them slowly otherwise) and equal to what was sent."""
    sent = [_numbered(n) for n in (1, 3, 5, 9, 13, 17, 33, 65, 100, 129, 1000)]
    seen: list[RecordBatch] = []
    sink = ClickHouseSink(store)
    put = sink.put

    def keep(batch: RecordBatch) -> None:
        seen.append(batch)
        put(batch)

    sink.put = keep  # type: ignore[method-assign]
    service = SinkService(sink, f"ipc://{private}/writes")
    try:
        sink.start_run(RUN_INFO)
        remote = RemoteSink(service.address, timeout_s=30)
        for batch in sent:
            remote.put(batch)
        remote.flush()
        finish(sink)
    finally:
        service.close()
        sink.close()
    assert len(seen) == len(sent)
    for got, want in zip(seen, sent, strict=True):
        for name in ("request", "capture", "start", "end", "seq", "offsets"):
            column = getattr(got, name)
            assert column.flags.aligned, (name, len(got))
            assert column.flags.c_contiguous, (name, len(got))
            assert np.array_equal(column, getattr(want, name)), name
    assert "poorly aligned" not in capfd.readouterr().err
