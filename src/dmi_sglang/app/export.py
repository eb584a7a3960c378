"""A serving process's reads of its store for HTTP clients (the ``CaptureReads`` port).

Version-neutral: listings of runs and requests as JSON-ready values, and one complete
request's captures as a safetensors file built piece by piece. The header is made from
the run's captures, the request's manifest and one row layout per hook and layer (no
payload read); then the rows are read a piece at a time (:data:`PIECE_BYTES`: whole
tensors together while they fit, a larger tensor a slice of positions at a time), cut to
those rows by the store itself (``RecordBatchReader.batches_within``), so an export holds
about one piece at a time whatever the request's or its records' sizes (the store's
engine reads each record it cuts whole: a record larger than a piece is read once per
piece). One query per piece, not per tensor: while a run captures, a request's rows lie
in many small parts of the store shared with the other requests of its time, and each
query decompresses those parts' blocks again.

Tensor names: ``act_name.layer`` for per-layer hooks (``blocks.hook_resid_pre.3``), the
act_name alone for global ones (``final_logits``). Rows are in position order, one per
position the listing names (``positions``: ``[start, stop, step]``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence

import attrs
import numpy as np

from dmi_sglang.app.assemble import joined_rows, missing, select_rows, selected_positions
from dmi_sglang.app.shards import by_shard, combined_rows
from dmi_sglang.columns import RecordBatch, RecordBatchReader
from dmi_sglang.domain.ports import RecordReader, RowLayout
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo
from dmi_sglang.domain.shapes import DType
from dmi_sglang.domain.tensor_parallel import ShardPlan, TpRule
from dmi_sglang.errors import IncompleteCaptureError, NotInStoreError, StoreError

__all__ = ["PIECE_BYTES", "StoreReads", "tensor_name"]

PIECE_BYTES = 32 << 20
"""Rows of at most this many bytes are read and sent at a time (at least one row)."""

_SAFETENSORS_DTYPES = {
    DType.BFLOAT16: "BF16", DType.FLOAT16: "F16", DType.FLOAT32: "F32",
    DType.FLOAT64: "F64", DType.INT8: "I8", DType.UINT8: "U8", DType.INT16: "I16",
    DType.INT32: "I32", DType.INT64: "I64", DType.BOOL: "BOOL",
}


def tensor_name(act_name: str, layer_no: int) -> str:
    """The export's name of one hook and layer (global hooks have layer -1)."""
    return act_name if layer_no < 0 else f"{act_name}.{layer_no}"


@attrs.frozen
class _Tensor:
    """One tensor of an export: a hook and layer's rows at ``positions``."""

    act_name: str
    layer_no: int
    dtype: DType
    row_shape: tuple[int, ...]
    positions: range
    plan: ShardPlan
    """How the run stored its parts (tensor parallelism; one part at TP=1)."""

    @property
    def name(self) -> str:
        return tensor_name(self.act_name, self.layer_no)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return len(self.positions) * self.row_bytes

    @property
    def stored_row_bytes(self) -> int:
        """Bytes the store holds of one row: every part's, for a tensor-parallel run's
        partial sums (sharded parts together make one row)."""
        return self.row_bytes * (self.plan.parts if self.plan.rule is TpRule.PARTIAL else 1)

    def to_json(self) -> dict[str, object]:
        p = self.positions
        return {"name": self.name, "hook": self.act_name, "layer": self.layer_no,
                "dtype": self.dtype.value.removeprefix("torch."),
                "shape": [len(p), *self.row_shape], "positions": [p.start, p.stop, p.step]}


class StoreReads:
    """:class:`~dmi_sglang.domain.ports.CaptureReads` over a reader (the composition
    root's reader for the server's store: through the store owner when embedded).

    Args:
        reader_factory: makes the reader; called once per listing or export.
        piece_bytes: the most bytes of rows an export reads and sends at a time (at least
            one row).
    """

    def __init__(self, reader_factory: Callable[[], RecordBatchReader], *,
                 piece_bytes: int = PIECE_BYTES) -> None:
        self._factory = reader_factory
        self._piece_bytes = piece_bytes

    def runs(self) -> list[dict[str, object]]:
        """Every run of the store, newest first."""
        reader = self._factory()
        with reader.session():
            return [_run_json(run) for run in reader.runs()]

    def requests(self, run_id: str) -> list[dict[str, object]]:
        """The requests a run stored: records, payload bytes and whether each is
        committed.

        Raises:
            NotInStoreError: the store holds no such run.
        """
        reader = self._factory()
        with reader.session():
            _require_run(reader, run_id)
            committed = {m.request_id for m in reader.manifests(run_id) if m.committed}
            return [{"request_id": summary.request_id, "records": summary.records,
                     "bytes": summary.bytes, "committed": summary.request_id in committed}
                    for summary in reader.requests(run_id)]

    def listing(self, run_id: str, request_id: str) -> dict[str, object]:
        """One request: completeness, lengths, and its tensors (see the module).

        Raises:
            NotInStoreError: the store holds no such run, or nothing of that request.
        """
        reader = self._factory()
        with reader.session():
            return _listing(reader, run_id, request_id)[0]

    def safetensors(self, run_id: str,
                    request_id: str) -> tuple[int, Iterator[bytes | memoryview]]:
        """A complete request's captures as a safetensors file: its length, and its
        pieces (header first); rows are read as the pieces are taken.

        Raises:
            LookupError: as :meth:`listing`.
            IncompleteCaptureError: the capture is not complete (the message says why).
        """
        reader = self._factory()
        with reader.session():
            listing, tensors = _listing(reader, run_id, request_id)
        if not listing["complete"]:
            reasons = "; ".join(str(r) for r in listing["missing"])  # type: ignore[attr-defined]
            msg = f"request {request_id!r} of run {run_id!r} is not complete: {reasons}"
            raise IncompleteCaptureError(msg)
        positions = {t.name: [t.positions.start, t.positions.stop, t.positions.step]
                     for t in tensors}
        header: dict[str, object] = {"__metadata__": {
            "run_id": run_id, "request_id": request_id, "positions": json.dumps(positions)}}
        offset = 0
        for t in tensors:
            header[t.name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype],
                              "shape": [len(t.positions), *t.row_shape],
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        prefix = len(head).to_bytes(8, "little") + head
        return len(prefix) + offset, self._pieces(prefix, run_id, request_id, tensors)

    def _pieces(self, prefix: bytes, run_id: str, request_id: str,
                tensors: list[_Tensor]) -> Iterator[bytes | memoryview]:
        yield prefix
        reader = self._factory()
        for piece in _pieces_of(tensors, self._piece_bytes):
            yield _rows(reader, run_id, request_id, piece)


def _pieces_of(tensors: Sequence[_Tensor], piece_bytes: int) -> list[list[_Tensor]]:
    """The export's tensors (in file order, those holding rows) as the pieces it reads
    and sends, each reading at most ``piece_bytes`` of the store (at least one row):
    whole tensors taken together while they fit (one store query reads them all), a
    larger tensor alone in slices of its positions."""
    out: list[list[_Tensor]] = []
    group: list[_Tensor] = []
    size = 0
    for t in tensors:
        if not t.positions:
            continue
        stored = len(t.positions) * t.stored_row_bytes
        if stored > piece_bytes:
            if group:
                out.append(group)
                group, size = [], 0
            per_piece = max(1, piece_bytes // max(1, t.stored_row_bytes))
            out.extend([attrs.evolve(t, positions=t.positions[at : at + per_piece])]
                       for at in range(0, len(t.positions), per_piece))
            continue
        if group and size + stored > piece_bytes:
            out.append(group)
            group, size = [], 0
        group.append(t)
        size += stored
    if group:
        out.append(group)
    return out


def _rows(reader: RecordBatchReader, run_id: str, request_id: str,
          piece: list[_Tensor]) -> memoryview:
    """The rows of a piece's tensors (latest copy of each position), joined in order."""
    batches = reader.batches_within(
        run_id, request_id, captures=[(t.act_name, t.layer_no) for t in piece],
        start=min(t.positions[0] for t in piece), end=max(t.positions[-1] + 1 for t in piece))
    out = bytearray()
    held = _held_by_capture(batches)
    by_capture: dict[tuple[str, int], list[CaptureRecord]] | None = None
    for t in piece:
        span = _one_span(held.get((t.act_name, t.layer_no), []), t)
        if span is not None:  # the common case: one slice of the answer's buffer
            out += span
            continue
        if by_capture is None:  # the general path, one object per record (made once)
            by_capture = _records_by_capture(batches)
        mine = by_capture.get((t.act_name, t.layer_no), [])
        if t.plan.parts == 1:
            part = by_shard(mine, t.plan, t.name)[0]
            out += joined_rows(part, select_rows(part, t.positions), t.row_bytes)
            continue
        whole = combined_rows(mine, t.positions, t.plan, t.act_name, t.layer_no)
        if tuple(whole.shape[1:]) != t.row_shape:
            msg = (f"{t.name}: its {t.plan.parts} parts make rows of shape "
                   f"{list(whole.shape[1:])}, not the {list(t.row_shape)} the export names")
            raise StoreError(msg)
        import torch  # only a tensor-parallel run's parts need it

        out += whole.contiguous().view(torch.uint8).numpy().tobytes()
    return memoryview(out)


def _records_by_capture(
        batches: Sequence[RecordBatch]) -> dict[tuple[str, int], list[CaptureRecord]]:
    """The answer's records, one object each, by hook and layer (the general path:
    retractions, strided positions, tensor-parallel parts)."""
    out: dict[tuple[str, int], list[CaptureRecord]] = {}
    for batch in batches:
        for r in batch.records():
            out.setdefault((r.act_name, r.layer_no), []).append(r)
    return out


_Held = tuple[RecordBatch, int, np.ndarray]
"""A batch, the row bytes of one of its captures, and the indices of that capture's
records in it."""


def _held_by_capture(batches: Sequence[RecordBatch]) -> dict[tuple[str, int], list[_Held]]:
    """Per hook and layer, where its records lie in the answer (one entry per batch and
    stored layout that holds some)."""
    out: dict[tuple[str, int], list[_Held]] = {}
    for batch in batches:
        for c in np.unique(batch.capture).tolist():
            key = batch.captures[c]
            out.setdefault((key.act_name, key.layer_no), []).append(
                (batch, key.row_nbytes, np.flatnonzero(batch.capture == c)))
    return out


def _one_span(held: Sequence[_Held], t: _Tensor) -> memoryview | None:
    """``t``'s rows as one slice of the answer's payload, when they lie so: one part
    (``shard_rank`` 0), consecutive positions, one stored layout, and records that follow
    each other with neither a gap nor an overlap (no retraction) over the positions;
    else None."""
    if t.plan.parts != 1 or t.positions.step != 1 or len(held) != 1:
        return None
    batch, row, index = held[0]
    if batch.shard_rank != 0 or row != t.row_bytes or index[-1] - index[0] + 1 != index.size:
        return None
    start, end = batch.start[index].astype(np.int64), batch.end[index].astype(np.int64)
    lo, hi = t.positions.start, t.positions.stop
    if start[0] > lo or end[-1] < hi or not np.array_equal(start[1:], end[:-1]):
        return None
    first = int(batch.offsets[index[0]]) + (lo - int(start[0])) * row
    return memoryview(batch.payload)[first : first + (hi - lo) * row]  # type: ignore[arg-type]


def _require_run(reader: RecordReader, run_id: str) -> RunInfo:
    run = reader.run(run_id)
    if run is None:
        msg = f"the store holds no run {run_id!r}"
        raise NotInStoreError(msg)
    return run


def _listing(reader: RecordReader, run_id: str,
             request_id: str) -> tuple[dict[str, object], list[_Tensor]]:
    run = _require_run(reader, run_id)
    manifest = reader.manifest(run_id, request_id)
    extents = reader.extents(run_id, request_id)  # one pass: completeness and header
    if manifest is None and not extents.ranges:
        msg = f"run {run_id!r} holds nothing of request {request_id!r}"
        raise NotInStoreError(msg)
    reasons = missing(run_id, request_id, run, manifest, extents.ranges,
                      mixed=extents.mixed)
    tensors = _tensors(extents.layouts, run, manifest) if not reasons and manifest else []
    out: dict[str, object] = {
        "run_id": run_id, "request_id": request_id, "run_status": run.status.value,
        "complete": not reasons, "missing": list(reasons),
        "prompt_tokens": manifest.prompt_tokens if manifest else None,
        "completion_tokens": manifest.completion_tokens if manifest else None,
        "tensors": [t.to_json() for t in tensors],
    }
    return out, tensors


def _tensors(stored: Sequence[RowLayout], run: RunInfo,
             manifest: RequestManifest) -> list[_Tensor]:
    layouts = {(lay.act_name, lay.layer_no): lay for lay in stored}
    rules = run.position_rules()
    tp = run.tensor_parallel
    out: list[_Tensor] = []
    for act, layer in run.captures:
        kept = selected_positions(manifest, act, rules.get((act, layer)))
        layout = layouts.get((act, layer))
        if layout is None:  # no position to hold: nothing stored, nothing to name
            continue
        plan = tp.plan_for_act(act)
        out.append(_Tensor(act, layer, DType.parse(layout.dtype),
                           _whole_row_shape(plan, layout.row_shape), kept, plan))
    return out


def _whole_row_shape(plan: ShardPlan, part_row: tuple[int, ...]) -> tuple[int, ...]:
    """A row's shape once its stored parts are combined (SGLang splits a sharded axis
    evenly over the parts; :func:`_rows` checks it)."""
    if plan.rule is not TpRule.SHARDED or not part_row:
        return part_row
    axis = plan.axis - 1  # row_shape leaves the row axis out
    return (*part_row[:axis], part_row[axis] * plan.parts, *part_row[axis + 1 :])


def _run_json(run: RunInfo) -> dict[str, object]:
    return {"run_id": run.run_id, "status": run.status.value, "model_path": run.model_path,
            "started_at": run.started_at, "stopped_at": run.stopped_at,
            "captures": len(run.captures), "error": run.error}
