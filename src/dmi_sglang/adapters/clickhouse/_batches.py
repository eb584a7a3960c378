"""Stored records read back as record batches: an Arrow result turned into
:class:`~dmi_sglang.columns.RecordBatch` columns over the result's own payload buffer,
with no Python object per record (one per distinct capture only)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.errors import StoreError

__all__ = ["ARROW_SETTINGS", "BATCHES_SQL", "batches_from_arrow", "writable_settings"]

BATCHES_SQL = (
    "SELECT shard_rank, act_name, layer_no, dtype, toString(arraySlice(shape, 2)) AS dims, "
    "s, e, seq, cut, length(bytes) AS total, start_token_idx AS lo, "
    "end_token_idx AS hi, shape[1] AS first FROM (SELECT *, "
    "greatest(start_token_idx, {start:Int64}) AS s, "
    "least(end_token_idx, {end:Int64}) AS e, "
    "substring(bytes, 1 + (s - start_token_idx) * intDiv(length(bytes), "
    "end_token_idx - start_token_idx), (e - s) * intDiv(length(bytes), "
    "end_token_idx - start_token_idx)) AS cut FROM {t} "
    "WHERE model_id = {run:String} AND request_id = {req:String} "
    "AND (act_name, layer_no) IN {caps:Array(Tuple(String, Int32))} "
    "AND end_token_idx > {start:Int64} AND start_token_idx < {end:Int64} "
    "AND end_token_idx > start_token_idx) "
    "ORDER BY shard_rank, act_name, layer_no, s, seq"
)
"""The rows of some captures of one request in ``[start, end)``, each record cut to them
in the query (``substring`` of its payload), as :func:`batches_from_arrow` reads them
(``{t}``: the records table; parameters ``run``, ``req``, ``caps``, ``start``, ``end``)."""
ARROW_SETTINGS = {"output_format_arrow_compression_method": "none"}
"""The answer's Arrow buffers uncompressed: the payloads are activations, which do not
compress, and decompressing them costs the reading process's CPU. Sent only where the
account may change them (:func:`writable_settings`)."""


def writable_settings(client: Any, settings: dict[str, str]) -> dict[str, str]:
    """Those of ``settings`` the server knows and lets this client change (a readonly
    account, or a server without the setting, gets the query without it)."""
    known = getattr(client, "server_settings", None) or {}
    return {k: v for k, v in settings.items()
            if k in known and not getattr(known[k], "readonly", True)}


def _array(table: pa.Table, name: str) -> pa.Array:
    """A column as one array: its only chunk as it is, several chunks joined (a copy)."""
    column = table.column(name)
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _ints(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(_array(table, name).to_numpy(zero_copy_only=False), dtype=np.int64)


def _codes(table: pa.Table, name: str) -> tuple[np.ndarray, list[str]]:
    """A text column as integer codes and the distinct values they index (a server may
    send ClickHouse's String as Arrow binary: decoded as UTF-8, as it was written)."""
    column = _array(table, name)
    encoded = column if pa.types.is_dictionary(column.type) else pc.dictionary_encode(column)
    try:
        values = [v.decode() if isinstance(v, bytes) else str(v)
                  for v in encoded.dictionary.to_pylist()]
    except UnicodeDecodeError as exc:
        msg = f"the store answered {name} values that are not UTF-8 text: {exc}"
        raise StoreError(msg) from exc
    return np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64), values


def _payload(table: pa.Table, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``cut`` column's offsets (``rows + 1``) and bytes, as views of its buffers."""
    column = _array(table, "cut")
    large = pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type)
    _, offsets, data = column.buffers()[:3]
    if offsets is None:
        msg = f"the store answered payloads of type {column.type} without offsets"
        raise StoreError(msg)
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
    try:
        captures = tuple(CaptureKey(act_names[a], int(ln), dtype_names[d],
                                    tuple(int(x) for x in json.loads(dims_texts[m])))
                         for a, ln, d, m in distinct.tolist())
        row_nbytes = np.array([c.row_nbytes for c in captures], dtype=np.int64)
    except (ValueError, TypeError) as exc:  # a dtype or row shape nobody wrote
        msg = f"records of request {request_id!r} name a dtype or shape not read: {exc}"
        raise StoreError(msg) from exc
    shard, start, end, seq = (_ints(table, c) for c in ("shard_rank", "s", "e", "seq"))
    offsets, payload = _payload(table, n)
    wrong = np.flatnonzero(np.diff(offsets) != (end - start) * row_nbytes[capture])
    if wrong.size:
        i, key = int(wrong[0]), captures[capture[wrong[0]]]
        msg = (f"{key.act_name} layer {key.layer_no} [{lo[i]}, {hi[i]}) of request "
               f"{request_id!r}: {total[i]} payload bytes are not {stored_rows[i]} rows of "
               f"{key.dtype} {list(key.dims)} ({row_nbytes[capture[i]]} bytes a row)")
        raise StoreError(msg)
    cuts = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), n]
    return [RecordBatch(run_id, (request_id,), captures, np.zeros(b - a, dtype=np.int32),
                        capture[a:b], start[a:b], end[a:b], seq[a:b], offsets[a : b + 1],
                        payload, shard_rank=int(shard[a]))
            for a, b in itertools.pairwise(cuts)]
