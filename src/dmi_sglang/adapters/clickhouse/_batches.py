"""Stored records read back as record batches: an Arrow result turned into
:class:`~dmi_sglang.columns.RecordBatch` columns over the result's own payload buffer,
with no Python object per record (one per distinct capture only)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.errors import StoreError

__all__ = ["BATCH_COLUMNS", "batches_from_arrow"]

BATCH_COLUMNS = (
    "shard_rank, act_name, layer_no, dtype, toString(arraySlice(shape, 2)) AS dims, "
    "s, e, seq, cut, length(bytes) AS total, start_token_idx AS lo, end_token_idx AS hi, "
    "shape[1] AS first"
)
"""What :func:`batches_from_arrow` reads, given ``s`` / ``e`` (a record's rows, cut) and
``cut`` (their bytes) in the query; rows ordered by shard_rank, act_name, layer_no, s,
seq."""


def _ints(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).combine_chunks().to_numpy(zero_copy_only=False),
                      dtype=np.int64)


def _codes(table: pa.Table, name: str) -> tuple[np.ndarray, list[str]]:
    """A text column as integer codes and the distinct values they index."""
    column = table.column(name).combine_chunks()
    encoded = column if pa.types.is_dictionary(column.type) else pc.dictionary_encode(column)
    values = [str(v) for v in encoded.dictionary.to_pylist()]
    return np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64), values


def _payload(table: pa.Table, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``cut`` column's offsets (``rows + 1``) and bytes, as views of its buffers."""
    column = table.column("cut").combine_chunks()
    large = pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type)
    _, offsets, data = column.buffers()[:3]
    assert offsets is not None
    at = column.offset
    offs = np.frombuffer(offsets, dtype=np.int64 if large else np.int32)[at : at + rows + 1]
    body = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
    return offs.astype(np.int64), body


def batches_from_arrow(table: pa.Table, run_id: str, request_id: str) -> list[RecordBatch]:
    """One :class:`RecordBatch` per ``shard_rank`` of a request's records in ``table``
    (:data:`BATCH_COLUMNS`, ordered as it says), each in act_name, layer, start, seq
    order.

    Raises:
        StoreError: a stored record whose payload or shape does not fit its rows.
    """
    n = table.num_rows
    if not n:
        return []
    lo, hi, first, total = (_ints(table, c) for c in ("lo", "hi", "first", "total"))
    stored_rows = hi - lo
    bad = np.flatnonzero((first != stored_rows) | (total % np.maximum(stored_rows, 1) != 0)
                         | (stored_rows < 1))
    acts, act_names = _codes(table, "act_name")
    layer = _ints(table, "layer_no")
    if bad.size:
        i = int(bad[0])
        msg = (f"{act_names[acts[i]]} layer {layer[i]} [{lo[i]}, {hi[i]}) of request "
               f"{request_id!r}: {total[i]} payload bytes and shape[0] {first[i]} do not fit "
               f"its {stored_rows[i]} rows")
        raise StoreError(msg)
    dtypes, dtype_names = _codes(table, "dtype")
    dims, dims_texts = _codes(table, "dims")
    keys = np.stack([acts, layer, dtypes, dims], axis=1)
    distinct, inverse = np.unique(keys, axis=0, return_inverse=True)
    capture = inverse.reshape(-1).astype(np.int32)
    captures = tuple(CaptureKey(act_names[a], int(ln), dtype_names[d],
                                tuple(int(x) for x in json.loads(dims_texts[m])))
                     for a, ln, d, m in distinct.tolist())
    shard, start, end, seq = (_ints(table, c) for c in ("shard_rank", "s", "e", "seq"))
    offsets, payload = _payload(table, n)
    cuts = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), n]
    out = []
    try:
        for a, b in itertools.pairwise(cuts):
            out.append(RecordBatch(
                run_id, (request_id,), captures, np.zeros(b - a, dtype=np.int32),
                capture[a:b], start[a:b], end[a:b], seq[a:b], offsets[a : b + 1],
                payload, shard_rank=int(shard[a])))
    except ValueError as exc:  # RecordBatch's checks, or a dtype it does not know
        msg = f"records of request {request_id!r} do not fit their shapes: {exc}"
        raise StoreError(msg) from exc
    return out
