"""Typed settings, parsed from ``DMX_*`` variables or ``dmx_*`` keywords.

One table (ARCHITECTURE.md "Settings"); defaults are ours, not DMI's. The main process
parses and *resolves* them once (absolute store path, run id) and hands the resolved
values to the scheduler as ``DMX_*`` variables (:meth:`Settings.to_env`), so both sides
agree. Every invalid value is refused with the variable, the value and what is accepted.
"""

from __future__ import annotations

import enum
import os
import posixpath
import re
import secrets
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

import attrs

from dmi_sglang.domain.capacity import ARENA_SLOTS_BUDGET, MIB, RING_MB_MAX
from dmi_sglang.domain.hooks import HookSelection, parse_selection
from dmi_sglang.domain.store_config import (
    INSERT_MB_MAX,
    StoreConfig,
    StoreKind,
    insert_bytes,
)
from dmi_sglang.errors import ConfigurationError

TOPK_KERNELS = ("auto", "none", "triton", "flashinfer")
"""``DMX_TOPK_KERNEL``'s values: which selection ``final_logits:topk(K)`` runs (none:
``torch.topk`` over the chunk maxima, then over the chosen chunks, the default; auto:
flashinfer where it works at start-up, else none)."""

__all__ = [
    "PREFIX",
    "STORE_PLACE",
    "STORE_TARGET",
    "STORE_URL_FORMS",
    "TOPK_KERNELS",
    "Enable",
    "Settings",
    "StoreUrl",
    "engine_started",
    "ignored_variables",
    "monitoring_requested",
    "redact_url",
]

PREFIX = "DMX_"
NATIVE_PORT = 9000
"""ClickHouse's native TCP port (DMI's ``DMX_DB_PORT`` default); refused with a hint."""

LEGACY_IGNORED: Mapping[str, str] = {
    "CH_PARALLELISM": "DMI's insert parallelism; here DMX_CH_WRITERS sets the inserting threads",
    "CH_MAX_BATCH_ITEMS": "DMI's insert batch size; here DMX_CH_INSERT_ROWS sets it",
    "CH_MAX_BATCH_BYTES": "DMI's insert batch bytes; here DMX_CH_INSERT_MB sets them",
    "STEP_DEBUG": "DMI's per-step debug switch; it has no counterpart here",
    "DRAIN_COPY_THREADS": "decode rows are coalesced on the GPU now; no host copy threads",
}
"""Variables of the original DMI integration, and retired ones of ours, that change
nothing stored: accepted, each with one "setting ignored" log line
(:func:`ignored_variables`). DMI's ``DMX_NULL_MODE`` does change what is stored: it maps
to ``DMX_DB_URL=none`` (:meth:`Settings.from_env`)."""

_GENERATED_IDS: set[str] = set()
"""Run ids :meth:`Settings.resolve` generated in this process."""
_SPENT_IDS: set[str] = set()
"""Generated run ids an engine of this process started with: stale in ``DMX_MODEL_ID``."""


def engine_started(run_id: str) -> None:
    """An engine of this process starts with ``run_id``. When this process generated it,
    a later ``DMX_MODEL_ID`` holding it is an earlier engine's leftover, not a choice: the
    next engine gets a fresh id instead of reusing it."""
    if run_id in _GENERATED_IDS:
        _SPENT_IDS.add(run_id)


class Enable(enum.Enum):
    """``DMX_SGLANG_ENABLE``."""

    AUTO = "auto"
    """Monitor when DMIEngine is used or any other ``DMX_*`` setting is present."""
    ON = "1"
    OFF = "0"


def _conv(
    parse: Callable[[str], Any], accepted: str, shown: Callable[[str], str] = repr,
    *, strip: bool = True,
) -> Callable[[str, str], Any]:
    def convert(name: str, text: str) -> Any:
        try:
            return parse(text.strip() if strip else text)
        except _MisplacedValueError as exc:  # a value meant for something else: what to do instead
            msg = f"{name}={shown(text)}: {exc}"
            raise ConfigurationError(msg) from None
        except (ValueError, ConfigurationError) as exc:
            detail = f" ({exc})" if isinstance(exc, ConfigurationError) else ""
            msg = f"{name}={shown(text)} is invalid; accepted: {accepted}{detail}"
            raise ConfigurationError(msg) from None

    return convert


def _fraction(text: str) -> float:
    """A number from 0 to 1 (``DMX_REQUEST_SAMPLE``)."""
    value = float(text)
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise ValueError(text)
    return value


def _bounded(low: int, high: int) -> tuple[Callable[[str], int], str]:
    """A parser of integers in ``[low, high]`` and the words that say so."""

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError(text)
        return value

    return parse, f"an integer from {low:,} to {high:,}"


STORE_TARGET = frozenset({"DB_URL", "DB_HOST", "NULL_MODE"})
"""Settings that name where captures go: a keyword (or a ``--db``) naming one replaces
the variables of :data:`STORE_PLACE` (:meth:`Settings.from_kwargs`)."""
STORE_PLACE = STORE_TARGET | {"DB_PORT", "DB_DATABASE"}
"""The variables that say together where captures go (``DMX_CH_SECURE`` is not one of
them: a URL that contradicts it is refused, never quietly made plain HTTP)."""

STORE_URL_FORMS = ("chdb:///absolute/path, http(s)://[user[:password]@]host[:port]"
                   "[/database], or none")
"""The store URLs accepted (``DMX_DB_URL``, ``--db``), in words."""


class _MisplacedValueError(ConfigurationError):
    """A value that is valid elsewhere but not here (ClickHouse's native port): its
    message says what to use instead, so the range accepted is left out."""


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(text)
    if value == NATIVE_PORT:
        msg = (f"{NATIVE_PORT} is ClickHouse's native-protocol port, DMI's default; "
               "dmi-sglang speaks ClickHouse's HTTP protocol, by default on 8123")
        raise _MisplacedValueError(msg)
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


def _enable(text: str) -> Enable:
    low = text.lower()
    if low == "auto":
        return Enable.AUTO
    return Enable.ON if _bool(low) else Enable.OFF


RUN_ID_MAX = 200
"""The longest run id (``DMX_MODEL_ID``) accepted, and generated."""


def _run_id(text: str) -> str:
    if not re.fullmatch(rf"[A-Za-z0-9][A-Za-z0-9._:@+=-]{{0,{RUN_ID_MAX - 1}}}", text):
        raise ValueError(text)
    return text


def _name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", text):
        raise ValueError(text)
    return text


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(text)
        return text.lower()

    return parse


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]")


def _host(text: str) -> str | None:
    if not text:
        return None
    if text.lower() == "none":
        return "none"
    if "@" in text:
        msg = ("credentials go in DMX_CH_USER / DMX_CH_PASSWORD or in a DMX_DB_URL, not in "
               "the host")
        raise ConfigurationError(msg)
    if text.count(":") >= 2 and not text.startswith("["):  # a bare IPv6 address
        text = f"[{text}]"
    if ":" in text and not text.startswith("["):
        msg = "the port goes in DMX_DB_PORT, not in the host"
        raise ConfigurationError(msg)
    if not _HOST.fullmatch(text):
        raise ValueError(text)
    return text


def _split_userinfo(url: str) -> tuple[str, str | None, str]:
    """``(scheme://, userinfo or None, the rest)``, splitting at the LAST ``@`` so that a
    password holding ``@``, ``/``, ``#`` or ``?`` unencoded is still taken whole."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return (scheme + sep, None, rest)
    userinfo, _, host = rest.rpartition("@")
    return (scheme + sep, userinfo, host)


_SCHEME_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _no_query(text: str) -> str:
    """``text`` with what follows its first ``?`` or ``#`` hidden (a query may hold
    ``password=``)."""
    cut = min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=-1)
    return text if cut < 0 else text[: cut + 1] + "***"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs, errors and the runs table),
    and any query or fragment hidden.

    A malformed URL (no ``scheme://``) that still holds an ``@`` may carry
    ``user:password`` before it in any form (``user:pw@host``, ``http:/user:pw@host``,
    ``user:p://w@host``): everything between a leading scheme and the last ``@`` is
    hidden then."""
    head, userinfo, rest = _split_userinfo(url)
    if head.lower() == "chdb://":  # a path holds no password, whatever it holds
        return head + _no_query(url[len(head):])
    if not _SCHEME.fullmatch(head):
        if "@" not in url:
            return _no_query(url)
        before, _, after = url.rpartition("@")
        scheme = _SCHEME_PREFIX.match(before)
        return f"{scheme.group(0) if scheme else ''}***@{_no_query(after)}"
    if userinfo is None:
        return head + _hidden_port(_no_query(rest))
    if ":" not in userinfo:
        return f"{head}{userinfo}@{_no_query(rest)}"
    return f"{head}{userinfo.partition(':')[0]}:***@{_no_query(rest)}"


def _hidden_port(rest: str) -> str:
    """``host:port/...`` with a port that is not a number hidden: ``user:password/...``
    whose ``@host`` was left out reads as a host and a port."""
    netloc, slash, path = rest.partition("/")
    host, colon, port = netloc.rpartition(":")
    if not colon or netloc.startswith("[") or port.isdigit() or not port:
        return rest
    return f"{host}:***{slash}{path}"


def _shown_url(text: str) -> str:
    return repr(redact_url(text))


@attrs.frozen
class StoreUrl:
    """A parsed ``DMX_DB_URL``. Credentials, when the URL carries them, are kept here
    (``password`` never in a repr)."""

    kind: StoreKind
    path: str = ""
    host: str = ""
    port: int = 0
    secure: bool = False
    database: str | None = None
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> StoreUrl:
        """Parse ``none``, ``chdb:///abs/path`` or ``http(s)://[user[:pw]@]host[:port][/db]``.

        Raises:
            ConfigurationError: anything else (the message never shows a password).
        """
        shown = redact_url(url)
        if url.lower() == "none":
            return cls(StoreKind.NONE)
        head, userinfo, rest = _split_userinfo(url)
        if head.lower() == "chdb://":  # a path: an '@' in it is part of it
            userinfo, rest = None, url[len(head):]
        bare = head + rest if userinfo is not None else url
        if "?" in bare or "#" in bare:
            msg = (f"store URL {shown!r} has a query or a fragment ('?' or '#'): neither is "
                   "accepted (a path or a database name holding them cannot be given; TLS: "
                   "https://, the port after the host)")
            raise ConfigurationError(msg)
        parts = _urlsplit(bare, shown)
        if parts.scheme == "chdb":
            return cls._embedded(parts, shown)
        if parts.scheme in ("http", "https") and parts.hostname:
            return cls._server(parts, userinfo, shown)
        msg = f"unsupported store URL {shown!r}; accepted: {STORE_URL_FORMS}"
        raise ConfigurationError(msg)

    @classmethod
    def _embedded(cls, parts: SplitResult, shown: str) -> StoreUrl:
        path = posixpath.normpath(parts.path) if parts.path else ""
        if parts.netloc or not path.startswith("/"):
            msg = f"embedded store URL {shown!r} needs an absolute path: chdb:///abs/path"
            raise ConfigurationError(msg)
        if path == "/":
            msg = f"embedded store URL {shown!r} names /: give the store a directory"
            raise ConfigurationError(msg)
        return cls(StoreKind.EMBEDDED, path=path)

    @classmethod
    def _server(cls, parts: SplitResult, userinfo: str | None, shown: str) -> StoreUrl:
        hostname = parts.hostname or ""
        secure = parts.scheme == "https"
        user = password = None
        if userinfo is not None:  # percent-encoded characters are decoded, as in URLs
            raw_user, has_password, raw_password = userinfo.partition(":")
            user = unquote(raw_user)
            password = unquote(raw_password) if has_password else None
        port = parts.port
        if port is None:
            port = 8443 if secure else 8123
        elif not 0 < port < 65536:
            msg = f"bad port {port} in {shown!r}: 1 to 65535"
            raise ConfigurationError(msg)
        elif port == NATIVE_PORT:
            msg = (f"port {NATIVE_PORT} in {shown!r} is ClickHouse's native-protocol port, "
                   "DMI's default; dmi-sglang speaks ClickHouse's HTTP protocol, by default "
                   "on 8123 (8443 with https://)")
            raise ConfigurationError(msg)
        try:
            _host(hostname)  # (an IPv6 address: urlsplit took its brackets, _host adds them)
        except ValueError:
            msg = f"bad host {hostname!r} in {shown!r}"
            raise ConfigurationError(msg) from None
        database = parts.path.strip("/") or None
        if database is not None:
            try:
                _name(database)
            except ValueError:
                msg = (f"bad database name {database!r} in {shown!r}: letters, digits "
                       "and _, not starting with a digit")
                raise ConfigurationError(msg) from None
        return cls(StoreKind.SERVER, host=hostname, port=port, secure=secure,
                   database=database, user=user, password=password)


def _urlsplit(url: str, shown: str) -> SplitResult:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        msg = f"malformed store URL {shown!r}: {exc}"
        raise ConfigurationError(msg) from None
    try:
        parts.port  # noqa: B018 -- validates the port now
    except ValueError:  # its text may be a password (user:password without @host)
        msg = f"malformed store URL {shown!r}: the port after the host is not a number"
        raise ConfigurationError(msg) from None
    return parts


def _db_url(text: str) -> str:
    StoreUrl.parse(text)  # validates
    return text


@attrs.frozen
class _Var:
    field: str
    convert: Callable[[str, str], Any]
    render: Callable[[Any], str] = str
    secret: bool = False
    redact: Callable[[str], str] | None = None
    """How the value is shown where secrets must not be (None: as it is)."""


_ACC_BOOL = "1/0 (or true/false, yes/no, on/off)"

_VARS: dict[str, _Var] = {
    "SGLANG_ENABLE": _Var("enable", _conv(_enable, "auto, 1, 0"), lambda e: e.value),
    "MODEL_ID": _Var(
        "model_id",
        _conv(_run_id, "1-200 letters, digits and ._:@+=- starting with a letter or digit"),
    ),
    "HOOK_SELECTION": _Var(
        "hook_selection",
        _conv(
            lambda t: str(parse_selection(t)),
            "hook names, presets and name@N-M layer ranges, comma-separated",
        ),
    ),
    "DB_URL": _Var(
        "db_url",
        _conv(_db_url, STORE_URL_FORMS, _shown_url),
        redact=redact_url,
    ),
    "DB_HOST": _Var("db_host", _conv(_host, "a host name or IP address, or none",
                                     _shown_url)),
    "DB_PORT": _Var("db_port", _conv(_port, "a TCP port 1-65535")),
    "DB_DATABASE": _Var("db_database", _conv(_name, "a ClickHouse identifier")),
    "DB_TABLE": _Var("db_table", _conv(_name, "a ClickHouse identifier")),
    "CH_USER": _Var("ch_user", _conv(lambda t: t, "a user name")),
    "CH_PASSWORD": _Var("ch_password", _conv(lambda t: t, "any string", strip=False),
                        secret=True),  # taken as given: spaces may be part of it
    "CH_SECURE": _Var("ch_secure", _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"),
    "CH_COMPRESSION": _Var(
        "ch_compression", _conv(_choice("lz4", "zstd", "gzip", "none"),
                                "lz4, zstd, gzip, none")
    ),
    "CH_INSERT_ROWS": _Var("ch_insert_rows", _conv(*_bounded(1, 1_000_000))),
    "CH_INSERT_MB": _Var("ch_insert_mb", _conv(*_bounded(0, INSERT_MB_MAX))),
    "CH_QUEUE_MB": _Var("ch_queue_mb", _conv(*_bounded(1, 65_536))),
    "CH_WRITERS": _Var("ch_writers", _conv(*_bounded(1, 64))),
    "OWNER_RING_MB": _Var("owner_ring_mb", _conv(*_bounded(0, 65_536))),
    "CH_TIMEOUT_S": _Var("ch_timeout_s", _conv(*_bounded(1, 3600))),
    "RING_PAYLOAD_MB": _Var("ring_payload_mb", _conv(*_bounded(1, RING_MB_MAX))),
    "RING_PINNED_MB": _Var("ring_pinned_mb", _conv(*_bounded(1, RING_MB_MAX))),
    "RING_TASK_ENTRIES": _Var("ring_task_entries", _conv(*_bounded(1, 16_777_216))),
    "DRAIN_FLUSH_TIMEOUT_US": _Var(
        "drain_flush_timeout_us", _conv(*_bounded(1, 60_000_000))
    ),
    "DRAIN_LINGER_US": _Var("drain_linger_us", _conv(*_bounded(0, 1_000_000))),
    "DRAIN_GIL_SLICE_US": _Var("drain_gil_slice_us", _conv(*_bounded(0, 1_000_000))),
    "TOPK_CHUNK": _Var("topk_chunk", _conv(*_bounded(0, 16_777_216))),
    "TOPK_KERNEL": _Var(
        "topk_kernel", _conv(_choice(*TOPK_KERNELS), ", ".join(TOPK_KERNELS))
    ),
    "GRAPH_SIDE_STREAM": _Var(
        "graph_side_stream", _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"
    ),
    "DRAIN_WINDOW_MB": _Var("drain_window_mb", _conv(*_bounded(16, 16_384))),
    "ARENA_SLOTS_MB": _Var("arena_slots_mb", _conv(*_bounded(0, 16_384))),
    "DRAIN_COPY_PIECE_MB": _Var("drain_copy_piece_mb", _conv(*_bounded(0, 16_384))),
    "DRAIN_COPY_AHEAD": _Var("drain_copy_ahead", _conv(*_bounded(0, 1_024))),
    "DRAIN_COPY_KERNEL": _Var("drain_copy_kernel", _conv(*_bounded(0, 1_024))),
    "DRAIN_COPY_GAPS": _Var(
        "drain_copy_gaps", _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"
    ),
    "PLAN_TOK_S": _Var("plan_tok_s", _conv(*_bounded(1, 100_000_000))),
    "REQUEST_SAMPLE": _Var("request_sample", _conv(_fraction, "a number from 0 to 1"),
                           lambda v: repr(float(v)).removesuffix(".0")),  # 0, 0.1, 1
    "STORE_MAX_GB": _Var("store_max_gb", _conv(*_bounded(0, 1_000_000))),
    "GPU_PADDING_STRIP": _Var(
        "gpu_padding_strip", _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"
    ),
    "ALLOW_PREFIX_CACHE": _Var(
        "allow_prefix_cache", _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"
    ),
    "SGLANG_PRELOAD_LIBSTDCXX": _Var(
        "preload_libstdcxx", _conv(_choice("auto", "0", "1"), "auto, 0, 1")
    ),
}


@attrs.frozen
class Settings:
    """Every ``DMX_*`` setting, typed. ``None`` marks values resolved later.

    Build with :meth:`from_env` / :meth:`from_kwargs`, then :meth:`resolve` once in the
    main process; :meth:`to_env` carries the resolved values to the scheduler.
    """

    enable: Enable = Enable.AUTO
    model_id: str | None = None
    hook_selection: str = "sglang-full"
    db_url: str | None = attrs.field(
        default=None, repr=lambda u: repr(None if u is None else redact_url(u)))
    db_host: str | None = None
    db_port: int | None = None
    """None: 8123, or 8443 with ``ch_secure`` (ClickHouse's HTTP and HTTPS ports)."""
    db_database: str = "default"
    db_table: str = "offload"
    ch_user: str = "default"
    ch_password: str = attrs.field(default="", repr=False)
    ch_secure: bool = False
    ch_compression: str = "lz4"
    ch_insert_rows: int = 131_072
    ch_insert_mb: int = 0
    ch_queue_mb: int = 1024
    ch_writers: int = 4
    owner_ring_mb: int = 0
    ch_timeout_s: int = 30
    ring_payload_mb: int = 1024
    ring_pinned_mb: int = 1024
    ring_task_entries: int = 65536
    drain_flush_timeout_us: int = 400_000
    drain_linger_us: int = 30_000
    drain_gil_slice_us: int = 200
    topk_chunk: int = 128
    topk_kernel: str = "none"
    graph_side_stream: bool = True
    drain_window_mb: int = 512
    arena_slots_mb: int = ARENA_SLOTS_BUDGET // MIB
    drain_copy_piece_mb: int = 16
    drain_copy_ahead: int = 0
    drain_copy_kernel: int = 0
    drain_copy_gaps: bool = True
    plan_tok_s: int | None = None
    request_sample: float = 1.0
    store_max_gb: int = 0
    gpu_padding_strip: bool = True
    allow_prefix_cache: bool = False
    preload_libstdcxx: str = "auto"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Parse ``DMX_*`` variables (default: ``os.environ``).

        Raises:
            ConfigurationError: an unknown ``DMX_*`` variable or an invalid value.
        """
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        for key, text in source.items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX):]
            if name in LEGACY_IGNORED:
                continue
            if name == "NULL_MODE":
                _null_mode(text, source)
                if _bool(text.strip()):
                    values["db_url"] = "none"
                continue
            var = _VARS.get(name)
            if var is None:
                msg = f"unknown setting {key}; accepted: {', '.join(PREFIX + k for k in _VARS)}"
                raise ConfigurationError(msg)
            if text == "" and (_FIELDS[var.field].default is None or name == "SGLANG_ENABLE"):
                continue
            if var.field == "model_id" and text in _SPENT_IDS:
                continue  # an earlier engine's generated id (see engine_started)
            values[var.field] = var.convert(key, text)
        settings = cls(**values)
        settings._check_owner_ring()
        return settings

    def _check_owner_ring(self) -> None:
        """A shared ring (embedded store only) holds each batch until its insert: one
        smaller than two inserts fills before an insert is full, and every fill waits
        for the insert's linger."""
        insert = insert_bytes(self.ch_insert_mb, self.ch_queue_mb)
        least = -(-2 * insert // MIB)
        if 0 < self.owner_ring_mb < least and self._embedded_store():
            msg = (f"DMX_OWNER_RING_MB={self.owner_ring_mb} holds less than two inserts of "
                   f"{insert / MIB:g} MiB (DMX_CH_INSERT_MB, by default an eighth of "
                   f"DMX_CH_QUEUE_MB={self.ch_queue_mb}, at most 128); accepted: 0 (no shared "
                   f"ring) or at least {least}, or DMX_CH_INSERT_MB at most "
                   f"{max(1, self.owner_ring_mb // 2)}")
            raise ConfigurationError(msg)

    def _embedded_store(self) -> bool:
        """Captures go to the embedded store (the default, or a ``chdb://`` URL)."""
        if self.db_url is None:
            return self.db_host is None
        return StoreUrl.parse(self.db_url).kind is StoreKind.EMBEDDED

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, object], env: Mapping[str, str] | None = None
    ) -> Settings:
        """Parse ``dmx_*`` keywords over ``DMX_*`` variables (keywords win). A keyword
        naming where captures go (:data:`STORE_TARGET`) wins over every variable that
        says where (:data:`STORE_PLACE`): those are dropped, not combined with it."""
        merged = {k: v for k, v in (os.environ if env is None else env).items()
                  if k.startswith(PREFIX)}
        if any(k.upper()[len(PREFIX):] in STORE_TARGET and not _keeps_store(k, v)
               for k, v in kwargs.items()):
            merged = {k: v for k, v in merged.items() if k[len(PREFIX):] not in STORE_PLACE}
        for key, value in kwargs.items():
            name = key.upper()
            bare = name[len(PREFIX):]
            known = bare in _VARS or bare in LEGACY_IGNORED or bare == "NULL_MODE"
            if not name.startswith(PREFIX) or not known:
                accepted = ", ".join(f"dmx_{k.lower()}" for k in _VARS)
                msg = f"unknown keyword {key}; accepted: {accepted}"
                raise ConfigurationError(msg)
            merged[name] = _kwarg_text(value)
        return cls.from_env(merged)

    @property
    def selection(self) -> HookSelection:
        """The parsed hook selection."""
        return parse_selection(self.hook_selection)

    @property
    def prefix_cache_allowed(self) -> bool:
        """SGLang's radix cache may stay on: ``DMX_ALLOW_PREFIX_CACHE=1``, or a selection
        that needs no prompt position before the last one
        (:attr:`~dmi_sglang.domain.hooks.HookSelection.needs_prompt_positions`)."""
        return self.allow_prefix_cache or not self.selection.needs_prompt_positions

    @property
    def resolved(self) -> bool:
        """True once :meth:`resolve` filled the run id and the store URL."""
        return self.model_id is not None and self.db_url is not None

    def resolve(
        self,
        *,
        model_path: str,
        cwd: str | None = None,
        now: datetime | None = None,
        token: str | None = None,
    ) -> Settings:
        """Fill the run id and the store URL (idempotent on resolved settings).

        Args:
            model_path: the served model (its last path component names the run).
            cwd: base of the default embedded store (default: the current directory).
            now: the start time (default: now, UTC).
            token: six hex digits making the run id unique (default: random).
        """
        model_id = self.model_id
        if model_id is None:
            stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%S")
            base = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(model_path.rstrip("/")))
            suffix = f"-{stamp}-{token or secrets.token_hex(3)}"  # a long name is cut
            model_id = (base.lstrip("._-")[: RUN_ID_MAX - len(suffix)] or "model") + suffix
            _GENERATED_IDS.add(model_id)
        db_url = self.db_url
        if db_url is None:
            if self.db_host is not None:
                port = self.db_port or (8443 if self.ch_secure else 8123)
                db_url = "none" if self.db_host.lower() == "none" else (
                    f"http{'s' if self.ch_secure else ''}://{self.db_host}:{port}/"
                    f"{self.db_database}"
                )
            else:
                base_dir = os.path.abspath(cwd or os.getcwd())
                db_url = f"chdb://{posixpath.join(base_dir, 'dmi-captures')}"
        return attrs.evolve(self, model_id=model_id, db_url=db_url)

    def store(self) -> StoreConfig:
        """The store target and sink settings (needs resolved settings)."""
        if self.db_url is None:
            msg = "settings are not resolved: call Settings.resolve() first"
            raise ConfigurationError(msg)
        url = StoreUrl.parse(self.db_url)
        if url.kind is StoreKind.SERVER and self.ch_secure and not url.secure:
            msg = (f"DMX_CH_SECURE=1 contradicts the store URL {redact_url(self.db_url)!r} "
                   "(plain http://: its password would travel unencrypted); accepted: an "
                   "https:// URL, or DMX_CH_SECURE unset")
            raise ConfigurationError(msg)
        return StoreConfig(
            kind=url.kind,
            path=url.path,
            host=url.host,
            port=url.port,
            secure=url.secure,
            database=url.database or self.db_database,
            table=self.db_table,
            user=url.user if url.user is not None else self.ch_user,
            password=url.password if url.password is not None else self.ch_password,
            compression=self.ch_compression,
            insert_rows=self.ch_insert_rows,
            insert_mb=self.ch_insert_mb,
            queue_mb=self.ch_queue_mb,
            writers=self.ch_writers,
            flush_timeout_us=self.drain_flush_timeout_us,
            timeout_s=self.ch_timeout_s,
        )

    def to_env(self, *, include_secrets: bool = True) -> dict[str, str]:
        """Every setting as ``DMX_*`` variables (unset optional values are left out).

        ``include_secrets=False`` leaves passwords out, also those inside a store URL
        (for logs and the runs table)."""
        env: dict[str, str] = {}
        for key, var in _VARS.items():
            value = getattr(self, var.field)
            if value is None or (var.secret and not include_secrets):
                continue
            text = var.render(value)
            env[PREFIX + key] = text if include_secrets or var.redact is None else var.redact(text)
        return env


_FIELDS = attrs.fields_dict(Settings)
"""Each setting's field, by name: its default is the setting's."""


def _null_mode(text: str, source: Mapping[str, str]) -> None:
    """Check DMI's ``DMX_NULL_MODE`` (capture without persistence): a boolean that does
    not contradict the store settings; logs that ``0`` has no effect."""
    try:
        on = _bool(text.strip())
    except ValueError:
        msg = f"DMX_NULL_MODE={text!r} is invalid; accepted: {_ACC_BOOL}"
        raise ConfigurationError(msg) from None
    store = {k: source[k] for k in ("DMX_DB_URL", "DMX_DB_HOST")
             if source.get(k, "").strip().lower() not in ("", "none")}
    if on and store:
        named = ", ".join(f"{k}={redact_url(v)}" for k, v in store.items())
        msg = (f"DMX_NULL_MODE={text} (capture without storing) contradicts {named}; "
               "accepted: one of them (DMX_NULL_MODE=1 is DMX_DB_URL=none)")
        raise ConfigurationError(msg)


def ignored_variables(env: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """``(variable, why)`` for every variable of the original DMI integration in ``env``
    (default: ``os.environ``) that :meth:`Settings.from_env` accepts and ignores; the
    callers at the edges log each in one line."""
    source = os.environ if env is None else env
    found = [(k, LEGACY_IGNORED[k[len(PREFIX):]]) for k in sorted(source)
             if k.startswith(PREFIX) and k[len(PREFIX):] in LEGACY_IGNORED]
    null = source.get(PREFIX + "NULL_MODE", "").strip().lower()
    if null in _FALSE:
        found.append((PREFIX + "NULL_MODE", "0 is the default: captures are stored"))
    return tuple(found)


def _keeps_store(key: str, value: object) -> bool:
    """``dmx_null_mode`` off: it says nothing about where captures go (the exported
    store stays)."""
    return key.upper() == PREFIX + "NULL_MODE" and _kwarg_text(value).strip().lower() in _FALSE


def _kwarg_text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return ""
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def monitoring_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether SGLang processes should monitor, per ``DMX_SGLANG_ENABLE``.

    ``auto`` monitors when any other ``DMX_*`` variable is set (non-empty).

    Raises:
        ConfigurationError: ``DMX_SGLANG_ENABLE`` has an invalid value.
    """
    source = os.environ if env is None else env
    text = source.get(PREFIX + "SGLANG_ENABLE", "auto") or "auto"
    enable = _VARS["SGLANG_ENABLE"].convert(PREFIX + "SGLANG_ENABLE", text)
    if enable is Enable.AUTO:
        return any(
            k.startswith(PREFIX) and k != PREFIX + "SGLANG_ENABLE" and v
            for k, v in source.items()
        )
    return bool(enable is Enable.ON)
