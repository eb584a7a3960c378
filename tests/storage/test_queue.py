"""The sink's queue of record batches on its own: byte bound, whole batches per insert,
flush across out-of-order writers, sticky failure."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dmi_sglang.adapters.clickhouse._queue import RecordQueue, Taken, charge
from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.errors import StoreError

KEY = CaptureKey("blocks.hook_resid_pre", 0, "torch.float32", (256,))  # 1 KiB rows


def _batch(records: int) -> RecordBatch:
    """``records`` one-row records of 1 KiB."""
    start = np.arange(records, dtype=np.int32)
    return RecordBatch("run", ("r",), (KEY,), np.zeros(records), np.zeros(records), start,
                       start + 1, np.arange(records), np.arange(records + 1) * 1024,
                       np.zeros(records * 1024, dtype=np.uint8))


def _in_thread(action: object) -> threading.Thread:
    assert callable(action)
    t = threading.Thread(target=action, daemon=True)
    t.start()
    return t


def test_a_batch_is_charged_its_payload_and_a_row_overhead() -> None:
    assert charge(_batch(3)) == 3 * 1024 + 3 * 128


def test_inserts_take_whole_batches_up_to_the_byte_bound() -> None:
    one = charge(_batch(4))
    q = RecordQueue(max_bytes=100 * one, batch_rows=1000, linger_s=10, batch_bytes=2 * one)
    for _ in range(5):
        q.put(_batch(4))
    taken = [q.take() for _ in range(2)]  # full: no linger
    q.close()
    last = q.take()
    assert [len(t.batches) if t else 0 for t in (*taken, last)] == [2, 2, 1]
    assert [t.first if t else -1 for t in (*taken, last)] == [0, 2, 4]
    assert [t.records if t else 0 for t in (*taken, last)] == [8, 8, 4]
    assert q.take() is None


def test_a_batch_larger_than_the_insert_bound_is_taken_alone_and_whole() -> None:
    q = RecordQueue(max_bytes=1 << 30, batch_rows=10, linger_s=10, batch_bytes=1 << 30)
    q.put(_batch(35))
    q.put(_batch(2))
    first = q.take()
    assert first is not None
    assert (len(first.batches), first.records) == (1, 35)


def test_put_blocks_at_the_byte_bound_until_an_insert_is_done() -> None:
    one = charge(_batch(4))
    q = RecordQueue(max_bytes=2 * one, batch_rows=1000, linger_s=10, batch_bytes=one)
    q.put(_batch(4))
    q.put(_batch(4))
    assert q.queued_bytes == 2 * one
    taken = q.take()
    assert taken is not None
    third = _in_thread(lambda: q.put(_batch(4)))
    third.join(0.2)
    assert third.is_alive()  # taken but not stored: its bytes still count
    q.done(taken)
    third.join(5)
    assert not third.is_alive()
    assert q.queued_bytes == 2 * one


def test_a_batch_larger_than_the_queue_is_admitted_alone() -> None:
    q = RecordQueue(max_bytes=1024, batch_rows=1000, linger_s=10)
    q.put(_batch(8))  # 9 KiB into an empty 1 KiB queue
    assert q.queued_bytes == charge(_batch(8))


def test_flush_waits_for_every_batch_even_when_writers_finish_out_of_order() -> None:
    one = charge(_batch(2))
    q = RecordQueue(max_bytes=100 * one, batch_rows=1000, linger_s=10, batch_bytes=one)
    for _ in range(3):
        q.put(_batch(2))
    first, second = q.take(), q.take()
    assert first is not None
    assert second is not None
    flushed = threading.Event()
    _in_thread(lambda: (q.wait_done(), flushed.set()))
    q.done(second)  # the later insert finishes first
    third = q.take()  # the flush makes the last, partial insert go at once
    assert third is not None
    q.done(third)
    assert not flushed.wait(0.2)  # batch 0 is not stored yet
    q.done(first)
    assert flushed.wait(5)
    assert q.queued_bytes == 0


def test_a_partial_insert_goes_after_the_linger() -> None:
    q = RecordQueue(max_bytes=1 << 30, batch_rows=1000, linger_s=0.05)
    q.put(_batch(1))
    started = time.monotonic()
    taken = q.take()
    assert taken is not None
    assert 0.04 <= time.monotonic() - started < 2


def test_a_failure_is_sticky_and_wakes_everyone() -> None:
    one = charge(_batch(4))
    q = RecordQueue(max_bytes=one, batch_rows=1000, linger_s=10)
    q.put(_batch(4))
    outcomes: list[BaseException | None] = []

    def put() -> None:
        try:
            q.put(_batch(4))
            outcomes.append(None)
        except StoreError as exc:
            outcomes.append(exc)

    blocked = _in_thread(put)
    blocked.join(0.1)
    failure = StoreError("boom")
    q.fail(failure)
    blocked.join(5)
    assert outcomes == [failure]
    with pytest.raises(StoreError) as info:
        q.wait_done()
    assert info.value is failure
    assert q.take() is None
    assert q.queued_bytes == 0


def test_the_queue_times_blocked_puts_and_idle_writers_apart() -> None:
    one = charge(_batch(4))
    q = RecordQueue(max_bytes=2 * one, batch_rows=1000, linger_s=0.1, batch_bytes=2 * one)
    assert q.waits() == (0.0, 0.0, 0.0)
    took: list[Taken | None] = []
    writer = _in_thread(lambda: took.append(q.take()))
    time.sleep(0.1)  # before the first batch: a sink waiting for its capture, not counted
    q.put(_batch(4))  # half an insert: the writer lingers for the rest, then takes it
    writer.join(5)
    put, empty, partial = q.waits()
    assert (put, empty) == (0.0, 0.0)
    assert 0.05 <= partial < 2
    first = took.pop()
    assert first is not None
    q.done(first)
    writer = _in_thread(lambda: took.append(q.take()))  # nothing queued now: counted
    time.sleep(0.1)
    q.put(_batch(4))
    q.put(_batch(4))  # a full insert: taken at once
    writer.join(5)
    assert 0.05 <= q.waits()[1] < 2
    second = took.pop()
    assert second is not None  # in flight: the bound is reached, ...
    blocked = _in_thread(lambda: q.put(_batch(4)))
    time.sleep(0.1)
    assert q.waits()[0] == 0.0  # (counted once the put got its room)
    q.done(second)  # ... so a third put waited until it was stored
    blocked.join(5)
    assert not blocked.is_alive()
    assert 0.05 <= q.waits()[0] < 2
