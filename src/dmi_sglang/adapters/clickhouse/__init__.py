"""Storage adapter: record sink and reader on clickhouse-connect (embedded chdb or server).

Importing this package is cheap: clickhouse_connect and torch are imported inside the
functions that need them.

* :class:`ClickHouseSink` / :class:`NullSink` / :func:`open_sink`: the
  :class:`~dmi_sglang.domain.ports.RecordSink` implementations.
* :class:`ClickHouseReader`: the :class:`~dmi_sglang.domain.ports.RecordReader`.
* :class:`CaptureHandle`: a lazy per-request view returning torch tensors.
* :class:`StoreTables`: the DDL of the three tables (records, runs, manifests).

See docs/storage.md for the tables, the dedupe rule and measured ingest rates.
"""

from __future__ import annotations

from dmi_sglang.adapters.clickhouse._client import ClientFactory, connect
from dmi_sglang.adapters.clickhouse._handle import CaptureHandle
from dmi_sglang.adapters.clickhouse._reader import ClickHouseReader
from dmi_sglang.adapters.clickhouse._schema import StoreTables
from dmi_sglang.adapters.clickhouse._sink import ClickHouseSink, open_sink
from dmi_sglang.adapters.clickhouse._stats import NullSink, SinkStats

__all__ = [
    "CaptureHandle",
    "ClickHouseReader",
    "ClickHouseSink",
    "ClientFactory",
    "NullSink",
    "SinkStats",
    "StoreTables",
    "connect",
    "open_sink",
]
