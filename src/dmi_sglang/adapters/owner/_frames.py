"""A :class:`~dmi_sglang.columns.RecordBatch` as message frames: a header of plain values
(JSON-ready) and one frame per column plus the payload, sent without a copy and read
back as views of the received frames (each array keeps its frame alive)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dmi_sglang.columns import CaptureKey, RecordBatch

__all__ = ["FRAMES_PER_BATCH", "batch_from_frames", "batch_to_frames"]

_COLUMNS = ("request", "capture", "start", "end", "seq", "offsets")
_DTYPES = {"request": np.int32, "capture": np.int32, "start": np.int32, "end": np.int32,
           "seq": np.int64, "offsets": np.int64}
FRAMES_PER_BATCH = len(_COLUMNS) + 1
"""Frames after a batch's header: its columns, then its payload."""


def batch_to_frames(batch: RecordBatch) -> tuple[dict[str, Any], list[Any]]:
    """The batch's header (plain values) and its :data:`FRAMES_PER_BATCH` frames: its
    columns, and the part of its payload its records use (a view: a batch over a larger
    buffer, one shard's of a read answer, sends only its own bytes), offsets rebased to
    it."""
    header = {"run_id": batch.run_id, "request_ids": list(batch.request_ids),
              "captures": [[c.act_name, c.layer_no, c.dtype, list(c.dims)]
                           for c in batch.captures],
              "shard_rank": batch.shard_rank}
    first, last = int(batch.offsets[0]), int(batch.offsets[-1])
    columns = [batch.offsets - first if name == "offsets" else getattr(batch, name)
               for name in _COLUMNS]
    return header, [*columns, batch.payload[first:last]]


def _readonly(frame: Any) -> memoryview:
    """A frame's bytes as a read-only view (the batch shares them, never writes them)."""
    return memoryview(frame.buffer).toreadonly()


def batch_from_frames(header: Any, frames: Sequence[Any]) -> RecordBatch:
    """The batch :func:`batch_to_frames` sent, over the received frames (``zmq.Frame``
    objects, or anything with a ``buffer``), without a copy: its arrays are read-only
    views that keep their frames alive.

    Raises:
        ValueError: another frame count, a header without the batch's fields, or columns
            that do not make a batch (``RecordBatch``'s checks).
    """
    if len(frames) != FRAMES_PER_BATCH:
        msg = f"a batch has {FRAMES_PER_BATCH} frames after its header, got {len(frames)}"
        raise ValueError(msg)
    try:
        columns = {name: np.frombuffer(_readonly(frame), dtype=_DTYPES[name])
                   for name, frame in zip(_COLUMNS, frames, strict=False)}
        return RecordBatch(
            str(header["run_id"]), tuple(str(r) for r in header["request_ids"]),
            tuple(CaptureKey(str(a), int(n), str(d), tuple(int(x) for x in dims))
                  for a, n, d, dims in header["captures"]),
            payload=np.frombuffer(_readonly(frames[-1]), dtype=np.uint8),
            shard_rank=int(header["shard_rank"]), **columns)
    except (KeyError, TypeError) as exc:
        msg = f"a batch header without its fields: {exc!r}"
        raise ValueError(msg) from exc
