"""Storage faults and bad values, on the real embedded engine (server faults on loopback).

Each test's docstring is one row of docs/reliability.md: the case, then ``->`` and what
the store does.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dmi_sglang import open_store
from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink, connect
from dmi_sglang.adapters.clickhouse._insert import open_inserter
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import storable_request_id
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

from ._faults import WITHIN_S, commit, embedded, record, run_info, within


class _FailingClient:
    """A real client whose ``command`` raises ``error`` (creating the tables fails)."""

    def __init__(self, inner: Any, error: BaseException) -> None:
        self._inner, self._error = inner, error

    def command(self, *args: Any, **kwargs: Any) -> Any:
        raise self._error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _FailingInserter:
    """A real writer connection whose ``insert_arrow`` raises ``error``."""

    def __init__(self, inner: Any, error: BaseException) -> None:
        self._inner, self._error = inner, error
        self.inserts = 0

    def insert_arrow(self, table: str, arrow_table: Any, token: str = "") -> Any:
        self.inserts += 1
        raise self._error

    def close(self) -> None:
        self._inner.close()


def _batch(**kw: Any) -> RecordBatch:
    return RecordBatch.from_records([record(**kw)])


@pytest.fixture
def sinks() -> Iterator[list[ClickHouseSink]]:
    made: list[ClickHouseSink] = []
    yield made
    for sink in made:
        with contextlib.suppress(StoreError):
            sink.close()


def _sticky(sink: ClickHouseSink, match: str) -> StoreError:
    failure = within(sink.flush)
    assert isinstance(failure, StoreError), failure
    assert match in str(failure), str(failure)
    for action in (sink.flush, sink.close):
        again = within(action)
        assert again is failure
    return failure


def test_fault_a_record_the_encoder_cannot_encode(tmp_path: Path,
                                                  sinks: list[ClickHouseSink]) -> None:
    """A batch with a negative seq reaches a writer thread -> the Arrow encoder refuses it;
    the thread's exception is the sticky failure: flush, finish_run and close raise it;
    nothing hangs."""
    sink = ClickHouseSink(embedded(tmp_path / "s"))
    sinks.append(sink)
    sink.start_run(run_info())
    sink.put(_batch(seq=-1))
    failure = _sticky(sink, "a writer of chdb://")
    assert isinstance(failure.__cause__, OverflowError)
    assert "negative seq -1" in str(failure)


def test_bad_input_a_position_of_2_31_or_more(tmp_path: Path,
                                              sinks: list[ClickHouseSink]) -> None:
    """A record at position 2^31 (beyond Int32) -> refused where its record batch is built
    (OverflowError), before it reaches the sink, which stays usable; no hang."""
    sink = ClickHouseSink(embedded(tmp_path / "s"))
    sinks.append(sink)
    with pytest.raises(OverflowError):
        _batch(start=2**31, end=2**31 + 1)
    sink.put(_batch())
    assert within(sink.flush) is None
    assert sink.stats().records_stored == 1


def test_fault_an_absurd_partial_batch_wait(tmp_path: Path,
                                            sinks: list[ClickHouseSink]) -> None:
    """A flush timeout too large for the platform's wait (set past the settings'
    bounds) -> the writer's OverflowError is the sticky failure at once, no hang."""
    sink = ClickHouseSink(embedded(tmp_path / "s", flush_timeout_us=10**22, insert_rows=100))
    sinks.append(sink)
    sink.put(_batch())  # one record of a 100-record insert: the writer waits, and fails
    deadline = time.monotonic() + WITHIN_S
    while sink.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(sink.failure, StoreError)
    assert isinstance(sink.failure.__cause__, OverflowError)
    assert within(sink.flush) is sink.failure


def test_bad_input_a_request_id_with_a_lone_surrogate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A request id holding a lone surrogate (SGLang's HTTP API can deliver one) -> stored
    under an injective escaped id where it enters, listed and read back by its original
    id, and reachable from the command line by the escaped form `ls` prints."""
    from types import SimpleNamespace

    from dmi_sglang.app import cli
    from dmi_sglang.app.session import RequestTracker
    from dmi_sglang.domain.records import original_request_id

    rid = "req-\ud800-x"
    stored = storable_request_id(rid)
    assert stored != rid
    assert original_request_id(stored) == rid
    assert storable_request_id(stored) != stored  # the escaped form cannot collide
    assert storable_request_id("plain-id") == "plain-id"
    tracker = RequestTracker()  # where SGLang's Req objects enter the capture session
    tracker.add_reqs([SimpleNamespace(rid=rid, origin_input_ids=[1, 2], output_ids=[3],
                                      finished=lambda: True)])
    assert [m.request_id for m in tracker.manifests("run", committed=True)] == [stored]
    config = embedded(tmp_path / "s")
    sink = ClickHouseSink(config)
    run = run_info()
    sink.start_run(run)
    sink.put(_batch(request=stored, start=0, end=2))
    commit(sink, run, {stored: 2})
    sink.close()
    store = open_store(f"chdb://{config.path}")
    assert [r.request_id for r in store.requests("run")] == [rid]
    assert store.handle("run", rid).missing == ()
    assert store.handle("run", rid).get("resid_pre", 0).shape == (2, 2)
    db = ["--db", f"chdb://{config.path}"]
    capsys.readouterr()
    assert cli.main(["ls", "run", *db]) == 0
    listing = capsys.readouterr().out
    assert "req-\\ud800-x" in listing
    assert listing.rstrip().endswith("yes")
    assert cli.main(["show", "run", "req-\\ud800-x", *db]) == 0


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def test_fault_the_disk_fills_during_an_insert(tmp_path: Path) -> None:
    """ENOSPC from an insert -> not retried; the sticky failure names the store and its
    free space; the run is recorded failed; nothing reads back as complete."""
    config = embedded(tmp_path / "s")
    made: list[_FailingInserter] = []

    def factory(c: StoreConfig) -> Any:
        made.append(_FailingInserter(open_inserter(c), _enospc()))
        return made[-1]

    sink = ClickHouseSink(config, inserter_factory=factory, retries=5, backoff_s=0.001)
    run = run_info()
    sink.start_run(run)
    sink.put(_batch())
    failure = within(sink.flush)
    assert isinstance(failure, StoreError)
    assert f"the disk of the capture store chdb://{config.path} is full" in str(failure)
    assert "MiB free on" in str(failure)
    assert sum(c.inserts for c in made) == 1  # a full disk is not retried
    with pytest.raises(StoreError):
        commit(sink, run, {"r": 2})
    with pytest.raises(StoreError):
        sink.close()
    store = open_store(f"chdb://{config.path}")
    stored = store.run("run")
    assert stored is not None
    assert stored.status.value == "failed"
    assert not store.handle("run", "r").available


def test_fault_the_disk_is_full_when_the_tables_are_created(tmp_path: Path) -> None:
    """ENOSPC while creating the tables -> the sink does not open; one error naming the
    store and its free space."""
    config = embedded(tmp_path / "s")
    with pytest.raises(StoreError, match=r"is full \(.* MiB free on"):
        ClickHouseSink(config,
                       client_factory=lambda c: _FailingClient(connect(c), _enospc()))


def test_fault_a_server_that_accepts_and_never_answers() -> None:
    """A ClickHouse server address that accepts TCP and never replies (DMX_CH_TIMEOUT_S=1)
    -> opening the sink and reading fail with a StoreError within the timeout (a few
    seconds), not after 300 s."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        config = StoreConfig(kind=StoreKind.SERVER, host="127.0.0.1",
                             port=listener.getsockname()[1], timeout_s=1)
        started = time.monotonic()
        failure = within(lambda: ClickHouseSink(config), 30)
        assert isinstance(failure, StoreError), failure
        assert time.monotonic() - started < 15
        started = time.monotonic()
        failure = within(lambda: ClickHouseReader(config).runs(), 30)
        assert failure is not None
        assert time.monotonic() - started < 15
    finally:
        stop.set()
        acceptor.join(5)
        for s in held:
            s.close()
        listener.close()
