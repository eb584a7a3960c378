"""Table definitions of the capture store and the check of existing tables.

Three tables live in one database:

* ``<table>`` (``offload`` by default): DMI's ``offload`` table, column for column, key
  for key (dmi-core.md §4.1), plus one trailing column ``seq UInt64 DEFAULT 0``: the
  capture step that wrote the row, used by readers to drop rows superseded after a
  retraction (see docs/storage.md). The default keeps the table writable by DMI's own
  writer, which names its ten columns.
* ``<table>_runs``: one row per run state change (``ReplacingMergeTree(version)``).
* ``<table>_manifest``: one row per request manifest write (same engine).

Readers of the two small tables take the row with the highest ``version`` per key
(``LIMIT 1 BY``), so they never depend on background merges or ``FINAL``.

Existing tables are checked, never altered: a layout that differs raises a
:class:`~dmi_sglang.errors.StoreError` naming the table and the difference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from dmi_sglang.errors import StoreError

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

__all__ = ["OFFLOAD_COLUMNS", "Layout", "StoreTables", "quote"]

OFFLOAD_KEY = (
    "model_id",
    "request_id",
    "act_name",
    "layer_no",
    "shard_rank",
    "start_token_idx",
    "end_token_idx",
)
"""DMI's primary key and sorting key, in order."""

OFFLOAD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("model_id", "String"),
    ("request_id", "String"),
    ("act_name", "String"),
    ("layer_no", "Int32"),
    ("shard_rank", "Int32"),
    ("start_token_idx", "Int32"),
    ("end_token_idx", "Int32"),
    ("dtype", "String"),
    ("shape", "Array(Int64)"),
    ("bytes", "String"),
    ("seq", "UInt64"),
)
"""The records table: DMI's ten columns, then ``seq`` (ours)."""

RUNS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("run_id", "String"),
    ("model_path", "String"),
    ("settings", "Array(Tuple(String, String))"),
    ("captures", "Array(Tuple(String, Int32))"),
    ("started_at", "String"),
    ("stopped_at", "String"),
    ("status", "String"),
    ("error", "String"),
    ("version", "UInt64"),
)

MANIFEST_COLUMNS: tuple[tuple[str, str], ...] = (
    ("model_id", "String"),
    ("request_id", "String"),
    ("prompt_tokens", "Int64"),
    ("completion_tokens", "Int64"),
    ("computed_from", "Int64"),
    ("overlap_extra_forward", "UInt8"),
    ("committed", "UInt8"),
    ("version", "UInt64"),
)


@attrs.frozen
class Layout:
    """What a table must look like: columns in order, engine and sorting key."""

    name: str
    columns: tuple[tuple[str, str], ...]
    engine: str
    sorting_key: tuple[str, ...]
    primary_key: tuple[str, ...]
    create_sql: str


def quote(name: str) -> str:
    """A ClickHouse identifier, back-quoted."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def _offload(db: str, table: str) -> Layout:
    key = ", ".join(OFFLOAD_KEY)
    # DMI's DDL text (dmi-core.md §4.1) with `seq` appended; keep the two in step. The
    # deduplication window makes an insert retried with its token (an answer lost after
    # the rows landed, an insert failed after some of its parts) store its rows once.
    sql = (
        f"CREATE TABLE IF NOT EXISTS {quote(db)}.{quote(table)} (\n"
        "  `model_id` String, `request_id` String, `act_name` String,\n"
        "  `layer_no` Int32, `shard_rank` Int32, `start_token_idx` Int32, `end_token_idx` Int32,\n"
        "  `dtype` String, `shape` Array(Int64), `bytes` String, `seq` UInt64 DEFAULT 0\n"
        ") ENGINE = MergeTree\n"
        f"PRIMARY KEY ({key})\n"
        f"ORDER BY    ({key})\n"
        "SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000"
    )
    return Layout(table, OFFLOAD_COLUMNS, "MergeTree", OFFLOAD_KEY, OFFLOAD_KEY, sql)


def _replacing(
    db: str, table: str, columns: tuple[tuple[str, str], ...], key: tuple[str, ...]
) -> Layout:
    cols = ",\n".join(f"  {quote(n)} {t}" for n, t in columns)
    sql = (
        f"CREATE TABLE IF NOT EXISTS {quote(db)}.{quote(table)} (\n{cols}\n"
        f") ENGINE = ReplacingMergeTree(version)\nORDER BY ({', '.join(key)})"
    )
    return Layout(table, columns, "ReplacingMergeTree", key, key, sql)


@attrs.frozen
class StoreTables:
    """The three tables of one store, fully qualified.

    Attributes:
        database: the database holding them.
        offload: the records table (DMI's layout plus ``seq``).
        runs / manifest: the run and request-manifest tables beside it.
    """

    database: str
    offload: Layout
    runs: Layout
    manifest: Layout

    @classmethod
    def named(cls, database: str, table: str) -> StoreTables:
        """The tables for ``database`` and records table ``table``."""
        return cls(
            database=database,
            offload=_offload(database, table),
            runs=_replacing(database, f"{table}_runs", RUNS_COLUMNS, ("run_id",)),
            manifest=_replacing(
                database, f"{table}_manifest", MANIFEST_COLUMNS, ("model_id", "request_id")
            ),
        )

    def qualified(self, layout: Layout) -> str:
        """``db.table`` with identifiers quoted."""
        return f"{quote(self.database)}.{quote(layout.name)}"

    @property
    def all(self) -> tuple[Layout, Layout, Layout]:
        """The three layouts, records table first."""
        return (self.offload, self.runs, self.manifest)

    def ensure(self, client: Client) -> None:
        """Create missing tables (and the database); check the existing ones.

        Raises:
            StoreError: a table exists with another layout; names the table and the
                difference. Nothing is altered.
        """
        client.command(f"CREATE DATABASE IF NOT EXISTS {quote(self.database)}")
        for layout in self.all:
            self.check(client, layout, create=True)

    def check(self, client: Client, layout: Layout, *, create: bool = False) -> bool:
        """Compare an existing table with ``layout``; returns False when it is absent.

        With ``create``, an absent table is created (and True returned).

        Raises:
            StoreError: the table's columns, engine or keys differ from ``layout``.
        """
        found = client.query(
            "SELECT engine, sorting_key, primary_key FROM system.tables "
            "WHERE database = {db:String} AND name = {t:String}",
            parameters={"db": self.database, "t": layout.name},
        ).result_rows
        if not found:
            if not create:
                return False
            client.command(layout.create_sql)
            return True
        engine, sorting_key, primary_key = found[0]
        cols = client.query(
            "SELECT name, type FROM system.columns WHERE database = {db:String} "
            "AND table = {t:String} ORDER BY position",
            parameters={"db": self.database, "t": layout.name},
        ).result_rows
        problems = _differences(
            layout,
            columns=tuple((str(n), str(t)) for n, t in cols),
            engine=str(engine),
            sorting_key=_split_key(str(sorting_key)),
            primary_key=_split_key(str(primary_key)),
        )
        if problems:
            msg = (
                f"table {self.database}.{layout.name} exists with an incompatible layout "
                f"(it is never altered; use another database or table name): "
                + "; ".join(problems)
            )
            raise StoreError(msg)
        return True


def _split_key(text: str) -> tuple[str, ...]:
    text = text.strip()
    if text.startswith("(") and text.endswith(")") and "," not in text:
        text = text[1:-1]  # a one-column key may be reported as "(col)"
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _differences(
    layout: Layout,
    *,
    columns: tuple[tuple[str, str], ...],
    engine: str,
    sorting_key: tuple[str, ...],
    primary_key: tuple[str, ...],
) -> list[str]:
    problems: list[str] = []
    found = dict(columns)
    for name, typ in layout.columns:
        if name not in found:
            problems.append(f"missing column {name} {typ}")
        elif found[name] != typ:
            problems.append(f"column {name} is {found[name]}, expected {typ}")
    expected_names = [n for n, _ in layout.columns]
    extra = [n for n, _ in columns if n not in expected_names]
    if extra:
        problems.append(f"unexpected columns {', '.join(extra)}")
    order = [n for n, _ in columns if n in expected_names]
    if not problems and order != expected_names:
        problems.append(
            f"columns in order {', '.join(order)}, expected {', '.join(expected_names)}"
        )
    if engine != layout.engine:
        problems.append(f"engine is {engine}, expected {layout.engine}")
    if sorting_key != layout.sorting_key:
        problems.append(
            f"ORDER BY is ({', '.join(sorting_key)}), expected ({', '.join(layout.sorting_key)})"
        )
    if primary_key != layout.primary_key:
        problems.append(
            f"PRIMARY KEY is ({', '.join(primary_key)}), "
            f"expected ({', '.join(layout.primary_key)})"
        )
    return problems
