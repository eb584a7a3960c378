"""Record batches from the store's Arrow answers: whatever shape the answer takes
(several chunks, a slice, text as binary), the batches hold the records' bytes; a
damaged record is named, not read."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dmi_sglang.adapters.clickhouse._batches import batches_from_arrow
from dmi_sglang.errors import StoreError

RESID = "blocks.hook_resid_pre"


def answer(rows: list[tuple[int, str, int, str, str, int, int, int, bytes]],
           *, binary: bool = False) -> pa.Table:
    """An answer as the store's query gives it (its columns, from whole records)."""
    text = pa.binary() if binary else pa.string()
    names = ["shard_rank", "act_name", "layer_no", "dtype", "dims", "s", "e", "seq", "cut"]
    columns = list(zip(*rows, strict=True))
    table = pa.table({
        "shard_rank": pa.array(columns[0], pa.int32()),
        "act_name": pa.array([a.encode() if binary else a for a in columns[1]], text),
        "layer_no": pa.array(columns[2], pa.int32()),
        "dtype": pa.array([d.encode() if binary else d for d in columns[3]], text),
        "dims": pa.array([d.encode() if binary else d for d in columns[4]], text),
        "s": pa.array(columns[5], pa.int64()), "e": pa.array(columns[6], pa.int64()),
        "seq": pa.array(columns[7], pa.uint64()),
        "cut": pa.array(list(columns[8]), pa.binary() if binary else pa.string()
                        if all(c.isascii() for c in columns[8]) else pa.binary()),
    })
    assert table.column_names == names
    return table.append_column("total", pa.array([len(c) for c in columns[8]], pa.uint64())) \
        .append_column("lo", table.column("s")).append_column("hi", table.column("e")) \
        .append_column("first", pa.array([e - s for s, e in zip(columns[5], columns[6],
                                                                 strict=True)], pa.int64()))


ROWS = [(0, RESID, 0, "torch.uint8", "[2]", 0, 2, 1, b"abcd"),
        (0, RESID, 0, "torch.uint8", "[2]", 2, 3, 2, b"ef"),
        (0, RESID, 1, "torch.uint8", "[2]", 0, 1, 1, b"gh"),
        (1, RESID, 0, "torch.uint8", "[2]", 0, 3, 1, b"ijklmn")]


def records(batches: list) -> list[tuple[int, str, int, int, int, int, bytes]]:  # type: ignore[type-arg]
    return [(r.shard_rank, r.act_name, r.layer_no, r.start_token_idx, r.end_token_idx, r.seq,
             bytes(r.payload)) for b in batches for r in b.records()]


WANT = [(0, RESID, 0, 0, 2, 1, b"abcd"), (0, RESID, 0, 2, 3, 2, b"ef"),
        (0, RESID, 1, 0, 1, 1, b"gh"), (1, RESID, 0, 0, 3, 1, b"ijklmn")]


@pytest.mark.parametrize("shape", ["whole", "chunks", "slice", "binary"])
def test_any_answer_shape_gives_the_records_bytes(shape: str) -> None:
    table = answer(ROWS, binary=shape == "binary")
    if shape == "chunks":  # the engine answers in several record batches
        table = pa.Table.from_batches([*table.slice(0, 1).to_batches(),
                                       *table.slice(1, 3).to_batches()])
        assert table.column("cut").num_chunks == 2
    if shape == "slice":  # arrays that start partway into their buffers
        table = answer([ROWS[0], *ROWS]).slice(1)
        assert table.column("cut").chunk(0).offset == 1
    batches = batches_from_arrow(table, "run", "r")
    assert [b.shard_rank for b in batches] == [0, 1]
    assert records(batches) == WANT
    assert all(b.request_ids == ("r",) for b in batches)


def test_no_rows_give_no_batches() -> None:
    assert batches_from_arrow(answer(ROWS).slice(0, 0), "run", "r") == []


@pytest.mark.parametrize(("row", "named"), [
    ((0, RESID, 3, "torch.uint8", "[2]", 0, 2, 1, b"abc"),
     "blocks.hook_resid_pre layer 3 [0, 2) of request 'r': 3 payload bytes"),
    ((0, RESID, 3, "torch.uint8", "[3]", 0, 2, 1, b"abcd"),
     "4 payload bytes are not 2 rows of torch.uint8 [3] (3 bytes a row)"),
    ((0, RESID, 3, "torch.nope", "[2]", 0, 2, 1, b"abcd"), "name a dtype or shape not read"),
    ((0, RESID, 3, "torch.uint8", "[x", 0, 2, 1, b"abcd"), "name a dtype or shape not read"),
])
def test_a_damaged_record_is_named_not_read(row: tuple, named: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(StoreError, match=named.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        batches_from_arrow(answer([ROWS[0], row]), "run", "r")


def test_payload_columns_are_views_of_the_answer() -> None:
    table = answer(ROWS)
    (first, _) = batches_from_arrow(table, "run", "r")
    data = table.column("cut").chunk(0).buffers()[2]
    assert np.shares_memory(first.payload, np.frombuffer(data, dtype=np.uint8))


def test_settings_go_only_where_the_account_may_change_them() -> None:
    from types import SimpleNamespace

    from dmi_sglang.adapters.clickhouse._batches import ARROW_SETTINGS, writable_settings

    name = next(iter(ARROW_SETTINGS))
    assert writable_settings(SimpleNamespace(server_settings={
        name: SimpleNamespace(readonly=False)}), ARROW_SETTINGS) == ARROW_SETTINGS
    for known in ({name: SimpleNamespace(readonly=True)}, {}, None):
        assert writable_settings(SimpleNamespace(server_settings=known), ARROW_SETTINGS) == {}
