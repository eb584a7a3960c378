"""Run-id claims: :class:`ClickHouseRunClaims`.

A claim is a tiny table per run id (``<table>_claim_<sha256 of the id>``), made with
``CREATE TABLE`` without ``IF NOT EXISTS``: ClickHouse creates a table once, so of two
starts racing for one id on one store exactly one succeeds. ``rm`` drops the claim with
the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

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
        """The claim table of ``run_id``, qualified and quoted."""
        digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{quote(self._config.database)}.{quote(f'{self._config.table}_claim_{digest}')}"

    def _store_is_new(self) -> bool:
        """An embedded store not created yet: no run and no claim can be in it."""
        config = self._config
        return config.kind is StoreKind.EMBEDDED and (
            not os.path.isdir(config.path) or not os.listdir(config.path))

    @contextlib.contextmanager
    def _client(self, what: str) -> Iterator[Client]:
        """A client for one claim operation, closed after; failures become StoreErrors."""
        client = self._factory(self._config)
        try:
            yield client
        except StoreError:
            raise
        except Exception as exc:
            raise store_error(what, exc, self._config) from exc
        finally:
            close_quietly(client)

    def claim(self, run_id: str) -> ClaimOutcome:
        """Claim ``run_id``; see the module docstring.

        Raises:
            StoreError: the store cannot be opened or written.
        """
        if not self._store_is_new():
            existing = ClickHouseReader(self._config).run(run_id)
            if existing is not None:
                return ClaimOutcome(won=False, existing=existing)
        with self._client(f"claiming run id {run_id!r}") as client:
            client.command(f"CREATE DATABASE IF NOT EXISTS {quote(self._config.database)}")
            try:
                client.command(f"CREATE TABLE {self._table(run_id)} (run_id String) "
                               "ENGINE = TinyLog")
            except Exception as exc:
                if getattr(exc, "code", None) == _TABLE_ALREADY_EXISTS or (
                    "already exists" in str(exc)
                ):
                    return ClaimOutcome(won=False)
                raise
        return ClaimOutcome(won=True)

    def claimed(self, run_id: str) -> bool:
        """Whether a claim of ``run_id`` exists."""
        if self._store_is_new():
            return False
        with self._client(f"reading the claim of {run_id!r}") as client:
            rows = client.query(f"EXISTS TABLE {self._table(run_id)}").result_rows
        return bool(rows and rows[0][0])

    def release(self, run_id: str) -> None:
        """Drop the claim of ``run_id`` (idempotent)."""
        if self._store_is_new():
            return
        with self._client(f"releasing the claim of {run_id!r}") as client:
            client.command(f"DROP TABLE IF EXISTS {self._table(run_id)}")
