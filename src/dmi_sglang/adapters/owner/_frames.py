"""A :class:`~dmi_sglang.columns.RecordBatch` as message frames, sent without a copy and
read back as views of the received frames (each array keeps its frame alive), a header of
plain values (JSON-ready) first: whole (:func:`batch_to_frames`: one frame per column
plus the payload; a read answer's batches, a shared ring's regions), or in pieces
(:func:`pieces_to_frames`: one frame of every column packed, then one payload frame per
piece; a put through the store owner's socket)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from dmi_sglang.columns import CaptureKey, RecordBatch

__all__ = ["FRAMES_PER_BATCH", "batch_from_frames", "batch_to_frames", "pieces_from_frames",
           "pieces_to_frames"]

_COLUMNS = ("request", "capture", "start", "end", "seq", "offsets")
_DTYPES = {"request": np.int32, "capture": np.int32, "start": np.int32, "end": np.int32,
           "seq": np.int64, "offsets": np.int64}
FRAMES_PER_BATCH = len(_COLUMNS) + 1
"""Frames after a batch's header: its columns, then its payload."""


def _header(batch: RecordBatch) -> dict[str, Any]:
    """The batch's fields that are not columns, as plain values."""
    return {"run_id": batch.run_id, "request_ids": list(batch.request_ids),
            "captures": [[c.act_name, c.layer_no, c.dtype, list(c.dims)]
                         for c in batch.captures],
            "shard_rank": batch.shard_rank}


def _fields(header: Any) -> tuple[str, tuple[str, ...], tuple[CaptureKey, ...], int]:
    """What :func:`_header` made, read back: run id, request ids, capture keys, shard rank.

    Raises:
        KeyError, TypeError: a header without them.
    """
    return (str(header["run_id"]), tuple(str(r) for r in header["request_ids"]),
            tuple(CaptureKey(str(a), int(n), str(d), tuple(int(x) for x in dims))
                  for a, n, d, dims in header["captures"]),
            int(header["shard_rank"]))


def batch_to_frames(batch: RecordBatch) -> tuple[dict[str, Any], list[Any]]:
    """The batch's header (plain values) and its :data:`FRAMES_PER_BATCH` frames: its
    columns, and the part of its payload its records use (a view: a batch over a larger
    buffer, one shard's of a read answer, sends only its own bytes), offsets rebased to
    it."""
    header = _header(batch)
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
        run_id, request_ids, captures, shard_rank = _fields(header)
        return RecordBatch(run_id, request_ids, captures,
                           payload=np.frombuffer(_readonly(frames[-1]), dtype=np.uint8),
                           shard_rank=shard_rank, **columns)
    except (KeyError, TypeError) as exc:
        msg = f"a batch header without its fields: {exc!r}"
        raise ValueError(msg) from exc


_PACKED = (("request", np.int32), ("capture", np.int32), ("start", np.int32),
           ("end", np.int32), ("seq", np.int64))
"""The columns :func:`pieces_to_frames` packs, in order, before the pieces' offsets."""


def _packed_bytes(records: int, pieces: int) -> int:
    """The packed columns' size: :data:`_PACKED` per record, then ``records + pieces``
    offsets (each piece's own, one more than its records)."""
    return sum(np.dtype(t).itemsize for _, t in _PACKED) * records + 8 * (records + pieces)


def _packed_columns(packed: npt.NDArray[np.uint8], records: int,
                    ) -> tuple[dict[str, npt.NDArray[Any]], npt.NDArray[np.int64]]:
    """Views of ``packed`` (:func:`_packed_bytes` of it) as the :data:`_PACKED` columns of
    ``records`` records, and the pieces' offsets after them."""
    columns: dict[str, npt.NDArray[Any]] = {}
    at = 0
    for name, dtype in _PACKED:
        size = np.dtype(dtype).itemsize * records
        columns[name] = packed[at:at + size].view(dtype)
        at += size
    return columns, packed[at:].view(np.int64)


def pieces_to_frames(batch: RecordBatch, piece_bytes: int) -> tuple[dict[str, Any], list[Any]]:
    """The batch in pieces of whole records of at most ``piece_bytes`` payload bytes
    (:meth:`RecordBatch.split`) as one message: a header (plain values, with each
    piece's record count), one frame of every column packed together (each piece's
    offsets rebased to its own payload), then one payload frame per piece (views: the
    payload is not copied). Few frames, so a process hands a large batch over with few
    calls into the messaging library: each call lets another thread take the
    interpreter's lock, and getting it back may wait for that thread.

    Raises:
        ValueError: ``piece_bytes`` is not positive.
    """
    pieces = batch.split(piece_bytes)
    header = {**_header(batch), "records": [len(p) for p in pieces]}
    n = len(batch)
    packed = np.empty(_packed_bytes(n, len(pieces)), dtype=np.uint8)
    columns, offsets = _packed_columns(packed, n)
    for name, column in columns.items():
        column[:] = getattr(batch, name)
    payloads = []
    first = 0
    for piece in pieces:
        start, end = int(piece.offsets[0]), int(piece.offsets[-1])
        offsets[first:first + len(piece.offsets)] = piece.offsets - start
        first += len(piece.offsets)
        payloads.append(piece.payload[start:end])
    return header, [packed, *payloads]


def pieces_from_frames(header: Any, frames: Sequence[Any]) -> list[RecordBatch]:
    """The pieces :func:`pieces_to_frames` sent, one batch each, over the received frames
    (``zmq.Frame`` objects, or anything with a ``buffer``) without a copy: read-only
    views that keep their frames alive.

    Raises:
        ValueError: frames or columns that do not match the header, or a header without
            the batch's fields.
    """
    try:
        counts = header["records"]
        run_id, request_ids, captures, shard_rank = _fields(header)
    except (KeyError, TypeError) as exc:
        msg = f"a batch header without its fields: {exc!r}"
        raise ValueError(msg) from exc
    if not isinstance(counts, list) or not counts or not all(
            type(c) is int and c >= 0 for c in counts):
        msg = (f"a put's record counts {str(counts)[:64]}; accepted: a non-empty list of "
               "integers >= 0")
        raise ValueError(msg)
    if len(frames) != 1 + len(counts):
        msg = (f"a put of {len(counts)} pieces has {1 + len(counts)} frames after its "
               f"header, got {len(frames)}")
        raise ValueError(msg)
    packed = np.frombuffer(_readonly(frames[0]), dtype=np.uint8)
    n = sum(counts)
    expected = _packed_bytes(n, len(counts))
    if packed.nbytes != expected:
        msg = (f"the columns of {n} records in {len(counts)} pieces take {expected} "
               f"bytes, got {packed.nbytes}")
        raise ValueError(msg)
    columns, offsets = _packed_columns(packed, n)
    out = []
    first = 0
    for i, count in enumerate(counts):
        last = first + count
        sent, used = len(_readonly(frames[1 + i])), int(offsets[last + i])
        if sent != used:
            msg = f"piece {i} of a put: its records end at byte {used}, its frame holds {sent}"
            raise ValueError(msg)
        out.append(RecordBatch(
            run_id, request_ids, captures, request=columns["request"][first:last],
            capture=columns["capture"][first:last], start=columns["start"][first:last],
            end=columns["end"][first:last], seq=columns["seq"][first:last],
            offsets=offsets[first + i : last + i + 1],
            payload=np.frombuffer(_readonly(frames[1 + i]), dtype=np.uint8),
            shard_rank=shard_rank))
        first = last
    return out
