"""Storage adapter: record sink and reader on clickhouse-connect (embedded chdb or server).

Importing this package is cheap: clickhouse_connect is imported inside the functions that
need it.

* :class:`ClickHouseSink`: the :class:`~dmi_sglang.columns.RecordSink`.
* :class:`ClickHouseReader`: the :class:`~dmi_sglang.domain.ports.RecordReader`.
* :class:`ClickHouseRunClaims`: the :class:`~dmi_sglang.domain.ports.RunClaims`.
* :class:`StoreTables`: the DDL of the three tables (records, runs, manifests).

See docs/storage.md for the tables, the dedupe rule and measured ingest rates.
"""

from __future__ import annotations

from dmi_sglang.adapters.clickhouse._claims import ClickHouseRunClaims
from dmi_sglang.adapters.clickhouse._client import ClientFactory, connect
from dmi_sglang.adapters.clickhouse._reader import ClickHouseReader
from dmi_sglang.adapters.clickhouse._schema import StoreTables
from dmi_sglang.adapters.clickhouse._sink import ClickHouseSink
from dmi_sglang.adapters.clickhouse._stats import SinkStats

__all__ = [
    "ClickHouseReader",
    "ClickHouseRunClaims",
    "ClickHouseSink",
    "ClientFactory",
    "SinkStats",
    "StoreTables",
    "connect",
]
