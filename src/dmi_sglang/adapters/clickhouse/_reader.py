"""Reading captures back: :class:`ClickHouseReader`.

Every call opens the store, queries and closes it (the embedded engine admits one
process at a time, so a reader must not hold it). Group calls in :meth:`session` to
open it once. A store whose tables do not exist yet reads as empty; tables with another
layout raise :class:`~dmi_sglang.errors.StoreError`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from dmi_sglang.adapters.clickhouse._batches import (
    ARROW_SETTINGS,
    BATCHES_SQL,
    batches_from_arrow,
    writable_settings,
)
from dmi_sglang.adapters.clickhouse._client import (
    ClientFactory,
    close_quietly,
    connect,
    store_error,
)
from dmi_sglang.adapters.clickhouse._live import is_live, live_runs
from dmi_sglang.adapters.clickhouse._merges import active_parts
from dmi_sglang.adapters.clickhouse._rows import manifest_from_row, run_from_row
from dmi_sglang.adapters.clickhouse._schema import Layout, StoreTables
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.ports import HookTotal, RequestExtents, RequestSummary
from dmi_sglang.domain.records import (
    STALE_AFTER_S,
    CaptureRecord,
    RequestManifest,
    RunInfo,
    RunStatus,
)
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

if TYPE_CHECKING:
    import pyarrow as pa
    from clickhouse_connect.driver.client import Client

__all__ = ["ClickHouseReader"]

_RECORD_COLUMNS = (
    "model_id, request_id, act_name, layer_no, shard_rank, start_token_idx, "
    "end_token_idx, dtype, shape, bytes, seq"
)


class _Session(threading.local):
    """One thread's open client and what it found of the tables."""

    def __init__(self) -> None:
        self.client: Client | None = None
        self.present: dict[str, bool] = {}


class ClickHouseReader:
    """A :class:`~dmi_sglang.domain.ports.RecordReader` on ClickHouse.

    Args:
        config: the store (embedded or server). Opening nothing until a call.
        client_factory: opens a client (default: :func:`connect`, which refuses to
            create a missing embedded store).
    """

    def __init__(self, config: StoreConfig, *, client_factory: ClientFactory | None = None):
        if config.kind is StoreKind.NONE:
            msg = "the store is 'none' (no persistence): there is nothing to read"
            raise StoreError(msg)
        self._config = config
        self._tables = StoreTables.named(config.database, config.table)
        self._factory = client_factory or (lambda c: connect(c, create=False))
        self._local = _Session()

    @property
    def _client(self) -> Client | None:
        return self._local.client

    @property
    def _present(self) -> dict[str, bool]:
        return self._local.present

    @contextlib.contextmanager
    def session(self) -> Iterator[ClickHouseReader]:
        """Keep the store open for the calls inside the block (re-entrant). Each thread
        has a session of its own (its own client): handles sharing one reader may be
        read from several threads at once."""
        local = self._local
        if local.client is not None:
            yield self
            return
        local.client = self._factory(self._config)
        local.present = {}
        try:
            yield self
        finally:
            client, local.client = local.client, None
            close_quietly(client)

    def _query(self, layout: Layout, sql: str, params: dict[str, Any], **kw: Any) -> list[Any]:
        """Rows of ``sql`` ({t} = the table), or [] when the table does not exist."""
        result = self._on_table(layout, sql,
                                lambda client, q: client.query(q, parameters=params, **kw))
        # Columns, then zip: clickhouse-connect's row view is far slower.
        return [] if result is None else list(zip(*result.result_columns, strict=True))

    def _query_arrow(self, layout: Layout, sql: str, params: dict[str, Any]) -> pa.Table | None:
        """``sql``'s result as an Arrow table, or None when the table does not exist."""
        return self._on_table(layout, sql, lambda client, q: client.query_arrow(
            q, parameters=params, settings=writable_settings(client, ARROW_SETTINGS)))

    def _on_table(self, layout: Layout, sql: str,
                  run: Callable[[Client, str], Any]) -> Any:
        """``run(client, sql)`` with {t} = the table, or None when the table does not
        exist; failures as :class:`StoreError`."""
        with self.session():
            client = self._client
            assert client is not None
            try:
                if layout.name not in self._present:
                    self._present[layout.name] = self._tables.check(client, layout)
                if not self._present[layout.name]:
                    return None
                return run(client, sql.replace("{t}", self._tables.qualified(layout)))
            except StoreError:
                raise
            except Exception as exc:
                raise store_error(f"reading {self._config.url}", exc) from exc

    # -- RecordReader ----------------------------------------------------------------

    def runs(self) -> list[RunInfo]:
        """Every run in the store (latest state of each), newest first."""
        rows = self._query(
            self._tables.runs,
            "SELECT * FROM {t} ORDER BY version DESC LIMIT 1 BY run_id",
            {},
        )
        runs = [self._observed(r) for r in rows]
        return sorted(runs, key=lambda r: r.started_at, reverse=True)

    def run(self, run_id: str) -> RunInfo | None:
        """One run's latest state, or None when the store has no such run."""
        rows = self._query(
            self._tables.runs,
            "SELECT * FROM {t} WHERE run_id = {run:String} ORDER BY version DESC LIMIT 1",
            {"run": run_id},
        )
        return self._observed(rows[0]) if rows else None

    def _observed(self, row: Any) -> RunInfo:
        """The run of a runs-table row as a reader sees it now: a ``running`` run whose
        owner is gone reads as interrupted (see ``RunStatus.INTERRUPTED``)."""
        run = run_from_row(row)
        if run.status is not RunStatus.RUNNING:
            return run
        if self._config.kind is StoreKind.EMBEDDED:
            if is_live(self._config.path, run.run_id):
                return run
            why = ("no process holds the store, so the process that captured it stopped "
                   "without finishing (killed or crashed)")
        else:
            age = time.time() - int(row[8]) / 1e9
            if age < STALE_AFTER_S:
                return run
            why = (f"its last heartbeat is {age:,.0f} s old (stale after {STALE_AFTER_S:.0f} "
                   f"s): its owner {run.owner or '(unknown)'} stopped without finishing")
        return attrs.evolve(run, status=RunStatus.INTERRUPTED,
                            error=f"interrupted: {why}; read what it stored with --partial")

    def requests(self, run_id: str) -> list[RequestSummary]:
        """Requests of a run with their stored records and payload bytes (superseded
        records included: this is the footprint)."""
        rows = self._query(
            self._tables.offload,
            "SELECT request_id, count(), sum(length(bytes)) FROM {t} "
            "WHERE model_id = {run:String} GROUP BY request_id ORDER BY request_id",
            {"run": run_id},
        )
        return [RequestSummary(run_id, str(r), int(n), int(b)) for r, n, b in rows]

    def hook_totals(self, run_id: str) -> list[HookTotal]:
        """Per act_name of a run: layers, records, rows and payload bytes stored."""
        rows = self._query(
            self._tables.offload,
            "SELECT act_name, uniqExact(layer_no), count(), "
            "sum(end_token_idx - start_token_idx), sum(length(bytes)) FROM {t} "
            "WHERE model_id = {run:String} GROUP BY act_name ORDER BY act_name",
            {"run": run_id},
        )
        return [HookTotal(str(a), int(ln), int(n), int(r), int(b)) for a, ln, n, r, b in rows]

    def manifest(self, run_id: str, request_id: str) -> RequestManifest | None:
        """The request's latest manifest, or None when none was written."""
        rows = self._query(
            self._tables.manifest,
            "SELECT * FROM {t} WHERE model_id = {run:String} AND request_id = {req:String} "
            "ORDER BY version DESC LIMIT 1",
            {"run": run_id, "req": request_id},
        )
        return manifest_from_row(rows[0]) if rows else None

    def manifests(self, run_id: str) -> list[RequestManifest]:
        """The latest manifest of each request of a run that has one, by request id."""
        rows = self._query(
            self._tables.manifest,
            "SELECT * FROM {t} WHERE model_id = {run:String} "
            "ORDER BY request_id, version DESC LIMIT 1 BY request_id",
            {"run": run_id},
        )
        return [manifest_from_row(r) for r in rows]

    def records(
        self,
        run_id: str,
        request_id: str,
        *,
        act_name: str | None = None,
        layer_no: int | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> list[CaptureRecord]:
        """Stored records of a request, every copy (superseded ones included), ordered by
        act_name, layer, start position and seq. ``start`` / ``end`` keep the records
        overlapping positions ``[start, end)``."""
        where = ["model_id = {run:String}", "request_id = {req:String}"]
        params: dict[str, Any] = {"run": run_id, "req": request_id}
        for cond, name, value in (
            ("act_name = {act:String}", "act", act_name),
            ("layer_no = {layer:Int32}", "layer", layer_no),
            ("end_token_idx > {start:Int64}", "start", start),
            ("start_token_idx < {end:Int64}", "end", end),
        ):
            if value is not None:
                where.append(cond)
                params[name] = value
        sql = (
            f"SELECT {_RECORD_COLUMNS} FROM {{t}} WHERE {' AND '.join(where)} "
            "ORDER BY act_name, layer_no, start_token_idx, seq"
        )
        rows = self._query(self._tables.offload, sql, params, column_formats={"bytes": "bytes"})
        return [
            CaptureRecord(
                model_id=m,
                request_id=r,
                act_name=a,
                layer_no=int(ln),
                shard_rank=int(sr),
                start_token_idx=int(s),
                end_token_idx=int(e),
                dtype=d,
                shape=tuple(int(x) for x in shp),
                payload=bytes(p),
                seq=int(q),
            )
            for m, r, a, ln, sr, s, e, d, shp, p, q in rows
        ]

    def batches_within(self, run_id: str, request_id: str, *,
                       captures: Sequence[tuple[str, int]], start: int,
                       end: int) -> list[RecordBatch]:
        """The records of the ``captures`` overlapping ``[start, end)``, cut to it in the
        query (``substring`` of the payload), as one record batch per ``shard_rank``
        over the query's own Arrow buffers: only those rows come back (the engine still
        reads each whole record to cut it, and each block of the store it needs once for
        all the captures), and no Python object is made per record.

        Raises:
            StoreError: a stored record whose payload or shape does not fit its rows.
        """
        if end <= start or not captures:
            return []
        params = {"run": run_id, "req": request_id,
                  "caps": [(str(a), int(n)) for a, n in captures], "start": start, "end": end}
        table = self._query_arrow(self._tables.offload, BATCHES_SQL, params)
        return [] if table is None else batches_from_arrow(table, run_id, request_id)

    def ranges(self, run_id: str, request_id: str) -> list[tuple[str, int, int, int, int]]:
        """Distinct ``(act_name, layer_no, shard_rank, start, end)`` of a request's stored
        records, without payloads (for completeness checks)."""
        rows = self._query(
            self._tables.offload,
            "SELECT DISTINCT act_name, layer_no, shard_rank, start_token_idx, end_token_idx "
            "FROM {t} WHERE model_id = {run:String} AND request_id = {req:String}",
            {"run": run_id, "req": request_id},
        )
        return [(str(a), int(ln), int(sr), int(s), int(e)) for a, ln, sr, s, e in rows]

    def extents(self, run_id: str, request_id: str) -> RequestExtents:
        """A request's distinct stored ranges, each with one record's dtype and row
        shape, in one query without payloads."""
        rows = self._query(
            self._tables.offload,
            "SELECT act_name, layer_no, shard_rank, start_token_idx, end_token_idx, "
            "any(dtype), any(arraySlice(shape, 2)) FROM {t} "
            "WHERE model_id = {run:String} AND request_id = {req:String} "
            "GROUP BY act_name, layer_no, shard_rank, start_token_idx, end_token_idx",
            {"run": run_id, "req": request_id},
        )
        return RequestExtents.from_rows(
            (str(a), int(ln), int(sr), int(lo), int(hi), str(d), tuple(int(x) for x in shp))
            for a, ln, sr, lo, hi, d, shp in rows)

    def delete_run(self, run_id: str) -> int:
        """Delete a run's records, manifests and run rows; returns records deleted.

        Raises:
            StoreError: a sink of this process captures into the embedded store now and
                the records table holds parts: the capture holds that table's merges,
                which a delete (a mutation of its parts) would wait for until that run
                finished.
        """
        with self.session():
            live = (live_runs(self._config.path)
                    if self._config.kind is StoreKind.EMBEDDED else [])
            if live and self._has_parts(self._tables.offload):
                msg = (f"cannot delete run {run_id!r} while this process captures run "
                       f"{', '.join(map(repr, live))} into {self._config.url}: the capture "
                       "holds the store's merges, which a delete waits for; delete it "
                       "after that run stopped")
                raise StoreError(msg)
            n = self._query(
                self._tables.offload,
                "SELECT count() FROM {t} WHERE model_id = {run:String}",
                {"run": run_id},
            )
            for layout, key in (
                (self._tables.offload, "model_id"),
                (self._tables.manifest, "model_id"),
                (self._tables.runs, "run_id"),
            ):
                self._delete(layout, key, run_id)
            return int(n[0][0]) if n else 0

    def _has_parts(self, layout: Layout) -> bool:
        """Whether the table has an active part (inside a session)."""
        client = self._client
        assert client is not None
        try:
            return active_parts(client, self._config.database, layout.name) > 0
        except Exception as exc:
            raise store_error(f"reading {self._config.url}", exc) from exc

    def _delete(self, layout: Layout, key: str, run_id: str) -> None:
        client = self._client
        assert client is not None
        if not self._present.get(layout.name, False) and not self._tables.check(client, layout):
            return
        try:
            client.command(
                f"DELETE FROM {self._tables.qualified(layout)} WHERE {key} = {{run:String}}",
                parameters={"run": run_id},
            )
        except Exception as exc:
            raise store_error(f"deleting run {run_id} from {layout.name}", exc) from exc
