"""Inserting one Arrow table into the records table: the sink writers' connections.

* Embedded (:class:`ChdbInserter`): each writer holds its own ``chdb.Connection`` on the
  store's directory (the engine admits any number of handles of one process on its path)
  and runs ``INSERT INTO db.table (cols) SELECT cols FROM Python(arrow_table)``. chDB's
  ``Python()`` table function finds ``arrow_table`` among the calling function's locals
  and reads its buffers in memory: no spool file, no serialisation.
* Server (:class:`ServerInserter`): clickhouse-connect's ``insert_arrow`` sends the table
  as Arrow IPC over HTTP, its buffers compressed with lz4 or zstd (the store's
  ``compression``); ``gzip`` compresses the whole IPC body (``Content-Encoding``).

Errors are the libraries' own (``chdb.ChdbError`` with ``Code: NNN`` in its text, or
clickhouse-connect's); the sink classifies them (:mod:`._client`).
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dmi_sglang.adapters.clickhouse._arrow import COLUMN_NAMES
from dmi_sglang.adapters.clickhouse._client import close_quietly, connect, wire_compression
from dmi_sglang.adapters.clickhouse._schema import quote
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

if TYPE_CHECKING:
    import pyarrow as pa
    from clickhouse_connect.driver.client import Client

__all__ = ["ChdbInserter", "Inserter", "InserterFactory", "ServerInserter", "open_inserter"]

_COLUMNS = ", ".join(quote(n) for n in COLUMN_NAMES)


class Inserter(Protocol):
    """One writer's connection: inserts Arrow tables into a table (``db.table``, quoted)."""

    def insert_arrow(self, table: str, arrow_table: pa.Table, token: str = "") -> object:
        """Insert every row of ``arrow_table`` (columns named as the table's); with a
        ``token`` (letters and digits), the same insert made again with it stores
        nothing more (a table with a deduplication window)."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


InserterFactory = Callable[[StoreConfig], Inserter]
"""Opens a writer's connection on a store (the seam tests use to inject faults)."""


def _token(token: str) -> str:
    """An insert's deduplication token, checked to be letters and digits (it is written
    into the query)."""
    if not token.isascii() or not token.isalnum():
        msg = f"insert deduplication token {token!r}: letters and digits only"
        raise ValueError(msg)
    return token


class ChdbInserter:
    """A ``chdb.Connection`` of its own on an embedded store, inserting through
    ``Python()``.

    Args:
        path: the store's directory (already opened by the sink's control client, so
            the engine runs on it in this process).
    """

    def __init__(self, path: str) -> None:
        import chdb

        self._conn = chdb.connect(os.path.realpath(path))

    def insert_arrow(self, table: str, arrow_table: pa.Table,  # noqa: ARG002
                     token: str = "") -> object:
        """Insert ``arrow_table`` (read in place by the engine: ``Python(arrow_table)``
        in the query names this function's parameter, which chDB looks up here)."""
        dedup = (f" SETTINGS insert_deduplicate = 1, insert_deduplication_token = "
                 f"'{_token(token)}'" if token else "")
        sql = (f"INSERT INTO {table} ({_COLUMNS}){dedup} SELECT {_COLUMNS} "
               "FROM Python(arrow_table)")
        return self._conn.query(sql)

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()


class ServerInserter:
    """A clickhouse-connect client inserting Arrow IPC.

    Args:
        client: a client opened with ``compress=method`` (lz4 and zstd then compress
            the IPC buffers; see :func:`~._client.connect`).
        method: the store's wire compression (:func:`~._client.wire_compression`).
    """

    def __init__(self, client: Client, method: str | None) -> None:
        self._client = client
        self._method = method

    def insert_arrow(self, table: str, arrow_table: pa.Table, token: str = "") -> object:
        """Insert ``arrow_table``: ``insert_arrow``, or for gzip the IPC file gzipped."""
        settings = ({"insert_deduplicate": 1, "insert_deduplication_token": _token(token)}
                    if token else None)
        if self._method != "gzip":
            return self._client.insert_arrow(table, arrow_table, settings=settings)
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, arrow_table.schema) as writer:
            writer.write_table(arrow_table)
        body = gzip.compress(sink.getvalue().to_pybytes(), compresslevel=1)
        return self._client.raw_insert(table, list(arrow_table.schema.names), body,
                                       settings=settings, fmt="Arrow", compression="gzip")

    def close(self) -> None:
        """Close the client."""
        close_quietly(self._client)


def open_inserter(config: StoreConfig) -> Inserter:
    """A writer's connection on ``config``'s store.

    Raises:
        StoreError: the store cannot be opened.
    """
    if config.kind is StoreKind.EMBEDDED:
        try:
            return ChdbInserter(config.path)
        except Exception as exc:
            msg = f"cannot open a writer on the capture store {config.path}: {exc}"
            raise StoreError(msg) from exc
    method = wire_compression(config)
    return ServerInserter(connect(config, compress=method), method)
