"""Where captures are stored: the resolved ``DMX_DB_*`` / ``DMX_CH_*`` settings."""

from __future__ import annotations

import enum
import os
import shutil
import tempfile

import attrs

__all__ = ["CHANNEL_DIRECTORY_MAX_BYTES", "INSERT_MB_MAX", "StoreConfig", "StoreKind",
           "channel_directory", "default_insert_bytes", "insert_bytes"]

CHANNEL_DIRECTORY_MAX_BYTES = 90
"""Longest directory (bytes) for the store's IPC channel sockets (``reads``, ``writes``):
an ``ipc://`` socket path longer than about 107 bytes cannot be bound."""


def channel_directory(prefix: str) -> str:
    """A new directory (mode 0700: this user's alone) for the store's IPC channel
    sockets, named ``prefix...``: in the temporary directory, or under ``/tmp`` when that
    path is too long to bind a socket in (kept where ``/tmp`` is not usable: the bind
    then says what is wrong)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    if len(os.fsencode(directory)) <= CHANNEL_DIRECTORY_MAX_BYTES:
        return directory
    try:
        short = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    except OSError:
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    return short


class StoreKind(enum.Enum):
    """The store's kind."""

    EMBEDDED = "embedded"
    """ClickHouse in this process (chdb), at an absolute directory."""
    SERVER = "server"
    """A ClickHouse server over HTTP(S)."""
    NONE = "none"
    """No persistence (transport-only runs, for benchmarks)."""


INSERT_MB_MAX = 65_536
"""The largest ``insert_mb`` (``DMX_CH_INSERT_MB``) accepted."""


def insert_bytes(insert_mb: int, queue_mb: int) -> int:
    """Most payload bytes per insert: ``insert_mb`` (``DMX_CH_INSERT_MB``), or with 0
    :func:`default_insert_bytes` of a queue of ``queue_mb`` (``DMX_CH_QUEUE_MB``)."""
    return insert_mb << 20 if insert_mb else default_insert_bytes(queue_mb << 20)


def default_insert_bytes(queue_bytes: int) -> int:
    """Most bytes per insert when none is set: an eighth of a queue of ``queue_bytes``, at
    most 128 MiB. Served on an H100, one unit each, with the drain's puts whole (about 78
    MB): ``store:hidden-states`` ran at 0.503 and 0.479 of stock with this limit (its
    inserts averaged 98 MiB) against 0.452 with a quarter of the queue, 256 MiB (226 MiB
    an insert), and 0.430 with 64 (78 MiB: each batch larger than the limit went alone);
    the owner's queue was not the limit there. With puts in 8 MiB pieces inserts fill up
    to 128 MiB, not yet measured served
    (``docs/evidence/2026-12-05-h100-topk-kernel-insert-size/``)."""
    return max(1, min(128 << 20, queue_bytes // 8))


@attrs.frozen
class StoreConfig:
    """A resolved store target and the sink's client and batching settings.

    Attributes:
        kind: embedded, server or none.
        path: absolute directory of the embedded store ("" otherwise).
        host / port / secure: the server (HTTP 8123, HTTPS when ``secure``).
        database / table: where records go (``default`` / ``offload``); the runs and
            manifest tables sit beside ``table`` in the same database.
        user / password: server credentials.
        compression: client wire compression (``lz4``, ``zstd``, ``none``).
        insert_rows: most records per insert.
        insert_mb: most payload MiB per insert, unless one batch alone holds more; 0:
            :meth:`insert_bytes` decides.
        queue_mb: bound of the sink's queue; ``put`` blocks beyond it (never drops).
        writers: inserting threads, each with its own client (inserts run in parallel;
            the embedded engine releases the GIL while it works).
        flush_timeout_us: longest a partial insert batch waits before it is sent.
        timeout_s: longest one request to a ClickHouse server (opening, DDL, one insert
            attempt) may wait for an answer; connecting waits at most 5 s of it.
    """

    kind: StoreKind
    path: str = ""
    host: str = ""
    port: int = 8123
    secure: bool = False
    database: str = "default"
    table: str = "offload"
    user: str = "default"
    password: str = attrs.field(default="", repr=False)
    compression: str = "lz4"
    insert_rows: int = 131_072
    insert_mb: int = 0
    queue_mb: int = 1024
    writers: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    flush_timeout_us: int = 400_000
    timeout_s: int = 30

    @property
    def insert_bytes(self) -> int:
        """Most payload bytes per insert: ``insert_mb``, or by default an eighth of the
        queue, at most 128 MiB (:func:`default_insert_bytes`). The queue's bound counts
        inserts in flight too: four writers' inserts fill half of it by default."""
        return insert_bytes(self.insert_mb, self.queue_mb)

    @property
    def url(self) -> str:
        """The target as a URL (no credentials): ``chdb:///path``, ``http://h:p/db``, ``none``."""
        if self.kind is StoreKind.EMBEDDED:
            return f"chdb://{self.path}"
        if self.kind is StoreKind.NONE:
            return "none"
        scheme = "https" if self.secure else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        return f"{scheme}://{host}:{self.port}/{self.database}"
