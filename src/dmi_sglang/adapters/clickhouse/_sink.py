"""The ClickHouse record sink: :class:`ClickHouseSink` (batched, background writers).

``ClickHouseSink.put`` only queues; writer threads (one by default, each with its own
client) take batches of at most ``insert_rows`` records, a partial batch after at most
``flush_timeout_us``, encode them as one Native block and ``raw_insert`` it. Transient
errors are retried with exponential backoff; when the retries run out, or on any other
error, the failure becomes sticky: queued records are dropped, and ``put``, ``flush``,
``finish_run`` and ``close`` raise it (a :class:`StoreError` whose ``__cause__`` is the
library's exception).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING

import attrs
import structlog

from dmi_sglang.adapters.clickhouse._client import (
    ClientFactory,
    close_quietly,
    compress,
    connect,
    disk_full,
    is_transient,
    store_error,
    wire_compression,
)
from dmi_sglang.adapters.clickhouse._live import mark_done, mark_live
from dmi_sglang.adapters.clickhouse._native import COLUMN_NAMES, coalesce, encode_block
from dmi_sglang.adapters.clickhouse._queue import Batch, RecordQueue
from dmi_sglang.adapters.clickhouse._rows import manifest_row, run_row
from dmi_sglang.adapters.clickhouse._schema import Layout, StoreTables
from dmi_sglang.adapters.clickhouse._stats import SinkStats, StatsCounter
from dmi_sglang.domain.records import (
    HEARTBEAT_S,
    CaptureRecord,
    RequestManifest,
    RunInfo,
    RunStatus,
)
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

__all__ = ["ClickHouseSink", "SinkStats"]

log = structlog.get_logger(__name__)

# Every file write of a piece releases the GIL, and a thread that releases it waits up to
# the switch interval (5 ms) to get it back while another thread runs Python (SGLang's
# scheduler). Writing each payload separately would cost that wait per record; joining
# into pieces this large costs one copy and keeps the waits few per insert.
_PIECE_BYTES = 8 << 20


class ClickHouseSink:
    """A :class:`~dmi_sglang.domain.ports.RecordSink` on ClickHouse (embedded or server).

    The constructor opens the store and creates or checks the tables, so a bad
    directory, a locked store, an unreachable server or refused credentials fail here,
    before any capture begins.

    Args:
        config: the store (``kind`` embedded or server).
        writers: inserting threads, each with its own client (the embedded engine
            admits several clients of one process on its directory); default
            ``config.writers`` (``DMX_CH_WRITERS``).
        retries: retries of a transient insert failure before it becomes sticky.
        backoff_s: first retry delay; doubles per retry, at most 5 s.
        batch_mb: most payload MiB per insert (0: a quarter of ``queue_mb``, at most
            256 MiB).
        client_factory: opens a client (default: :func:`connect`); a seam for tests.

    Raises:
        StoreError: the store cannot be opened, or a table has an incompatible layout.
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        writers: int | None = None,
        retries: int = 5,
        backoff_s: float = 0.1,
        batch_mb: int = 0,
        client_factory: ClientFactory | None = None,
        heartbeat_s: float | None = None,
    ) -> None:
        self._config = config
        self._heartbeat_s = heartbeat_s if heartbeat_s is not None else (
            HEARTBEAT_S if config.kind is StoreKind.SERVER else 0.0)
        self._running: RunInfo | None = None
        self._beating = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._tables = StoreTables.named(config.database, config.table)
        self._retries = retries
        self._backoff_s = backoff_s
        self._factory: ClientFactory = client_factory or connect
        self._compression = wire_compression(config)
        self._queue = RecordQueue(
            max_bytes=config.queue_mb << 20,
            batch_rows=config.insert_rows,
            linger_s=config.flush_timeout_us / 1e6,
            batch_bytes=batch_mb << 20,
        )
        self._stats = StatsCounter()
        self._control_lock = threading.Lock()
        self._closed = False
        self._clients: list[Client] = []
        try:
            self._control = self._factory(config)
            self._clients.append(self._control)
            self._run_control("creating the capture tables", self._tables.ensure)
            count = config.writers if writers is None else max(1, writers)
            self._clients.extend(self._factory(config) for _ in range(count))
        except BaseException:
            for client in self._clients:
                close_quietly(client)
            raise
        self._threads = [
            threading.Thread(target=self._write_loop, args=(c,), name=f"dmi-sink-{i}", daemon=True)
            for i, c in enumerate(self._clients[1:])
        ]
        for t in self._threads:
            t.start()
        log.info("store.opened", url=config.url, table=config.table, writers=len(self._threads))

    # -- RecordSink ------------------------------------------------------------------

    def start_run(self, run: RunInfo) -> None:
        """Write the run's row (status as given, normally running) with its owner
        (``host:pid``). While it runs, a server-store run rewrites that row every
        ``HEARTBEAT_S`` (its heartbeat), so readers can tell a crashed run.

        Raises:
            StoreError: the sticky failure, a closed sink, or the write failed.
        """
        self._raise_if_unusable()
        if not run.owner:
            run = attrs.evolve(run, owner=f"{socket.gethostname()}:{os.getpid()}")
        self._running = run
        if self._config.kind is StoreKind.EMBEDDED:  # live before any reader can see the row
            mark_live(self._config.path, run.run_id)
        self._write_control(self._tables.runs, [run_row(run)], f"recording run {run.run_id}")
        if self._heartbeat_s > 0 and self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._beat, name="dmi-sink-heartbeat",
                                               daemon=True)
            self._heartbeat.start()

    def put(self, records: Sequence[CaptureRecord]) -> None:
        """Queue records; blocks while ``queue_mb`` is used up; never drops.

        Raises:
            StoreError: the sink failed (sticky) or was closed.
        """
        self._queue.put(records)
        self._stats.put(records)

    def flush(self) -> None:
        """Block until everything put so far is stored.

        Raises:
            StoreError: the sticky failure.
        """
        self._queue.wait_done()

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """Flush, then write the manifests and, last, the run's final status.

        A manifest is stored as committed only when it says so, the run's status is
        committed and the flush succeeded. When the sink has failed, the run is recorded
        as failed (best effort, no manifest) and the failure is raised.

        Raises:
            StoreError: the sticky failure, or writing the manifests / run failed.
        """
        try:
            try:
                self.flush()  # the run stays live (and beating) until its final row
            except StoreError as failure:
                self._stop_heartbeat()
                self._record_failed_run(run, failure)
                raise
            self._raise_if_unusable()
            committed = run.status is RunStatus.COMMITTED
            rows = [manifest_row(m, committed=m.committed and committed) for m in manifests]
            if rows:
                self._write_control(self._tables.manifest, rows,
                                    f"writing manifests of {run.run_id}")
            self._stop_heartbeat()  # no running row may land after the final one
            self._write_control(self._tables.runs, [run_row(run)],
                                f"finishing run {run.run_id}")
        finally:
            self._stop_heartbeat()
            self._not_live()
        log.info(
            "store.run_finished", run_id=run.run_id, status=run.status.value, manifests=len(rows)
        )

    def close(self) -> None:
        """Drain the queue, stop the writers and release the store. Idempotent.

        Raises:
            StoreError: the sticky failure (the store is released anyway).
        """
        if not self._closed:
            self._closed = True
            self._stop_heartbeat()
            self._not_live()
            self._queue.close()
            for t in self._threads:
                t.join()
            for client in self._clients:
                close_quietly(client)
            log.info("store.closed", url=self._config.url, writers=len(self._threads),
                     **self.stats().as_dict())
        self._raise_if_failed()

    # -- extras ----------------------------------------------------------------------

    def stats(self) -> SinkStats:
        """Counters so far (records, bytes, inserts, retries, writer CPU time)."""
        return self._stats.snapshot(queued_bytes=self._queue.queued_bytes)

    @property
    def failure(self) -> StoreError | None:
        """The sticky failure, if the sink failed."""
        return self._queue.failure

    # -- internals -------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._queue.failure is not None:
            raise self._queue.failure

    def _raise_if_unusable(self) -> None:
        self._raise_if_failed()
        if self._closed:
            msg = "the capture sink is closed"
            raise StoreError(msg)

    def _beat(self) -> None:
        while not self._beating.wait(self._heartbeat_s):
            run = self._running
            if run is None or self._queue.failure is not None:
                continue
            try:
                self._write_control(self._tables.runs, [run_row(run)], "heartbeat")
            except StoreError as exc:  # the inserts will fail loudly if the store is gone
                log.warning("store.heartbeat_failed", run_id=run.run_id, error=str(exc))

    def _stop_heartbeat(self) -> None:
        beat, self._heartbeat = self._heartbeat, None
        self._beating.set()
        if beat is not None:
            beat.join()

    def _not_live(self) -> None:
        running, self._running = self._running, None
        if running is not None and self._config.kind is StoreKind.EMBEDDED:
            mark_done(self._config.path, running.run_id)

    def _write_loop(self, client: Client) -> None:
        """Insert batches until the queue closes. Any exception, not only a store error
        (a record the encoder refuses, a bad timeout), becomes the sticky failure, so
        ``flush``, ``finish_run`` and ``close`` raise it instead of waiting forever."""
        try:
            while (batch := self._queue.take()) is not None:
                started, cpu = time.monotonic(), time.thread_time()
                try:
                    self._insert(client, batch)
                finally:
                    self._stats.insert_time(time.monotonic() - started,
                                            time.thread_time() - cpu)
                self._queue.done(batch)
                self._stats.inserted(batch)
        except BaseException as exc:
            failure = exc if isinstance(exc, StoreError) else store_error(
                f"a writer of {self._config.url} failed", exc, self._config)
            if failure is not exc:
                failure.__cause__ = exc
            log.error("store.failed", error=str(failure))
            self._queue.fail(failure)

    def _insert(self, client: Client, batch: Batch) -> None:
        chunks = encode_block(batch.records)
        table = self._tables.qualified(self._tables.offload)
        for attempt in range(self._retries + 1):
            block: bytes | Generator[bytes, None, None]
            if self._config.kind is StoreKind.SERVER:
                block = compress(b"".join(chunks), self._compression)
            else:  # the embedded client writes the pieces to a file, then ingests it
                block = coalesce(chunks, _PIECE_BYTES)
            try:
                client.raw_insert(
                    table, COLUMN_NAMES, block, fmt="Native", compression=self._compression
                )
                return
            except Exception as exc:
                if attempt >= self._retries or not is_transient(exc):
                    what = (
                        f"inserting {len(batch.records)} records into {table} failed "
                        f"after {attempt + 1} attempt(s)"
                    )
                    raise store_error(what, exc, self._config) from exc
                delay = min(5.0, self._backoff_s * 2**attempt)
                log.warning("store.retry", attempt=attempt + 1, delay_s=delay, error=str(exc))
                self._stats.retried()
                time.sleep(delay)

    def _run_control(self, what: str, action: Callable[[Client], object]) -> None:
        with self._control_lock:
            try:
                action(self._control)
            except StoreError:
                raise
            except Exception as exc:
                raise store_error(what, exc, self._config) from exc

    def _write_control(self, layout: Layout, rows: list[list[object]], what: str) -> None:
        table = self._tables.qualified(layout)
        names = [n for n, _ in layout.columns]
        for attempt in range(self._retries + 1):
            try:
                self._run_control(what, lambda c: c.insert(table, rows, column_names=names))
                return
            except StoreError as failure:
                cause = failure.__cause__
                if cause is not None and disk_full(cause):
                    self._queue.fail(failure)  # a full disk fails the run, as for inserts
                    raise
                if attempt >= self._retries or cause is None or not is_transient(cause):
                    raise
                time.sleep(min(5.0, self._backoff_s * 2**attempt))

    def _record_failed_run(self, run: RunInfo, failure: StoreError) -> None:
        failed = attrs.evolve(
            run,
            stopped_at=run.stopped_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            status=RunStatus.FAILED,
            error=run.error or str(failure),
        )
        try:
            self._write_control(self._tables.runs, [run_row(failed)], "recording a failed run")
        except StoreError as exc:  # the store is down; readers see the run as not committed
            log.warning("store.failed_run_not_recorded", run_id=run.run_id, error=str(exc))
