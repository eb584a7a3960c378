"""Run-id claims: :class:`ClickHouseRunClaims`.

A claim is a tiny table per run id (``<table>_claim_<sha256 of the id>``), made with
``CREATE TABLE`` without ``IF NOT EXISTS``: ClickHouse creates a table once, so of two
starts racing for one id on one store exactly one succeeds. ``rm`` drops the claim with
the run.
"""

from __future__ import annotations

import hashlib
import os

from dmi_sglang.adapters.clickhouse._client import (
    ClientFactory,
    close_quietly,
    connect,
    store_error,
)
from dmi_sglang.adapters.clickhouse._reader import ClickHouseReader
from dmi_sglang.adapters.clickhouse._schema import quote
from dmi_sglang.domain.ports import ClaimOutcome
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

__all__ = ["ClickHouseRunClaims"]

_TABLE_ALREADY_EXISTS = 57


class ClickHouseRunClaims:
    """The :class:`~dmi_sglang.domain.ports.RunClaims` of a ClickHouse store.

    Args:
        config: the store (embedded or server).
        client_factory: opens a client (default :func:`connect`, creating a missing
            embedded store: claiming is the first write of a new run).
    """

    def __init__(self, config: StoreConfig, *, client_factory: ClientFactory | None = None):
        if config.kind is StoreKind.NONE:
            msg = "the store is 'none' (no persistence): run ids are not claimed there"
            raise StoreError(msg)
        self._config = config
        self._factory = client_factory or connect

    def _table(self, run_id: str) -> str:
        digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{self._config.table}_claim_{digest}"

    def _existing_run_reader(self) -> ClickHouseReader | None:
        config = self._config
        if config.kind is StoreKind.EMBEDDED and (
            not os.path.isdir(config.path) or not os.listdir(config.path)
        ):
            return None  # a new store: no runs yet
        return ClickHouseReader(config)

    def claim(self, run_id: str) -> ClaimOutcome:
        """Claim ``run_id``; see the module docstring.

        Raises:
            StoreError: the store cannot be opened or written.
        """
        reader = self._existing_run_reader()
        existing = reader.run(run_id) if reader is not None else None
        if existing is not None:
            return ClaimOutcome(won=False, existing=existing)
        client = self._factory(self._config)
        try:
            client.command(f"CREATE DATABASE IF NOT EXISTS {quote(self._config.database)}")
            table = f"{quote(self._config.database)}.{quote(self._table(run_id))}"
            try:
                client.command(f"CREATE TABLE {table} (run_id String) ENGINE = TinyLog")
            except Exception as exc:
                if getattr(exc, "code", None) == _TABLE_ALREADY_EXISTS or (
                    "already exists" in str(exc)
                ):
                    return ClaimOutcome(won=False)
                raise store_error(f"claiming run id {run_id!r}", exc, self._config) from exc
            return ClaimOutcome(won=True)
        finally:
            close_quietly(client)

    def claimed(self, run_id: str) -> bool:
        """Whether a claim of ``run_id`` exists."""
        if self._existing_run_reader() is None:
            return False
        client = self._factory(self._config)
        try:
            rows = client.query(
                "SELECT count() FROM system.tables WHERE database = {db:String} "
                "AND name = {t:String}",
                parameters={"db": self._config.database, "t": self._table(run_id)},
            ).result_rows
            return bool(rows and rows[0][0])
        except Exception as exc:
            raise store_error(f"reading the claim of {run_id!r}", exc, self._config) from exc
        finally:
            close_quietly(client)

    def release(self, run_id: str) -> None:
        """Drop the claim of ``run_id`` (idempotent)."""
        if self._existing_run_reader() is None:
            return
        client = self._factory(self._config)
        try:
            table = f"{quote(self._config.database)}.{quote(self._table(run_id))}"
            client.command(f"DROP TABLE IF EXISTS {table}")
        except Exception as exc:
            raise store_error(f"releasing the claim of {run_id!r}", exc, self._config) from exc
        finally:
            close_quietly(client)
