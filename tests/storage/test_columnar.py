"""The columnar insert path: record batches -> one Arrow table -> the records table, and
back through the reader, without copying the payloads."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.adapters.clickhouse._arrow import COLUMN_NAMES, arrow_batch, arrow_table
from dmi_sglang.adapters.clickhouse._schema import OFFLOAD_COLUMNS
from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.domain.store_config import StoreConfig

from ._support import RESID

KEYS = (
    CaptureKey(RESID, 0, "torch.bfloat16", (4,)),
    CaptureKey("blocks.attn.hook_q", 3, "torch.float32", (2, 3)),
    CaptureKey("token_ids", -1, "torch.int64", ()),
)


def _records(run: str, seed: int, *, shard: int = 0) -> list[CaptureRecord]:
    """Records of two requests and three captures, random bytes, rising ``seq``."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(12):
        key = KEYS[k % 3]
        start = 5 * k
        rows = 1 + k % 4
        nbytes = rows * key.row_nbytes
        out.append(CaptureRecord(run, f"req-{k % 2}", key.act_name, key.layer_no, shard,
                                 start, start + rows, key.dtype, (rows, *key.dims),
                                 rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes(),
                                 100 + k))
    return out


def _fields(r: CaptureRecord) -> tuple[object, ...]:
    return (r.model_id, r.request_id, r.act_name, r.layer_no, r.shard_rank, r.start_token_idx,
            r.end_token_idx, r.dtype, tuple(r.shape), bytes(r.payload), r.seq)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 12), max_bytes=st.integers(1, 200))
def test_a_batch_splits_into_whole_records_of_at_most_max_bytes(
        seed: int, count: int, max_bytes: int) -> None:
    """Every record once, in order, each piece within ``max_bytes`` unless it is one
    record, over the same payload memory (nothing copied)."""
    batch = RecordBatch.from_records(_records("run", seed)[:count])
    pieces = batch.split(max_bytes)
    assert [_fields(r) for p in pieces for r in p.records()] == [
        _fields(r) for r in batch.records()]
    for p in pieces:
        assert len(p) >= 1
        assert p.nbytes <= max_bytes or len(p) == 1
        assert p.payload is batch.payload
    for a, b in itertools.pairwise(pieces):  # none could take the next record too
        assert a.nbytes + int(b.offsets[1] - b.offsets[0]) > max_bytes
    assert batch.split(batch.nbytes) == [batch]


def test_a_batch_is_split_only_by_a_positive_size() -> None:
    batch = RecordBatch.from_records(_records("run", 1))
    with pytest.raises(ValueError, match=r"^RecordBatch.split: max_bytes=0; expected at "
                                         r"least 1$"):
        batch.split(0)


def test_the_arrow_table_holds_the_records_in_the_tables_layout() -> None:
    records = _records("run", 1, shard=1)
    table = arrow_table([RecordBatch.from_records(records[:5]),
                         RecordBatch.from_records(records[5:])])
    assert table.column_names == [name for name, _ in OFFLOAD_COLUMNS] == list(COLUMN_NAMES)
    assert table.num_rows == 12
    assert [c.num_chunks for c in table.columns] == [2] * len(COLUMN_NAMES)  # one per batch
    rows = [{**row, "shape": tuple(row["shape"])} for row in table.to_pylist()]
    assert [tuple(row.values()) for row in rows] == [_fields(r) for r in records]


def test_a_batch_with_a_negative_seq_is_refused() -> None:
    bad = RecordBatch.from_records(_records("run", 2)[:2])
    bad.seq[1] = -1
    with pytest.raises(OverflowError, match="negative seq -1"):
        arrow_batch(bad)


def test_records_put_as_batches_read_back_equal(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink(writers=1)
    records = _records("run", 3)
    time.sleep(0.05)  # the writer waits for the first put: not counted as idle
    for part in (records[:4], records[4:9], records[9:]):  # one insert of three batches
        sink.put(RecordBatch.from_records(part))
    sink.flush()
    stats = sink.stats()
    assert (stats.inserts, stats.batches_stored, stats.records_stored) == (1, 3, 12)
    assert stats.bytes_stored == sum(len(r.payload) for r in records)
    assert stats.cpu_s_per_gb is not None
    assert stats.cpu_s_per_gb > 0
    assert stats.writer_idle_empty_seconds < 0.05  # only since the first put
    assert stats.put_wait_seconds == 0  # the queue never filled
    sink.close()
    reader = ClickHouseReader(store)
    stored = reader.records("run", "req-0") + reader.records("run", "req-1")
    assert sorted(map(_fields, stored), key=str) == sorted(map(_fields, records), key=str)


def test_a_view_into_a_larger_buffer_is_inserted_without_copying_its_payload(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    rng = np.random.default_rng(4)
    big = rng.integers(0, 256, 4096, dtype=np.uint8)  # e.g. a pooled slab
    key = CaptureKey(RESID, 0, "torch.float32", (2,))  # 8 bytes a row
    offsets = np.array([1000, 1008, 1024, 1048], dtype=np.int64)  # 1, 2, 3 rows
    start = np.array([0, 1, 3], dtype=np.int32)
    end = np.array([1, 3, 6], dtype=np.int32)
    batch = RecordBatch("run", ("r",), (key,), np.zeros(3), np.zeros(3), start, end,
                        np.arange(1, 4), offsets, big[:2000])
    column = arrow_batch(batch).column(COLUMN_NAMES.index("bytes"))
    _, arrow_offsets, data = column.buffers()
    assert data.address == big.ctypes.data + 1000  # the payload memory itself
    assert np.frombuffer(arrow_offsets, dtype=np.int64).tolist() == [0, 8, 24, 48]
    assert column.to_pylist() == [big[a:b].tobytes() for a, b in itertools.pairwise(offsets)]
    sink = open_sink()
    sink.put(batch)
    sink.close()
    stored = ClickHouseReader(store).records("run", "r")
    assert [(r.start_token_idx, r.shape, bytes(r.payload)) for r in stored] == [
        (0, (1, 2), big[1000:1008].tobytes()),
        (1, (2, 2), big[1008:1024].tobytes()),
        (3, (3, 2), big[1024:1048].tobytes()),
    ]


def test_an_empty_batch_is_accepted_and_stores_nothing(
    open_sink: Callable[..., ClickHouseSink],
) -> None:
    sink = open_sink()
    empty = RecordBatch("run", (), (), [], [], [], [], [], [0], np.empty(0, dtype=np.uint8))
    sink.put(empty)
    sink.flush()
    stats = sink.stats()
    assert (stats.batches_put, stats.inserts, stats.records_stored) == (0, 0, 0)
