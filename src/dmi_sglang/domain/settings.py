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
from urllib.parse import urlsplit

import attrs

from dmi_sglang.domain.hooks import HookSelection, parse_selection
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import ConfigurationError

__all__ = ["PREFIX", "Enable", "Settings", "monitoring_requested"]

PREFIX = "DMX_"


class Enable(enum.Enum):
    """``DMX_SGLANG_ENABLE``."""

    AUTO = "auto"
    """Monitor when DMIEngine is used or any other ``DMX_*`` setting is present."""
    ON = "1"
    OFF = "0"


def _conv(
    parse: Callable[[str], Any], accepted: str
) -> Callable[[str, str], Any]:
    def convert(name: str, text: str) -> Any:
        try:
            return parse(text.strip())
        except (ValueError, ConfigurationError) as exc:
            detail = f" ({exc})" if isinstance(exc, ConfigurationError) else ""
            msg = f"{name}={text!r} is invalid; accepted: {accepted}{detail}"
            raise ConfigurationError(msg) from None

    return convert


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _copy_threads(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 64:
        raise ValueError(text)
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(text)
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


def _run_id(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}", text):
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


def _db_url(text: str) -> str:
    store_from_url(text)  # validates
    return text


def store_from_url(url: str) -> tuple[StoreKind, str, str, int, bool, str | None]:
    """Split a ``DMX_DB_URL`` into (kind, path, host, port, secure, database or None).

    Raises:
        ConfigurationError: not ``none``, ``chdb:///abs/path`` or
            ``http(s)://host[:port][/db]``.
    """
    if url.lower() == "none":
        return StoreKind.NONE, "", "", 0, False, None
    parts = urlsplit(url)
    if parts.scheme == "chdb":
        path = parts.path
        if parts.netloc or not path.startswith("/"):
            msg = f"embedded store URL {url!r} needs an absolute path: chdb:///abs/path"
            raise ConfigurationError(msg)
        return StoreKind.EMBEDDED, posixpath.normpath(path), "", 0, False, None
    if parts.scheme in ("http", "https") and parts.hostname:
        secure = parts.scheme == "https"
        try:
            port = parts.port or (8443 if secure else 8123)
        except ValueError:
            msg = f"bad port in {url!r}"
            raise ConfigurationError(msg) from None
        database = parts.path.strip("/") or None
        if database is not None:
            _name(database)
        return StoreKind.SERVER, "", parts.hostname, port, secure, database
    msg = f"unsupported store URL {url!r}"
    raise ConfigurationError(msg)


@attrs.frozen
class _Var:
    field: str
    default: Any
    convert: Callable[[str, str], Any]
    render: Callable[[Any], str] = str
    secret: bool = False


_ACC_INT = "a positive integer"
_ACC_BOOL = "1/0 (or true/false, yes/no, on/off)"

_VARS: dict[str, _Var] = {
    "SGLANG_ENABLE": _Var("enable", Enable.AUTO, _conv(_enable, "auto, 1, 0"), lambda e: e.value),
    "MODEL_ID": _Var(
        "model_id",
        None,
        _conv(_run_id, "1-200 letters, digits and ._:@+=- starting with a letter or digit"),
    ),
    "HOOK_SELECTION": _Var(
        "hook_selection",
        "sglang-full",
        _conv(
            lambda t: str(parse_selection(t)),
            "hook names, presets and name@N-M layer ranges, comma-separated",
        ),
    ),
    "DB_URL": _Var(
        "db_url",
        None,
        _conv(_db_url, "chdb:///absolute/path, http(s)://host[:port][/database], or none"),
    ),
    "DB_HOST": _Var("db_host", None, _conv(lambda t: t or None, "a host name, or none")),
    "DB_PORT": _Var("db_port", 8123, _conv(_port, "a TCP port 1-65535")),
    "DB_DATABASE": _Var("db_database", "default", _conv(_name, "a ClickHouse identifier")),
    "DB_TABLE": _Var("db_table", "offload", _conv(_name, "a ClickHouse identifier")),
    "CH_USER": _Var("ch_user", "default", _conv(lambda t: t, "a user name")),
    "CH_PASSWORD": _Var("ch_password", "", _conv(lambda t: t, "any string"), secret=True),
    "CH_SECURE": _Var("ch_secure", False, _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"),
    "CH_COMPRESSION": _Var(
        "ch_compression", "lz4", _conv(_choice("lz4", "zstd", "none"), "lz4, zstd, none")
    ),
    "CH_INSERT_ROWS": _Var("ch_insert_rows", 4096, _conv(_positive_int, _ACC_INT)),
    "CH_QUEUE_MB": _Var("ch_queue_mb", 1024, _conv(_positive_int, _ACC_INT)),
    "CH_WRITERS": _Var("ch_writers", 2, _conv(_positive_int, _ACC_INT)),
    "RING_PAYLOAD_MB": _Var("ring_payload_mb", 1024, _conv(_positive_int, _ACC_INT)),
    "RING_PINNED_MB": _Var("ring_pinned_mb", 1024, _conv(_positive_int, _ACC_INT)),
    "RING_TASK_ENTRIES": _Var("ring_task_entries", 65536, _conv(_positive_int, _ACC_INT)),
    "DRAIN_FLUSH_TIMEOUT_US": _Var(
        "drain_flush_timeout_us", 100_000, _conv(_positive_int, _ACC_INT)
    ),
    "DRAIN_COPY_THREADS": _Var(
        "drain_copy_threads", 0, _conv(_copy_threads, "0 (automatic) or 1-64")
    ),
    "GPU_PADDING_STRIP": _Var(
        "gpu_padding_strip", True, _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"
    ),
    "ALLOW_PREFIX_CACHE": _Var(
        "allow_prefix_cache", False, _conv(_bool, _ACC_BOOL), lambda b: "1" if b else "0"
    ),
    "SGLANG_PRELOAD_LIBSTDCXX": _Var(
        "preload_libstdcxx", "auto", _conv(_choice("auto", "0", "1"), "auto, 0, 1")
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
    db_url: str | None = None
    db_host: str | None = None
    db_port: int = 8123
    db_database: str = "default"
    db_table: str = "offload"
    ch_user: str = "default"
    ch_password: str = attrs.field(default="", repr=False)
    ch_secure: bool = False
    ch_compression: str = "lz4"
    ch_insert_rows: int = 4096
    ch_queue_mb: int = 1024
    ch_writers: int = 2
    ring_payload_mb: int = 1024
    ring_pinned_mb: int = 1024
    ring_task_entries: int = 65536
    drain_flush_timeout_us: int = 100_000
    drain_copy_threads: int = 0
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
            var = _VARS.get(key[len(PREFIX):])
            if var is None:
                msg = f"unknown setting {key}; accepted: {', '.join(PREFIX + k for k in _VARS)}"
                raise ConfigurationError(msg)
            if text == "" and var.default is None:
                continue
            values[var.field] = var.convert(key, text)
        return cls(**values)

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, object], env: Mapping[str, str] | None = None
    ) -> Settings:
        """Parse ``dmx_*`` keywords over ``DMX_*`` variables (keywords win)."""
        merged = {k: v for k, v in (os.environ if env is None else env).items()
                  if k.startswith(PREFIX)}
        for key, value in kwargs.items():
            name = key.upper()
            if not name.startswith(PREFIX) or name[len(PREFIX):] not in _VARS:
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
            model_id = f"{base.lstrip('._-') or 'model'}-{stamp}-{token or secrets.token_hex(3)}"
        db_url = self.db_url
        if db_url is None:
            if self.db_host is not None:
                db_url = "none" if self.db_host.lower() == "none" else (
                    f"http{'s' if self.ch_secure else ''}://{self.db_host}:{self.db_port}/"
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
        kind, path, host, port, secure, database = store_from_url(self.db_url)
        return StoreConfig(
            kind=kind,
            path=path,
            host=host,
            port=port,
            secure=secure,
            database=database or self.db_database,
            table=self.db_table,
            user=self.ch_user,
            password=self.ch_password,
            compression=self.ch_compression,
            insert_rows=self.ch_insert_rows,
            queue_mb=self.ch_queue_mb,
            writers=self.ch_writers,
            flush_timeout_us=self.drain_flush_timeout_us,
        )

    def to_env(self, *, include_secrets: bool = True) -> dict[str, str]:
        """Every setting as ``DMX_*`` variables (unset optional values are left out)."""
        env: dict[str, str] = {}
        for key, var in _VARS.items():
            value = getattr(self, var.field)
            if value is None or (var.secret and not include_secrets):
                continue
            env[PREFIX + key] = var.render(value)
        return env


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
