"""The implementations each port's contract suite runs against.

A new store backend adds one entry to :data:`STORE_BACKENDS` (a sink and the reader of
what it stored); a sink that stores nothing goes to :data:`SINKS` only. The suites in
this folder then run against it unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.app.null_sink import NullSink
from dmi_sglang.columns import RecordBatchReader, RecordSink
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.testing import MemoryReader, MemorySink


@attrs.frozen
class Backend:
    """A store backend under test: a sink, and a reader of what that sink stored."""

    sink: RecordSink
    reader: Callable[[], RecordBatchReader]
    deletes: bool = True
    """The reader deletes runs (a serving process's reads through the owner do not)."""
    close: Callable[[], None] = lambda: None


def _clickhouse(tmp_path: Path) -> Backend:
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=str(tmp_path / "store"),
                         flush_timeout_us=20_000)
    return Backend(ClickHouseSink(config), lambda: ClickHouseReader(config))


def _through_owner(tmp_path: Path, shared_bytes: int = 0) -> Backend:
    """The embedded store written as a tensor-parallel rank writes it and read as a
    server's main process reads it: through the write and read services of the process
    that owns the store."""
    from dmi_sglang.adapters.owner import ReadService, RemoteReader, RemoteSink, SinkService

    made = _clickhouse(tmp_path)
    tmp_path.chmod(0o700)  # the owner serves only in a directory of this user's alone
    reads = ReadService(made.reader(), f"ipc://{tmp_path}/reads")
    writes = SinkService(made.sink, f"ipc://{tmp_path}/writes")
    remote = RemoteReader(reads.address, timeout_s=30)

    def close() -> None:
        writes.close()
        reads.close()
        _closing(made.sink)

    return Backend(RemoteSink(writes.address, timeout_s=60, shared_bytes=shared_bytes),
                   lambda: remote, deletes=False, close=close)


def _through_owner_ring(tmp_path: Path) -> Backend:
    """As :func:`_through_owner`, the batches crossing through a shared ring of 1 MiB
    (small: it wraps, and puts wait for the owner's inserts to release it)."""
    return _through_owner(tmp_path, shared_bytes=1 << 20)


def _memory(tmp_path: Path) -> Backend:
    del tmp_path
    sink = MemorySink()
    return Backend(sink, lambda: MemoryReader(sink))


STORE_BACKENDS: dict[str, Callable[[Path], Backend]] = {
    "clickhouse-embedded": _clickhouse,
    "clickhouse-through-owner": _through_owner,
    "clickhouse-through-owner-ring": _through_owner_ring,
    "memory": _memory,
}
"""Backends that store what they are given and read it back."""

def _null(tmp_path: Path) -> Backend:
    del tmp_path

    def no_reader() -> RecordBatchReader:
        msg = "the null sink stores nothing to read"
        raise AssertionError(msg)

    return Backend(NullSink(), no_reader)


SINKS: dict[str, Callable[[Path], Backend]] = {**STORE_BACKENDS, "null": _null}
"""Every record sink (as a backend, for its closing)."""


def _closing(sink: RecordSink) -> None:
    with contextlib.suppress(Exception):  # a test about failures already checked them
        sink.close()


@pytest.fixture(params=sorted(STORE_BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each store backend, closed after the test."""
    made = STORE_BACKENDS[request.param](tmp_path)
    yield made
    made.close()
    _closing(made.sink)


@pytest.fixture(params=sorted(SINKS))
def sink(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RecordSink]:
    """Each record sink, closed after the test."""
    made = SINKS[request.param](tmp_path)
    yield made.sink
    made.close()
    _closing(made.sink)
