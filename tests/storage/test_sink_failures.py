"""Batching, retries, sticky failures and backpressure of the sink."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import structlog
import structlog.testing
import torch
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.adapters.clickhouse._insert import open_inserter
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError

from ._support import (
    RESID,
    FaultyInserter,
    batch_of,
    commit,
    embedded,
    handle,
    manifest,
    records_of,
    run_info,
    same_bits,
)


def _faulty(
    plan: Callable[[int], Any],
) -> tuple[Callable[[StoreConfig], Any], list[FaultyInserter]]:
    """An inserter factory whose writers share one fault plan over their insert calls."""
    made: list[FaultyInserter] = []
    calls = [0]
    lock = threading.Lock()

    def shared(_: int) -> Any:
        with lock:
            calls[0] += 1
            return plan(calls[0])

    def factory(config: StoreConfig) -> Any:
        inserter = FaultyInserter(open_inserter(config), shared)
        made.append(inserter)
        return inserter

    return factory, made


def _decode_rows(n: int, width: int = 64) -> tuple[torch.Tensor, list[int]]:
    return torch.randn(n, width), list(range(n + 1))


def test_inserts_join_whole_batches_up_to_insert_rows_and_partial_ones_linger_out(
    open_sink: Callable[..., ClickHouseSink], tmp_path: Any
) -> None:
    config = embedded(str(tmp_path / "s"), insert_rows=10, flush_timeout_us=200_000)
    sink = open_sink(config, writers=1)
    t, bounds = _decode_rows(20)
    for k in range(5):  # 5 batches of 4 records: inserts of 4 + 4, 4 + 4, then 4
        sink.put(batch_of("run", "r", RESID, 0, t[4 * k:4 * k + 4], bounds[4 * k:4 * k + 5],
                          base=4 * k))
    sink.flush()
    stats = sink.stats()
    assert (stats.inserts, stats.batches_stored, stats.records_stored) == (3, 5, 20)
    sink.put(batch_of("run", "r2", RESID, 0, t[:3], [0, 1, 2, 3]))
    deadline = time.monotonic() + 5
    while sink.stats().records_stored < 23 and time.monotonic() < deadline:
        time.sleep(0.01)  # no flush: the partial insert goes after flush_timeout_us
    assert (sink.stats().records_stored, sink.stats().inserts) == (23, 4)
    big, big_bounds = _decode_rows(35)  # one batch above insert_rows: inserted whole
    sink.put(batch_of("run", "r3", RESID, 0, big, big_bounds))
    sink.flush()
    assert (sink.stats().records_stored, sink.stats().inserts) == (58, 5)
    assert len(ClickHouseReader(config).records("run", "r3")) == 35


@pytest.mark.parametrize(("env", "at_least"), [
    ({"queue_mb": 2}, 8),  # an eighth of 2 MiB: 256 KiB an insert
    ({"queue_mb": 64, "insert_mb": 1}, 2),  # as set (an eighth of the queue is 8 MiB)
])
def test_an_insert_holds_at_most_its_share_of_the_queue(
    open_sink: Callable[..., ClickHouseSink], tmp_path: Any, env: dict[str, int],
    at_least: int,
) -> None:
    config = embedded(str(tmp_path / "s"), writers=4, **env)
    sink = open_sink(config)
    rows = torch.randn(8, 200 * 256)  # 8 one-row records of 200 KiB (float32)
    for k in range(8):
        sink.put(batch_of("run", "r", RESID, 0, rows[k:k + 1], [k, k + 1], base=k))
    sink.flush()
    stats = sink.stats()
    assert stats.records_stored == 8
    assert stats.inserts >= at_least  # one 200 KiB record fits 256 KiB, five fit 1 MiB


def test_transient_errors_are_retried(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    factory, _ = _faulty(lambda n: OperationalError("connection reset") if n <= 2 else None)
    sink = open_sink(inserter_factory=factory, retries=3, backoff_s=0.001)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    t, bounds = _decode_rows(5)
    sink.put(batch_of("run", "r", RESID, 0, t, bounds))
    commit(sink, run, [manifest("run", "r", 5, 1)])
    assert sink.stats().retries == 2
    assert same_bits(handle(store, "run", "r").get("resid_pre", 0), t)


class _LandsThenTimesOut:
    """The first insert reaches the store, then its answer is lost (a read timeout)."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.calls = inner, 0

    def insert_arrow(self, table: str, arrow_table: Any, token: str = "") -> Any:
        self.calls += 1
        out = self._inner.insert_arrow(table, arrow_table, token=token)
        if self.calls == 1:
            raise OperationalError("HTTPConnectionPool: Read timed out. (read timeout=30)")
        return out

    def close(self) -> None:
        self._inner.close()


def test_a_retried_insert_whose_first_try_landed_stores_its_rows_once(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    """A retry of an insert that had landed stored every row twice (the run committed,
    the store held 10 records where the stats said 5): the insert's token makes the
    repeat store nothing."""
    sink = open_sink(inserter_factory=lambda c: _LandsThenTimesOut(open_inserter(c)),
                     writers=1, retries=3, backoff_s=0.001)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    t, bounds = _decode_rows(5)
    sink.put(batch_of("run", "r", RESID, 0, t, bounds))
    commit(sink, run, [manifest("run", "r", 5, 1)])
    assert sink.stats().retries == 1
    assert sink.stats().records_stored == 5
    sink.close()
    reader = ClickHouseReader(store)
    assert len(reader.records("run", "r")) == 5
    assert [s.records for s in reader.requests("run")] == [5]
    assert same_bits(handle(store, "run", "r").get("resid_pre", 0), t)


def test_a_store_failing_mid_run_fails_sticky_and_nothing_is_reported_complete(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    factory, _ = _faulty(lambda n: None if n == 1 else OperationalError("disk gone"))
    config = attrs.evolve(store, insert_rows=4)
    sink = open_sink(config, inserter_factory=factory, retries=2, backoff_s=0.001, writers=1)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    t, bounds = _decode_rows(12)
    sink.put(batch_of("run", "r", RESID, 0, t[:4], bounds[:5]))
    sink.flush()  # the first batch made it
    sink.put(batch_of("run", "r", RESID, 0, t[4:8], bounds[4:9], base=4))
    sink.put(batch_of("run", "r", RESID, 0, t[8:], bounds[8:], base=8))
    expected = r"after 3 attempt\(s\): OperationalError: disk gone"
    with pytest.raises(StoreError, match=expected) as info:
        sink.flush()
    assert isinstance(info.value.__cause__, OperationalError)
    assert sink.stats().retries == 2
    for action in (
        lambda: sink.put(batch_of("run", "r", RESID, 0, t[:1], [0, 1])),
        sink.flush,
        lambda: commit(sink, run, [manifest("run", "r", 12, 1)]),
        sink.close,
    ):
        with pytest.raises(StoreError) as again:
            action()
        assert again.value is info.value  # the same sticky failure, with its cause
    h = handle(store, "run", "r")  # the store was released by close()
    assert not h.available
    assert h.missing[0].startswith("run 'run' is failed, not committed: inserting 4 records")
    assert len(ClickHouseReader(store).records("run", "r")) == 4


def test_a_non_transient_error_is_not_retried(open_sink: Callable[..., ClickHouseSink]) -> None:
    error = DatabaseError("Code: 60. Unknown table", code=60)
    factory, _ = _faulty(lambda n: error)
    sink = open_sink(inserter_factory=factory, retries=5, backoff_s=0.001)
    t, bounds = _decode_rows(2)
    sink.put(batch_of("run", "r", RESID, 0, t, bounds))
    with pytest.raises(StoreError, match="after 1 attempt") as info:
        sink.flush()
    assert info.value.__cause__ is error
    assert sink.stats().retries == 0


def test_backpressure_blocks_put_and_drops_nothing(
    open_sink: Callable[..., ClickHouseSink], tmp_path: Any
) -> None:
    config = embedded(str(tmp_path / "s"), queue_mb=1, insert_rows=2)
    factory, _ = _faulty(lambda n: 0.05)  # a slow store: every insert takes 50 ms more
    sink = open_sink(config, inserter_factory=factory)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    rows = 24
    t = torch.randn(rows, 64 * 1024)  # 256 KiB rows: the queue holds about four
    most_queued, blocked = 0, 0.0
    for k, rec in enumerate(records_of("run", "r", RESID, 0, t, list(range(rows + 1)))):
        started = time.monotonic()
        sink.put(RecordBatch.from_records([rec]))
        blocked += time.monotonic() - started
        most_queued = max(most_queued, sink.stats().queued_bytes)
        assert (sink.stats().records_put, sink.stats().batches_put) == (k + 1, k + 1)
    assert most_queued <= 1 << 20
    assert blocked > 0.2  # 12 inserts of 50 ms could not keep up: put waited
    commit(sink, run, [manifest("run", "r", rows, 1)])
    stats = sink.stats()
    assert (stats.records_stored, stats.bytes_stored) == (rows, t.numel() * 4)
    assert same_bits(handle(config, "run", "r").get("resid_pre", 0), t)


def test_several_writer_threads_share_the_embedded_store(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    with structlog.testing.capture_logs() as logs:
        sink = open_sink(attrs.evolve(store, insert_rows=3, writers=3))  # DMX_CH_WRITERS
        run = run_info("run", [(RESID, 0)])
        sink.start_run(run)
        t, bounds = _decode_rows(40)
        for rec in records_of("run", "r", RESID, 0, t, bounds):
            sink.put(RecordBatch.from_records([rec]))
        commit(sink, run, [manifest("run", "r", 40, 1)])
        sink.close()
    assert [e["writers"] for e in logs if e["event"] in ("store.opened", "store.closed")] == [3, 3]
    assert sink.stats().records_stored == 40
    assert same_bits(handle(store, "run", "r").get("resid_pre", 0), t)


def test_close_is_idempotent_and_put_after_close_is_refused(
    open_sink: Callable[..., ClickHouseSink],
) -> None:
    sink = open_sink()
    t, bounds = _decode_rows(3)
    sink.put(batch_of("run", "r", RESID, 0, t, bounds))
    sink.close()
    assert sink.stats().records_stored == 3  # close drained the queue
    sink.close()
    with pytest.raises(StoreError, match="closed"):
        sink.put(batch_of("run", "r", RESID, 0, t, bounds))
