"""The ClickHouse record sink: :class:`ClickHouseSink` (queued batches, background writers).

``ClickHouseSink.put`` only queues a :class:`~dmi_sglang.columns.RecordBatch`; writer
threads (each with its own connection) take one or more whole batches per insert (at most
``insert_rows`` records and the batch byte bound, unless one batch alone holds more), a
partial insert after at most ``flush_timeout_us``, turn them into one Arrow table without
copying the payloads (:mod:`._arrow`) and insert it (:mod:`._insert`: the embedded
engine reads it in place through ``Python()``, a server gets Arrow IPC).

Transient errors are retried with exponential backoff. TOO_MANY_PARTS is not: merges
start again and the insert is repeated for up to :data:`TOO_MANY_PARTS_WAIT_S`. When
that runs out, the retries run out, or on any other error, the failure becomes sticky:
queued batches are dropped, and ``put``, ``flush``, ``finish_run`` and ``close`` raise it
(a :class:`StoreError` whose ``__cause__`` is the library's exception).

On the embedded store, merges of the records table are held while a run captures
(:mod:`._merges`), and ``finish_run`` syncs the run's new files to disk
(:mod:`._durable`) before it returns. While the run captures, a background thread syncs
the files written so far, a pass every :data:`SYNC_PASS_S` (nearly back to back while
they take longer), and that final sync (which covers
every file changed since the previous final sync: a pass may miss a part whose
directory was renamed during its walk) leaves out what a sync made durable and is
unchanged since (:class:`~._durable.SyncedFiles`): it fsyncs what the passes did not.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import structlog

from dmi_sglang.adapters.clickhouse._arrow import arrow_table
from dmi_sglang.adapters.clickhouse._client import (
    ClientFactory,
    close_quietly,
    connect,
    disk_full,
    is_transient,
    store_error,
    too_many_parts,
    wire_compression,
)
from dmi_sglang.adapters.clickhouse._commits import RequestCommits
from dmi_sglang.adapters.clickhouse._durable import SyncedFiles, sync_tree
from dmi_sglang.adapters.clickhouse._insert import Inserter, InserterFactory, open_inserter
from dmi_sglang.adapters.clickhouse._live import mark_done, mark_live
from dmi_sglang.adapters.clickhouse._merges import MergeHold
from dmi_sglang.adapters.clickhouse._queue import RecordQueue, Taken
from dmi_sglang.adapters.clickhouse._rows import manifest_row, run_row
from dmi_sglang.adapters.clickhouse._schema import Layout, StoreTables
from dmi_sglang.adapters.clickhouse._stats import SinkStats, StatsCounter
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import HEARTBEAT_S, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError
from dmi_sglang.threads import OsNamedThread

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

__all__ = ["SYNC_PASS_S", "TOO_MANY_PARTS_WAIT_S", "ClickHouseSink", "SinkStats"]

log = structlog.get_logger(__name__)

TOO_MANY_PARTS_WAIT_S = 120.0
"""Longest an insert refused with TOO_MANY_PARTS is repeated (merges running again)
before the refusal becomes the sticky failure."""

SYNC_PASS_S = 1.0
"""While a run captures into an embedded store and something was written since the
previous pass, the files changed since then are synced in the background this long after
the previous pass began (:data:`SYNC_PASS_REST` of it after that pass ended, when it
took longer), so that ``finish_run``'s
sync has only what came after the last pass left to sync."""

SYNC_PASS_REST = 0.1
"""After a pass that took longer than :data:`SYNC_PASS_S`, the passes' thread rests this
share of the period before the next (it walks the store's tree every pass)."""

_SQUASH_BYTES = 256 << 20  # the engine forms a part per this many bytes of one insert
_SQUASH_ROWS = 1_048_449  # ... or per this many rows (min_insert_block_size_*)
_MTIME_SLACK_NS = 2_000_000_000  # file times come from a coarse clock
_WRITE_BACK_ERRORS = frozenset({errno.EIO, errno.ENOSPC, errno.EDQUOT})
"""fsync errors that say written pages were lost (not a file a merge removed meanwhile)."""


class ClickHouseSink:
    """A :class:`~dmi_sglang.columns.RecordSink` on ClickHouse (embedded or server).

    The constructor opens the store and creates or checks the tables, so a bad
    directory, a locked store, an unreachable server or refused credentials fail here,
    before any capture begins.

    Args:
        config: the store (``kind`` embedded or server).
        writers: inserting threads, each with its own connection (the embedded engine
            admits several connections of one process on its directory); default
            ``config.writers`` (``DMX_CH_WRITERS``).
        retries: retries of a transient insert failure before it becomes sticky.
        backoff_s: first retry delay; doubles per retry, at most 5 s (also the first
            delay of the repeats after TOO_MANY_PARTS).
        client_factory: opens the control client (tables, runs, manifests, merges;
            default :func:`connect`); a seam for tests.
        inserter_factory: opens a writer's connection (default
            :func:`~._insert.open_inserter`); a seam for tests.

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
        client_factory: ClientFactory | None = None,
        inserter_factory: InserterFactory | None = None,
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
        wire_compression(config)  # an unsupported setting fails before connecting
        count = config.writers if writers is None else max(1, writers)
        self._queue = RecordQueue(
            max_bytes=config.queue_mb << 20,
            batch_rows=config.insert_rows,
            linger_s=config.flush_timeout_us / 1e6,
            batch_bytes=config.insert_bytes,
        )
        self._stats = StatsCounter()
        self._control_lock = threading.Lock()
        self._closed = False
        self._control: Client | None = None
        self._inserters: list[Inserter] = []
        self._sync_since_ns = time.time_ns() - _MTIME_SLACK_NS
        self._sync_lock = threading.Lock()
        """One sync at a time."""
        self._pass_since_ns = self._sync_since_ns
        """The background passes' own cutoff (the final sync keeps ``_sync_since_ns``)."""
        self._synced = SyncedFiles(_MTIME_SLACK_NS)
        """What the syncs made durable: the next one leaves it out while unchanged."""
        self._written = threading.Event()
        """Set by every write; a background pass runs only when it was set."""
        self._sync_passes_stop = threading.Event()
        self._lost_writes: OSError | None = None
        """A background sync pass's write-back error (EIO, ENOSPC, EDQUOT): the kernel
        reports it once and marks the pages clean, so no later sync sees it: the run
        cannot be committed as durable."""
        self._syncer: threading.Thread | None = None
        try:
            self._control = self._factory(config)
            self._run_control("creating the capture tables", self._tables.ensure)
            opener = inserter_factory or open_inserter
            for _ in range(count):
                self._inserters.append(opener(config))
        except BaseException:
            self._close_connections()
            raise
        table = self._tables.offload.name
        self._merges = MergeHold(self._run_control, config.database, table,
                                 self._tables.qualified(self._tables.offload))
        self._threads = [
            OsNamedThread(target=self._write_loop, args=(w,), name=f"dmi-sink-{i}", daemon=True)
            for i, w in enumerate(self._inserters)
        ]
        for t in self._threads:
            t.start()
        self._commits = RequestCommits(self._queue, self._write_commits)
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
        self._lost_writes = None
        if self._config.kind is StoreKind.EMBEDDED:  # live before any reader can see the row
            mark_live(self._config.path, run.run_id)
            self._merges.hold()
        self._write_control(self._tables.runs, [run_row(run)], f"recording run {run.run_id}")
        if self._config.kind is StoreKind.EMBEDDED:
            self._start_sync_passes(run.run_id)
        if self._heartbeat_s > 0 and self._heartbeat is None:
            self._beating.clear()  # a run before this one stopped its beat
            self._heartbeat = OsNamedThread(target=self._beat, name="dmi-sink-heartbeat",
                                            daemon=True)
            self._heartbeat.start()

    def put(self, batch: RecordBatch) -> None:
        """Queue a batch (kept, payload memory included, until it is stored); blocks
        while ``queue_mb`` is used up; never drops.

        Raises:
            StoreError: the sink failed (sticky) or was closed.
        """
        self._queue.put(batch)
        if len(batch):
            self._stats.put(batch)

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        """Store these committed manifests once every batch put so far is stored (on
        the sink's commit thread; never blocks).

        Raises:
            StoreError: the sticky failure, or the sink is closed.
        """
        self._raise_if_unusable()
        self._commits.add(manifests)

    def flush(self) -> None:
        """Block until everything put so far is stored, and every manifest given to
        :meth:`commit_requests`.

        Raises:
            StoreError: the sticky failure.
        """
        self._queue.wait_done()
        self._commits.wait_idle()

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        """Flush, write the manifests and, last, the run's final status, and let merges
        run again. On the embedded store the files written since the previous sync are
        synced to disk after the status is written, so that they survive a power loss;
        for a committed run the run's parts are synced before the manifests and the
        status too, so a power loss between the two never leaves a committed status over
        data that was not on disk (a failed sync there records the run as failed). On a
        server store, durability is the server's (its own fsync settings).

        A manifest is stored as committed only when it says so, the run's status is
        committed and the flush succeeded. When the sink has failed, or the flush, the
        sync before the manifests or their write fails, the run is recorded as failed
        (best effort) and the failure is raised.

        Raises:
            StoreError: the sticky failure, writing the manifests / run failed, or the
                sync failed.
        """
        began, queued = time.monotonic(), self._queue.queued_bytes
        flushed: float | None = None
        try:
            embedded = self._config.kind is StoreKind.EMBEDDED
            committed = run.status is RunStatus.COMMITTED
            try:
                try:
                    self.flush()  # the run stays live (and beating) until its final row
                finally:
                    flushed = time.monotonic()
                self._raise_if_unusable()
                if embedded and committed:  # the data on disk before a row says it is complete
                    self._stop_sync_passes()
                    if self._lost_writes is not None:  # reported once: never seen again
                        lost = self._lost_writes
                        what = f"syncing the files of run {run.run_id} to disk"
                        raise store_error(what, lost, self._config) from lost
                    self._sync(run.run_id)
                rows = [manifest_row(m, committed=m.committed and committed) for m in manifests]
                if rows:
                    self._write_control(self._tables.manifest, rows,
                                        f"writing manifests of {run.run_id}")
            except StoreError as failure:  # the run's data or manifests are not all stored
                self._stop_heartbeat()
                self._record_failed_run(run, failure)
                raise
            self._stop_heartbeat()  # no running row may land after the final one
            self._write_control(self._tables.runs, [run_row(run)],
                                f"finishing run {run.run_id}")
            if embedded:
                self._sync(run.run_id)
        finally:
            ended = time.monotonic()
            self._stats.finished(ended - began, queued_bytes=queued,
                                 flush_seconds=(ended if flushed is None else flushed) - began)
            self._stop_sync_passes()
            self._stop_heartbeat()
            self._not_live()
            self._merges.release("run finished")
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
            unfinished = self._running
            self._stop_heartbeat()
            self._stop_sync_passes()
            self._not_live()
            self._queue.close()
            for t in self._threads:
                t.join()
            self._commits.close()
            if unfinished is not None and self._config.kind is StoreKind.EMBEDDED:
                self._sync_unfinished(unfinished.run_id)
            self._merges.release("sink closed")
            self._close_connections()
            log.info("store.closed", url=self._config.url, writers=len(self._threads),
                     **self.stats().as_dict())
        self._raise_if_failed()

    # -- extras ----------------------------------------------------------------------

    def stats(self) -> SinkStats:
        """Counters so far (records, bytes, inserts, retries, writer CPU time, the
        queue's waits)."""
        return self._stats.snapshot(queued_bytes=self._queue.queued_bytes,
                                    waits=self._queue.waits())

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

    def _close_connections(self) -> None:
        for inserter in self._inserters:
            try:
                inserter.close()
            except Exception as exc:  # closing is best effort: the data is already stored
                log.warning("store.close_failed", error=str(exc))
        close_quietly(self._control)

    def _start_sync_passes(self, run_id: str) -> None:
        if self._syncer is None:
            self._sync_passes_stop.clear()
            self._syncer = OsNamedThread(target=self._sync_passes, args=(run_id,),
                                         name="dmi-sink-sync", daemon=True)
            self._syncer.start()

    def _stop_sync_passes(self) -> None:
        syncer, self._syncer = self._syncer, None
        self._sync_passes_stop.set()
        if syncer is not None:
            syncer.join()

    def _sync_passes(self, run_id: str) -> None:
        """While the run captures, when something was written since the previous pass:
        sync the files changed since then, :data:`SYNC_PASS_S` after the previous pass
        began (a tenth of that after it ended when it took longer,
        :data:`SYNC_PASS_REST`: the disk stays busy while the capture writes faster than
        it, and ``finish_run`` is left about one pass's worth). A
        failed pass is logged; its files are left to the next pass, a period after it
        failed, and to the final sync, except a write-back error
        (:data:`_WRITE_BACK_ERRORS`), which the kernel reports only once: it is kept,
        and a committed finish fails on it."""
        failures = 0
        due = time.monotonic() + SYNC_PASS_S
        while not self._sync_passes_stop.wait(max(0.0, due - time.monotonic())):
            began = time.monotonic()
            due = began + SYNC_PASS_S
            if not self._written.is_set():
                continue
            self._written.clear()  # before the walk: a write during it sets it again
            started = time.time_ns()
            try:
                with self._sync_lock:
                    report = sync_tree(self._config.path, self._pass_since_ns, self._synced)
                    self._pass_since_ns = started - _MTIME_SLACK_NS
            except OSError as exc:
                if exc.errno in _WRITE_BACK_ERRORS and self._lost_writes is None:
                    self._lost_writes = exc
                self._written.set()
                due = time.monotonic() + SYNC_PASS_S  # no tight loop over a failing disk
                failures += 1
                if failures == 1:
                    log.warning("store.sync_pass_failed", run_id=run_id, error=str(exc))
                continue
            if failures:
                log.info("store.sync_pass_recovered", run_id=run_id, failed_passes=failures)
                failures = 0
            self._stats.synced(report.seconds, background=True)
            due = max(due, time.monotonic() + SYNC_PASS_REST * SYNC_PASS_S)

    def _sync(self, run_id: str) -> None:
        """Sync every file changed since the previous final sync, except what a sync
        made durable and is unchanged since (what the background passes synced)."""
        with self._sync_lock:
            since, self._sync_since_ns = self._sync_since_ns, time.time_ns() - _MTIME_SLACK_NS
            try:
                report = sync_tree(self._config.path, since, self._synced)
            except OSError as exc:
                self._sync_since_ns = since  # the next sync covers these files again
                what = f"syncing the files of run {run_id} to disk"
                raise store_error(what, exc, self._config) from exc
            self._pass_since_ns = max(self._pass_since_ns, self._sync_since_ns)
        self._stats.synced(report.seconds)
        log.info("store.synced", run_id=run_id, path=self._config.path, files=report.files,
                 directories=report.directories, mb=round(report.nbytes / 1e6, 1),
                 unchanged=report.skipped, seconds=round(report.seconds, 3))

    def _sync_unfinished(self, run_id: str) -> None:
        """Closing without ``finish_run`` (the run's process died, say): the requests it
        committed meanwhile, and the rows under them, go to disk as a finished run's
        would. A failure is logged: no row says the run itself is complete."""
        try:
            self._sync(run_id)
        except StoreError as exc:
            log.warning("store.close_sync_failed", run_id=run_id, error=str(exc))

    def _write_loop(self, inserter: Inserter) -> None:
        """Insert batches until the queue closes. Any exception, not only a store error
        (a batch the encoder refuses, a bad timeout), becomes the sticky failure, so
        ``flush``, ``finish_run`` and ``close`` raise it instead of waiting forever."""
        try:
            while True:
                taken = self._queue.take()
                if taken is None:
                    break
                started, cpu = time.monotonic(), time.thread_time()
                try:
                    self._insert(inserter, taken)
                finally:
                    self._stats.insert_time(time.monotonic() - started,
                                            time.thread_time() - cpu)
                self._stats.inserted(taken)
                self._written.set()
                self._queue.done(taken)
                parts = 1 + taken.payload_bytes // _SQUASH_BYTES + taken.records // _SQUASH_ROWS
                del taken  # the payloads go back to their owner while this writer waits
                self._merges.inserted(parts)
        except BaseException as exc:
            failure = exc if isinstance(exc, StoreError) else store_error(
                f"a writer of {self._config.url} failed", exc, self._config)
            if failure is not exc:
                failure.__cause__ = exc
            log.error("store.failed", error=str(failure))
            self._queue.fail(failure)

    def _insert(self, inserter: Inserter, taken: Taken) -> None:
        block = arrow_table(taken.batches)
        table = self._tables.qualified(self._tables.offload)
        attempt = waits = 0
        parts_deadline: float | None = None
        token = uuid.uuid4().hex  # one per insert: made again (retried), it stores nothing
        while True:
            try:
                inserter.insert_arrow(table, block, token=token)
                return
            except Exception as exc:
                if too_many_parts(exc):
                    now = time.monotonic()
                    if parts_deadline is None:
                        parts_deadline = now + TOO_MANY_PARTS_WAIT_S
                    self._merges.release("too many parts")  # again if a start failed
                    if now >= parts_deadline:
                        what = (
                            f"inserting {taken.records} records into {table} failed: the "
                            f"table still had too many parts (TOO_MANY_PARTS) after "
                            f"{TOO_MANY_PARTS_WAIT_S:g} s of waiting for merges"
                        )
                        raise store_error(what, exc, self._config) from exc
                    delay = min(5.0, self._backoff_s * 2**waits, parts_deadline - now)
                    waits += 1
                    log.warning("store.too_many_parts", attempt=waits, delay_s=delay,
                                error=str(exc))
                    self._stats.waited_for_parts()
                    time.sleep(delay)
                    continue
                if attempt >= self._retries or not is_transient(exc):
                    what = (
                        f"inserting {taken.records} records into {table} failed "
                        f"after {attempt + 1} attempt(s)"
                    )
                    raise store_error(what, exc, self._config) from exc
                delay = min(5.0, self._backoff_s * 2**attempt)
                attempt += 1
                log.warning("store.retry", attempt=attempt, delay_s=delay, error=str(exc))
                self._stats.retried()
                time.sleep(delay)

    def _run_control(self, what: str, action: Callable[[Client], object]) -> None:
        with self._control_lock:
            if self._control is None:
                msg = f"{what}: the store's control client is not open"
                raise StoreError(msg)
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
                self._written.set()
                return
            except StoreError as failure:
                cause = failure.__cause__
                if cause is not None and disk_full(cause):
                    self._queue.fail(failure)  # a full disk fails the run, as for inserts
                    raise
                retry = cause is not None and (is_transient(cause) or too_many_parts(cause))
                if attempt >= self._retries or not retry:
                    raise
                time.sleep(min(5.0, self._backoff_s * 2**attempt))

    def _write_commits(self, manifests: Sequence[RequestManifest]) -> None:
        rows = [manifest_row(m, committed=m.committed) for m in manifests]
        self._write_control(self._tables.manifest, rows,
                            f"committing {len(rows)} finished request(s)")
        log.debug("store.requests_committed", requests=len(rows))

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
