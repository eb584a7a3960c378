"""Opening clickhouse-connect clients on a store, and mapping their errors.

One client API, two targets: ``chdb:///abs/path`` (the embedded engine, in this
process) and a ClickHouse server over HTTP(S). clickhouse-connect 1.12.0 picks its chdb
backend for ``interface="chdb"`` (or a ``chdb:`` DSN): ``ChdbClient`` opens one
``chdb.Connection`` handle per client. Facts this module relies on (checked on
chdb-core 26.9.0, see docs/storage.md):

* one process per directory: the engine holds ``flock`` on ``<path>/status`` (which
  names the owning PID) until the last client of the process closes;
* several clients in ONE process on the same path are fine (each has its own handle,
  all share the engine); a client on a different path fails while any is open;
* after every client closed, the process may open another path.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

__all__ = [
    "ClientFactory",
    "close_quietly",
    "connect",
    "error_code",
    "is_transient",
    "store_error",
    "too_many_parts",
    "wire_compression",
]

log = structlog.get_logger(__name__)

ClientFactory = Callable[[StoreConfig], "Client"]
"""Opens a client on a store (the seam tests use to inject faults)."""

# ClickHouse error codes worth retrying: timeouts, network trouble, overload. Not
# TOO_MANY_PARTS (252): the sink waits for merges instead (see too_many_parts).
_TRANSIENT_CODES = frozenset(
    {
        159,  # TIMEOUT_EXCEEDED
        202,  # TOO_MANY_SIMULTANEOUS_QUERIES
        209,  # SOCKET_TIMEOUT
        210,  # NETWORK_ERROR
        241,  # MEMORY_LIMIT_EXCEEDED
        242,  # TABLE_IS_READ_ONLY
        319,  # UNKNOWN_STATUS_OF_INSERT
        425,  # SYSTEM_ERROR
        999,  # KEEPER_EXCEPTION
    }
)
_NOT_ENOUGH_SPACE = 243
_TOO_MANY_PARTS = 252
_CODE = re.compile(r"\bCode:\s*(\d+)")
_AUTH_CODES = frozenset({192, 193, 194, 516})  # UNKNOWN_USER, WRONG_PASSWORD, ..., AUTH FAILED


def connect(config: StoreConfig, *, create: bool = True, compress: str | None = None) -> Client:
    """Open a client on the store ``config`` names.

    Args:
        config: an embedded or server store.
        create: for the embedded store, create the directory when missing (the sink);
            readers pass False and get an error for a missing store instead.
        compress: a server client's compression (``lz4``, ``zstd``, ``gzip``; from
            :func:`wire_compression`): ``insert_arrow`` compresses its Arrow buffers with
            lz4 or zstd, and answers may come compressed. None: plain.

    Raises:
        StoreError: the directory cannot be created or is locked by another process,
            the server is unreachable, or the credentials are refused.
    """
    import clickhouse_connect

    if config.kind is StoreKind.EMBEDDED:
        path = _prepare_directory(config.path, create=create)
        try:
            return clickhouse_connect.get_client(interface="chdb", path=path)
        except Exception as exc:
            raise _embedded_open_error(path, exc) from exc
    if config.kind is StoreKind.SERVER:
        try:
            return clickhouse_connect.get_client(
                host=config.host,
                port=config.port,
                username=config.user,
                password=config.password,
                secure=config.secure,
                compress=compress or False,
                connect_timeout=min(5, config.timeout_s),
                send_receive_timeout=config.timeout_s,
            )
        except Exception as exc:
            raise _server_open_error(config, exc) from exc
    msg = f"store kind {config.kind.value!r} has no client (url {config.url})"
    raise StoreError(msg)


def _prepare_directory(path: str, *, create: bool) -> str:
    if not path or not os.path.isabs(path):
        msg = f"the embedded capture store needs an absolute directory, got {path!r}"
        raise StoreError(msg)
    if not os.path.isdir(path):
        if not create:
            msg = f"no capture store at {path} (the directory does not exist)"
            raise StoreError(msg)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            msg = f"cannot create the capture store directory {path}: {exc.strerror or exc}"
            raise StoreError(msg) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        msg = f"the capture store directory {path} is not writable"
        raise StoreError(msg)
    entries = os.listdir(path)
    if "metadata" not in entries and (entries or not create):
        why = "it holds other files" if entries else "it is empty"
        msg = (f"{path} is not a capture store ({why}); a capture creates one in a new or "
               "empty directory")
        raise StoreError(msg)
    owner = _lock_owner(path)
    if owner is not None:
        msg = (
            f"the capture store {path} is locked by another process (pid {owner}); the "
            f"embedded engine admits one process per directory: stop that process or "
            f"close its store first"
        )
        raise StoreError(msg)
    return os.path.realpath(path)


def _lock_owner(path: str) -> str | None:
    """The PID holding ``<path>/status`` when it is another process, else None."""
    status = os.path.join(path, "status")
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return None
    try:
        with os.fdopen(os.dup(fd), encoding="utf-8", errors="replace") as f:
            text = f.read()
        pid = next(
            (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("PID:")),
            "?",
        )
        if pid == str(os.getpid()):
            return None  # this process owns the engine: opening another client is fine
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return pid
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None  # a stale status file left by a process that died
    finally:
        os.close(fd)


def _embedded_open_error(path: str, exc: Exception) -> StoreError:
    text = str(exc)
    if "already initialized with path" in text:
        other = text.split("already initialized with path", 1)[1].split(",", 1)[0].strip(" '")
        msg = (
            f"cannot open the capture store {path}: this process already has the embedded "
            f"store {other} open (one directory per process); close it first"
        )
        return StoreError(msg)
    owner = _lock_owner(path)
    if owner is not None:
        msg = f"the capture store {path} is locked by another process (pid {owner})"
        return StoreError(msg)
    return StoreError(f"cannot open the capture store {path}: {_first_line(text)}")


def _server_open_error(config: StoreConfig, exc: Exception) -> StoreError:
    from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

    if isinstance(exc, OperationalError):
        msg = f"cannot reach the ClickHouse server at {config.url}: {_first_line(str(exc))}"
    elif isinstance(exc, DatabaseError) and getattr(exc, "code", None) in _AUTH_CODES:
        msg = f"ClickHouse at {config.url} refused user {config.user!r}: {_first_line(str(exc))}"
    else:
        msg = f"cannot open ClickHouse at {config.url}: {_first_line(str(exc))}"
    return StoreError(msg)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return line[:500]


def error_code(exc: BaseException) -> int | None:
    """The ClickHouse error code of ``exc``: clickhouse-connect's ``code`` attribute, or the
    ``Code: NNN`` the embedded engine's errors (``chdb.ChdbError``, a ``RuntimeError``)
    start their text with; None for other errors."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    if isinstance(exc, RuntimeError):
        found = _CODE.search(str(exc))
        if found:
            return int(found.group(1))
    return None


def too_many_parts(exc: BaseException) -> bool:
    """Whether ``exc`` is ClickHouse's TOO_MANY_PARTS: inserts outran merges."""
    return error_code(exc) == _TOO_MANY_PARTS


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the store's disk is full (ENOSPC, or ClickHouse's
    NOT_ENOUGH_SPACE), wherever in its chain of causes."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if error_code(seen) == _NOT_ENOUGH_SPACE:
            return True
        text = str(seen)
        if "No space left on device" in text or "NOT_ENOUGH_SPACE" in text:
            return True
        seen = seen.__cause__
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether an error may go away on retry (network, timeouts, overload); a full disk
    does not."""
    from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

    if disk_full(exc):
        return False
    if isinstance(exc, OperationalError):  # the connection, unless the server answered
        code = error_code(exc)  # with an error of its own that no retry changes
        return code is None or code in _TRANSIENT_CODES
    if isinstance(exc, OSError | TimeoutError):
        return True
    if isinstance(exc, DatabaseError | RuntimeError):
        return error_code(exc) in _TRANSIENT_CODES
    return False


def store_error(what: str, exc: BaseException, config: StoreConfig | None = None) -> StoreError:
    """A :class:`StoreError` for a failed operation (raise it ``from exc``). A full disk
    is named as such, with the store and the space left on it."""
    detail = f"{type(exc).__name__}: {_first_line(str(exc))}"
    if config is not None and disk_full(exc):
        return StoreError(f"{what}: the disk of the capture store {config.url} is full "
                          f"({_free_space(config)}); {detail}")
    return StoreError(f"{what}: {detail}")


def _free_space(config: StoreConfig) -> str:
    if config.kind is not StoreKind.EMBEDDED:
        return "free space on the server unknown here"
    try:
        free = shutil.disk_usage(config.path).free
    except OSError:
        return "free space unknown"
    return f"{free / (1 << 20):,.0f} MiB free on {config.path}"


def close_quietly(client: Client | None) -> None:
    """Close a client; a failure to close is logged, not raised."""
    if client is None:
        return
    try:
        client.close()
    except Exception as exc:  # closing is best effort: the data is already durable
        log.warning("store.close_failed", error=str(exc))


_COMPRESSIONS = {"lz4": "lz4", "true": "lz4", "zstd": "zstd", "gzip": "gzip"}


def wire_compression(config: StoreConfig) -> str | None:
    """How the sink compresses inserts to a server (None: plain; always None for the
    embedded engine, which reads the Arrow table in memory).

    Raises:
        StoreError: an unsupported ``compression`` setting.
    """
    if config.kind is not StoreKind.SERVER or config.compression in {"", "none", "false"}:
        return None
    try:
        return _COMPRESSIONS[config.compression]
    except KeyError:
        msg = (
            f"unsupported wire compression {config.compression!r}; accepted: lz4, zstd, gzip, none"
        )
        raise StoreError(msg) from None

