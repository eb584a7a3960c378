"""Encode records as one ClickHouse ``Native`` block, for ``Client.raw_insert``.

Why not ``Client.insert``: its generic serializer walks every value in Python, which
costs more CPU per MB than the engine spends storing it (docs/storage.md has the
numbers). A Native block is column after column; the payload column is just
``varint(len) + bytes`` per row, so encoding a batch is a list of references to the
records' own ``bytes`` objects plus a few small arrays: the payload is not copied here.
The embedded engine and a server both ingest it through ``raw_insert(fmt="Native")``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Generator, Iterable, Sequence
from functools import lru_cache
from itertools import accumulate, chain

from dmi_sglang.adapters.clickhouse._schema import OFFLOAD_COLUMNS
from dmi_sglang.domain.records import CaptureRecord

__all__ = ["COLUMN_NAMES", "coalesce", "encode_block", "encoded_size"]

COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in OFFLOAD_COLUMNS)
"""The records table's columns, in insert order."""

_BIG_ENDIAN = sys.byteorder == "big"


@lru_cache(maxsize=8192)
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _header(name: str, typ: str) -> bytes:
    nb, tb = name.encode(), typ.encode()
    return _varint(len(nb)) + nb + _varint(len(tb)) + tb


_HEADERS = {name: _header(name, typ) for name, typ in OFFLOAD_COLUMNS}


def _numbers(code: str, values: Iterable[int]) -> bytes:
    arr = array(code, values)
    if _BIG_ENDIAN:  # Native is little-endian
        arr.byteswap()
    return arr.tobytes()


def _short_strings(values: Iterable[str]) -> bytes:
    """A String column of repetitive short text (ids, names): each distinct value
    is encoded once."""
    cache: dict[str, bytes] = {}
    parts: list[bytes] = []
    for v in values:
        enc = cache.get(v)
        if enc is None:
            raw = v.encode()
            enc = cache[v] = _varint(len(raw)) + raw
        parts.append(enc)
    return b"".join(parts)


def encode_block(records: Sequence[CaptureRecord]) -> list[bytes | memoryview]:
    """One Native block holding ``records``, as chunks to write in order.

    The payloads are passed through as the records' own objects (no copy): ``bytes`` or
    the transport's read-only ``memoryview`` slices.
    """
    n = len(records)
    chunks: list[bytes | memoryview] = [_varint(len(COLUMN_NAMES)) + _varint(n)]
    for name in ("model_id", "request_id", "act_name"):
        chunks.append(_HEADERS[name])
        chunks.append(_short_strings(getattr(r, name) for r in records))
    for name in ("layer_no", "shard_rank", "start_token_idx", "end_token_idx"):
        chunks.append(_HEADERS[name])
        chunks.append(_numbers("i", (getattr(r, name) for r in records)))
    chunks.append(_HEADERS["dtype"])
    chunks.append(_short_strings(r.dtype for r in records))
    chunks.append(_HEADERS["shape"])
    chunks.append(_numbers("Q", accumulate(len(r.shape) for r in records)))
    chunks.append(_numbers("q", chain.from_iterable(r.shape for r in records)))
    chunks.append(_HEADERS["bytes"])
    for r in records:
        chunks.append(_varint(len(r.payload)))
        chunks.append(r.payload)
    chunks.append(_HEADERS["seq"])
    chunks.append(_numbers("Q", (r.seq for r in records)))
    return chunks


def coalesce(
    chunks: Sequence[bytes | memoryview], piece_bytes: int
) -> Generator[bytes, None, None]:
    """The chunks joined into pieces of about ``piece_bytes`` (fewer, larger writes)."""
    group: list[bytes | memoryview] = []
    size = 0
    for c in chunks:
        group.append(c)
        size += len(c)
        if size >= piece_bytes:
            yield b"".join(group)
            group, size = [], 0
    if group:
        yield b"".join(group)


def encoded_size(chunks: Sequence[bytes | memoryview]) -> int:
    """Bytes of an encoded block."""
    return sum(len(c) for c in chunks)
