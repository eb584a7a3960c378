"""Server-only settings, checked without a server (none runs here): the wire compression
reaches the client, and the server inserter's Arrow bodies, compressed as configured,
are read back correctly by the engine (the embedded one, through the same client API)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import clickhouse_connect
import pytest
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink, StoreTables, connect
from dmi_sglang.adapters.clickhouse._arrow import arrow_table
from dmi_sglang.adapters.clickhouse._client import wire_compression
from dmi_sglang.adapters.clickhouse._insert import ServerInserter, open_inserter
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

from ._support import RESID, batch_of, embedded, raw


def test_the_embedded_store_never_compresses_inserts() -> None:
    assert wire_compression(embedded("/x", compression="zstd")) is None


@pytest.mark.parametrize(
    ("setting", "method"), [("lz4", "lz4"), ("true", "lz4"), ("gzip", "gzip"), ("none", None)]
)
def test_server_writers_open_their_client_with_the_configured_compression(
    setting: str, method: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = StoreConfig(kind=StoreKind.SERVER, host="h", compression=setting)
    assert wire_compression(config) == method
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(clickhouse_connect, "get_client", lambda **kw: seen.append(kw) or kw)
    inserter = open_inserter(config)
    assert isinstance(inserter, ServerInserter)
    assert seen[0]["compress"] == (method or False)


@pytest.mark.parametrize("method", ["lz4", "zstd", "gzip", None])
def test_server_inserts_are_compressed_as_configured_and_read_back(
    method: str | None, tmp_path: Path
) -> None:
    config = embedded(str(tmp_path / "s"))
    client = connect(config)  # the same client API a server store uses
    bodies: list[int] = []
    real = client.raw_insert

    def spy(*args: Any, **kwargs: Any) -> Any:
        block = args[2] if len(args) > 2 else kwargs["insert_block"]
        bodies.append(len(block))
        return real(*args, **kwargs)

    try:
        tables = StoreTables.named("default", "offload")
        tables.ensure(client)
        client.write_compression = method  # what connect(compress=method) sets on a server
        client.raw_insert = spy
        zeros = torch.zeros(64, 4096)  # 1 MiB of zeros: compresses to almost nothing
        batch = batch_of("run", "r", RESID, 0, zeros, [0, 32, 64])
        ServerInserter(client, method).insert_arrow(tables.qualified(tables.offload),
                                                    arrow_table([batch]))
    finally:
        client.close()
    assert len(bodies) == 1
    if method is None:
        assert bodies[0] > zeros.numel() * 4
    else:
        assert bodies[0] < zeros.numel() * 4 // 20
    stored = ClickHouseReader(config).records("run", "r")
    assert [bytes(r.payload) for r in stored] == [raw(zeros[:32]), raw(zeros[32:])]


def test_an_unknown_compression_is_refused_before_connecting() -> None:
    config = StoreConfig(kind=StoreKind.SERVER, host="127.0.0.1", port=1, compression="snappy")
    with pytest.raises(StoreError, match="unsupported wire compression 'snappy'"):
        ClickHouseSink(config)
