"""The records table matches DMI's ``offload`` table; other layouts are refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import clickhouse_connect
import pytest
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink, StoreTables
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError

from ._support import RESID, batch_of, run_info

# DMI's DDL of the `offload` table, as DMI's native client creates it (clickhouse_client.cpp,
# RunSchemaInitOnce); the layout every store here must keep.
DMI_DDL = """CREATE TABLE IF NOT EXISTS `default`.`offload` (
  `model_id` String, `request_id` String, `act_name` String,
  `layer_no` Int32, `shard_rank` Int32, `start_token_idx` Int32, `end_token_idx` Int32,
  `dtype` String, `shape` Array(Int64), `bytes` String
) ENGINE = MergeTree
PRIMARY KEY (model_id, request_id, act_name, layer_no, shard_rank, start_token_idx, end_token_idx)
ORDER BY    (model_id, request_id, act_name, layer_no, shard_rank, start_token_idx, end_token_idx)
SETTINGS index_granularity = 8192"""



def _client(store: StoreConfig) -> clickhouse_connect.driver.Client:
    return clickhouse_connect.get_client(interface="chdb", path=store.path)


def _describe(client: clickhouse_connect.driver.Client, table: str) -> tuple[object, ...]:
    cols = client.query(
        "SELECT name, type, default_kind FROM system.columns "
        "WHERE database = 'default' AND table = {t:String} ORDER BY position",
        parameters={"t": table},
    ).result_rows
    meta = client.query(
        "SELECT engine, sorting_key, primary_key, engine_full FROM system.tables "
        "WHERE database = 'default' AND name = {t:String}",
        parameters={"t": table},
    ).result_rows[0]
    engine_full = re.sub(r"\s+", " ", str(meta[3]))
    return (tuple(cols), meta[0], meta[1], meta[2], engine_full)


def test_records_table_is_dmis_offload_plus_seq(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    open_sink().close()
    client = _client(store)
    try:
        client.command(DMI_DDL.replace("`offload`", "`dmi_offload`"))
        ours, dmi = _describe(client, "offload"), _describe(client, "dmi_offload")
    finally:
        client.close()
    our_cols, dmi_cols = ours[0], dmi[0]
    assert isinstance(our_cols, tuple)
    assert our_cols[:10] == dmi_cols
    assert our_cols[10:] == (("seq", "UInt64", "DEFAULT"),)
    assert ours[1:4] == dmi[1:4]  # engine, ORDER BY, PRIMARY KEY: identical
    dedup = ", non_replicated_deduplication_window = 1000"  # a retried insert lands once
    assert dedup in str(ours[4])
    assert str(ours[4]).replace(dedup, "") == dmi[4]  # DMI's settings otherwise


def test_rows_use_dmis_dtype_shape_and_raw_bytes_encoding(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    t = torch.randn(3, 4).to(torch.bfloat16)
    sink.start_run(run_info("run", [(RESID, 0)]))
    sink.put(batch_of("run", "r", RESID, 0, t, [0, 3]))
    sink.close()
    client = _client(store)
    try:
        row = client.query(
            "SELECT dtype, shape, bytes, layer_no, shard_rank FROM default.offload",
            column_formats={"bytes": "bytes"},
        ).result_rows[0]
    finally:
        client.close()
    assert row[0] == "torch.bfloat16"
    assert list(row[1]) == [3, 4]
    assert row[2] == t.view(torch.uint8).numpy().tobytes()
    assert row[3:] == (0, 0)


def test_a_dmi_table_without_seq_is_refused_not_altered(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    client = _client(store)
    client.command(DMI_DDL)
    client.close()
    with pytest.raises(StoreError, match=r"default\.offload .*missing column seq UInt64"):
        open_sink()
    client = _client(store)
    try:
        names = [r[0] for r in client.query("DESCRIBE TABLE default.offload").result_rows]
    finally:
        client.close()
    assert "seq" not in names


def test_other_differences_are_named(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    tables = StoreTables.named("default", "offload")
    client = _client(store)
    client.command(
        tables.runs.create_sql.replace("`status` String", "`status` Int32").replace(
            "ORDER BY (run_id)", "ORDER BY (run_id, started_at)"
        )
    )
    client.close()
    with pytest.raises(StoreError) as info:
        open_sink()
    text = str(info.value)
    assert "default.offload_runs" in text
    assert "column status is Int32, expected String" in text
    assert "ORDER BY is (run_id, started_at), expected (run_id)" in text


def test_tables_are_created_beside_the_configured_table(tmp_path: Path) -> None:
    from ._support import embedded

    store = embedded(str(tmp_path / "s"), database="captures", table="acts")
    ClickHouseSink(store).close()
    client = _client(store)
    try:
        names = {r[0] for r in client.query("SHOW TABLES FROM captures").result_rows}
    finally:
        client.close()
    assert names == {"acts", "acts_runs", "acts_manifest"}
    assert ClickHouseReader(store).runs() == []
