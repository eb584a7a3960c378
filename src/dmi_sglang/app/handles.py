"""Lazy per-request capture handles for the app layer (``dmi_internal``)."""

from __future__ import annotations

from typing import Any

from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import IncompleteCaptureError

__all__ = ["NoStoreHandle", "handle_for", "reader_for"]


class NoStoreHandle:
    """The handle of a run without persistence (``DMX_DB_URL=none``): nothing to read."""

    def __init__(self, run_id: str, request_id: str) -> None:
        self.run_id = run_id
        self.request_id = request_id

    @property
    def available(self) -> bool:
        """Always False: the run stored nothing."""
        return False

    @property
    def missing(self) -> tuple[str, ...]:
        """Why nothing can be read."""
        return ("the run was captured without persistence (DMX_DB_URL=none)",)

    def __getattr__(self, name: str) -> Any:
        msg = f"run {self.run_id!r} stored nothing (DMX_DB_URL=none); cannot read {name!r}"
        raise IncompleteCaptureError(msg)


def reader_for(store: StoreConfig) -> Any:
    """A ClickHouse reader for a store (opens nothing until used)."""
    from dmi_sglang.adapters.clickhouse import ClickHouseReader

    return ClickHouseReader(store)


def handle_for(settings: Settings, run_id: str, request_id: str) -> Any:
    """The lazy handle of one request: free until an attribute is read."""
    store = settings.store()
    if store.kind is StoreKind.NONE:
        return NoStoreHandle(run_id, request_id)
    from dmi_sglang.adapters.clickhouse import CaptureHandle

    return CaptureHandle(run_id, request_id, lambda: reader_for(store))
