"""Record batches as one Arrow table in the records table's layout, for one insert.

Each :class:`~dmi_sglang.columns.RecordBatch` becomes one Arrow record batch of the
table (a chunked table, nothing concatenated). The payload column is a ``large_binary``
array over the batch's own payload memory (its offsets rebased to the first record, the
payload a numpy view): no payload byte is copied here. The string columns are taken from
the batch's small dictionaries (run id, request ids, capture keys) by index, the shape
column is a list array over :meth:`RecordBatch.shapes`, and the integer columns are the
numpy columns themselves. There is no per-record Python loop.

Column names, order and types follow :data:`OFFLOAD_COLUMNS` (``String`` as ``string``
or ``large_binary``, ``Array(Int64)`` as ``list<int64>``, ``Int32`` / ``UInt64`` as
such), which the embedded engine's ``Python()`` table function and a server's ``Arrow``
input format both map onto the table's types.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from dmi_sglang.adapters.clickhouse._schema import OFFLOAD_COLUMNS
from dmi_sglang.columns import RecordBatch

__all__ = ["COLUMN_NAMES", "SCHEMA", "arrow_batch", "arrow_table"]

COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in OFFLOAD_COLUMNS)
"""The records table's columns, in insert order."""

_ARROW_TYPES = {
    "String": pa.string(),
    "Int32": pa.int32(),
    "UInt64": pa.uint64(),
    "Array(Int64)": pa.list_(pa.int64()),
}

SCHEMA = pa.schema(
    [(name, pa.large_binary() if name == "bytes" else _ARROW_TYPES[typ])
     for name, typ in OFFLOAD_COLUMNS]
)
"""The Arrow schema of an insert: the records table's columns; ``bytes`` as
``large_binary`` (64-bit offsets: one batch may hold more than 2 GiB)."""


def _strings(values: Sequence[str], index: np.ndarray) -> pa.Array:
    """``values[index]`` as a string array (the values are few, the index long)."""
    return pa.array(values, type=pa.string()).take(pa.array(index))


def arrow_batch(batch: RecordBatch) -> pa.RecordBatch:
    """One :class:`RecordBatch` as an Arrow record batch of :data:`SCHEMA`.

    The ``bytes`` column shares the batch's payload memory.

    Raises:
        OverflowError: a negative ``seq`` (the column is ``UInt64``).
    """
    n = len(batch)
    if n and int(batch.seq.min()) < 0:
        msg = f"run {batch.run_id!r}: negative seq {int(batch.seq.min())} (the column is UInt64)"
        raise OverflowError(msg)
    first, last = int(batch.offsets[0]), int(batch.offsets[-1])
    offsets = batch.offsets - first  # n + 1 small numbers: the one copy made here
    payload = batch.payload[first:last]  # a view: the rows' bytes, not copied
    data = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(payload)]
    )
    keys = batch.captures
    list_offsets, dims = batch.shapes()
    layer_of = np.array([k.layer_no for k in keys], dtype=np.int32)
    columns = [
        _strings([batch.run_id], np.zeros(n, dtype=np.int32)),
        _strings(batch.request_ids, batch.request),
        _strings([k.act_name for k in keys], batch.capture),
        pa.array(layer_of[batch.capture]),
        pa.array(np.full(n, batch.shard_rank, dtype=np.int32)),
        pa.array(batch.start),
        pa.array(batch.end),
        _strings([k.dtype for k in keys], batch.capture),
        pa.ListArray.from_arrays(pa.array(list_offsets), pa.array(dims)),
        data,
        pa.array(batch.seq.view(np.uint64)),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def arrow_table(batches: Sequence[RecordBatch]) -> pa.Table:
    """The batches as one Arrow table, one record batch (chunk) each; empty batches are
    left out.

    Raises:
        OverflowError: a negative ``seq``.
    """
    return pa.Table.from_batches([arrow_batch(b) for b in batches if len(b)], schema=SCHEMA)
