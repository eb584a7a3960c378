"""Fixtures of the storage tests: every test gets its own embedded store directory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.domain.store_config import StoreConfig

from ._support import embedded


@pytest.fixture
def store(tmp_path: Path) -> StoreConfig:
    """An embedded store in this test's own directory."""
    return embedded(str(tmp_path / "store"))


@pytest.fixture
def open_sink(store: StoreConfig) -> Iterator[Callable[..., ClickHouseSink]]:
    """Opens sinks (on ``store`` unless a config is given) and closes them after the
    test, so a failing test cannot leave the process's embedded engine open."""
    sinks: list[ClickHouseSink] = []

    def make(config: StoreConfig | None = None, **kw: Any) -> ClickHouseSink:
        sink = ClickHouseSink(config or store, **kw)
        sinks.append(sink)
        return sink

    yield make
    for sink in sinks:
        with contextlib.suppress(Exception):
            sink.close()
