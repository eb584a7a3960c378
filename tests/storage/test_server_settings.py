"""Server-only settings that can be checked without a server (none runs here)."""

from __future__ import annotations

import gzip

import lz4.frame
import pytest

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.adapters.clickhouse._client import compress, wire_compression
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

from ._support import embedded


def test_the_embedded_store_never_compresses_inserts() -> None:
    assert wire_compression(embedded("/x", compression="zstd")) is None


@pytest.mark.parametrize(
    ("setting", "method"), [("lz4", "lz4"), ("true", "lz4"), ("gzip", "gzip"), ("none", None)]
)
def test_server_inserts_are_compressed_as_configured(setting: str, method: str | None) -> None:
    config = StoreConfig(kind=StoreKind.SERVER, host="h", compression=setting)
    assert wire_compression(config) == method
    data = bytes(range(256)) * 64
    packed = compress(data, method)
    unpacked = {None: lambda b: b, "lz4": lz4.frame.decompress, "gzip": gzip.decompress}
    assert unpacked[method](packed) == data


def test_an_unknown_compression_is_refused_before_connecting() -> None:
    config = StoreConfig(kind=StoreKind.SERVER, host="127.0.0.1", port=1, compression="snappy")
    with pytest.raises(StoreError, match="unsupported wire compression 'snappy'"):
        ClickHouseSink(config)
