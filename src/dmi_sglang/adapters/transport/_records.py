"""Building records from host staging: payload slices, held-back logits rows, counters.

Payloads are read-only ``memoryview`` slices of pooled host slabs (``_pool``): the rows
are copied there with one bulk copy per group or chunk of segments (the GIL is released
during it), then each record only costs its Python object. The copy is the caller's
``fill``: from host staging (:func:`staging_fill`), or straight from the device ring into
the page-locked slab where a group's rows are contiguous there (the drain's direct path:
no host copy at all).

Request rows (``final_logits``) are special: SGLang's overlap scheduler runs one extra
decode forward per request after its last generated token, and the logits row of that
forward decides a token that is never generated, so it must not be stored. Nobody knows
a forward is the extra one while it runs; the scheduler learns a request finished a step
later. So the NEWEST request row of every request is held back (:class:`HeldRows`, one
row per live request, copied out of the shared buffer) until the request's next request
row arrives (it decided a generated token: stored) or a finish notice says where the
request's decisions end (rows at or past that position are discarded and counted). A
decode window's flush holds its rows as columns (:class:`HeldBlock`), not as records.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from dmi_sglang.adapters.transport._pool import Bytes1D, Chunk, PayloadPool, readonly
from dmi_sglang.adapters.transport._program import Bytes2D, Group, Program, host_rows
from dmi_sglang.columns import CaptureKey as RecordKey
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.plan import CommitPlan, RecordSlice
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.errors import CaptureError

Bytes3D = npt.NDArray[np.uint8]

__all__ = ["Emitted", "Fill", "HeldBlock", "HeldRows", "Span", "back_to_back", "build_records",
           "chunk_batch", "clip", "copy_row", "hold_request_rows", "spans", "staging_fill"]


@attrs.frozen
class Span:
    """Kept rows ``[r0, r1)`` of a group's segments ``[s0, s1)``: what one chunk holds."""

    s0: int
    s1: int
    r0: int
    r1: int


Fill = Callable[[Group, Span, Chunk], None]
"""Copies a :class:`Span` of a group's kept rows into a chunk, as
``[segments, rows, row bytes]``."""


MIN_RUN_SHARE = 8
"""A run of a wide segment's rows starts in the slab being filled when it fits at least
1/``MIN_RUN_SHARE`` of a slab there (or the segment's remaining rows), else in a new slab."""


def spans(group: Group, pool: PayloadPool) -> Iterator[Span]:
    """A group's kept rows in pieces that fit ``pool``'s slabs: whole segments while a
    segment fits a slab, else each segment's rows in runs, each as large as the room left
    in the slab being filled (so the runs pack the slabs) or a whole new slab. A segment
    wider than a slab would otherwise need memory of its own, which is pageable: a
    device copy into it waits for itself, into pages touched for the first time. A row
    wider than a slab is a piece of its own. Lazy: allocate each span's chunk from
    ``pool`` before asking for the next."""
    kept, rb, slab = group.kept_rows, group.row_nbytes, pool.slab_bytes
    if kept * rb <= slab:
        per = max(1, slab // max(kept * rb, 1))
        for s0 in range(0, group.count, per):
            yield Span(s0, min(group.count, s0 + per), 0, kept)
        return
    whole = max(1, slab // max(rb, 1))
    least = max(1, whole // MIN_RUN_SHARE)
    for s in range(group.count):
        r0 = 0
        while r0 < kept:
            left = kept - r0
            fits = pool.room() // max(rb, 1)
            n = min(left, fits if fits >= min(least, left) else whole)
            yield Span(s, s + 1, r0, r0 + n)
            r0 += n


def clip(slices: Sequence[RecordSlice], r0: int, r1: int) -> tuple[RecordSlice, ...]:
    """The parts of ``slices`` within kept rows ``[r0, r1)``, their row offsets from
    ``r0``. A slice of several rows holds consecutive positions (one per row, as
    :func:`~dmi_sglang.domain.plan.make_plan`'s slices and read plans make them), so a
    part keeps positions ``start + a .. start + b`` for its rows ``a .. b``."""
    out = []
    for sl in slices:
        a, b = max(sl.row_offset, r0), min(sl.row_offset + sl.rows, r1)
        if a < b:
            if sl.end - sl.start != sl.rows:
                msg = f"a slice of {sl.rows} rows over positions [{sl.start}, {sl.end})"
                raise CaptureError(msg)
            first = sl.start + a - sl.row_offset
            out.append(RecordSlice(sl.request_id, a - r0, b - a, first, first + b - a))
    return tuple(out)


def staging_fill(staging: Bytes2D, base: int) -> Fill:
    """A :data:`Fill` from host staging (the step's region starts at ``base``). A group's
    rows are taken from staging once (with a row selection that is a copy), not per chunk."""
    rows_of: dict[int, Bytes2D] = {}

    def fill(group: Group, span: Span, chunk: Chunk) -> None:
        rows = rows_of.get(id(group))
        if rows is None:
            rows = rows_of[id(group)] = host_rows(staging, base, group)
        chunk.array.reshape(span.s1 - span.s0, span.r1 - span.r0, group.row_nbytes)[...] = (
            rows[span.s0 : span.s1, span.r0 : span.r1])
    return fill


@attrs.frozen(eq=False)
class HeldBlock:
    """The request rows of one group that a decode window's flush holds back, as columns
    over the memory the device copied them into (no Python object per record).

    Row ``i`` is the newest request row of request ``request_ids[i]`` (position
    ``positions[i]``, capture step ``seqs[i]``): one row of each of ``captures``, back to
    back, ``row_nbytes`` each, at ``memory[i * len(captures) * row_nbytes:]``.

    Raises:
        CaptureError: columns or memory of other shapes than that.
    """

    run_id: str
    captures: tuple[RecordKey, ...]
    row_nbytes: int = attrs.field(kw_only=True)
    request_ids: Sequence[str] = attrs.field(kw_only=True)
    positions: npt.NDArray[np.int64] = attrs.field(kw_only=True, repr=False)
    seqs: npt.NDArray[np.int64] = attrs.field(kw_only=True, repr=False)
    memory: Bytes1D = attrs.field(kw_only=True, repr=False)

    def __attrs_post_init__(self) -> None:
        n, nseg, rb = len(self.request_ids), len(self.captures), self.row_nbytes
        if (self.positions.shape != (n,) or self.seqs.shape != (n,)
                or self.memory.shape != (n * nseg * rb,)):
            msg = (f"a held block of {n} requests x {nseg} captures x {rb} bytes "
                   f"with positions of shape {self.positions.shape}, steps of shape "
                   f"{self.seqs.shape} and memory of shape {self.memory.shape}")
            raise CaptureError(msg)

    def batch(self, lo: int, hi: int) -> RecordBatch:
        """Rows ``lo:hi`` as one batch over the block's memory (no copy): request by
        request, capture by capture."""
        n, nseg, rb = hi - lo, len(self.captures), self.row_nbytes
        start = np.repeat(self.positions[lo:hi], nseg).astype(np.int32)
        return RecordBatch(
            self.run_id, tuple(self.request_ids[lo:hi]), self.captures,
            np.repeat(np.arange(n, dtype=np.int32), nseg),
            np.tile(np.arange(nseg, dtype=np.int32), n), start, start + 1,
            np.repeat(self.seqs[lo:hi], nseg),
            np.arange(n * nseg + 1, dtype=np.int64) * rb,
            self.memory[lo * nseg * rb : hi * nseg * rb],
        )

    def records(self, i: int) -> list[CaptureRecord]:
        """Row ``i`` as records with payloads of their own (copies)."""
        nseg, rb = len(self.captures), self.row_nbytes
        pos, at = int(self.positions[i]), i * nseg * rb
        return [CaptureRecord(self.run_id, self.request_ids[i], key.act_name, key.layer_no, 0,
                              pos, pos + 1, key.dtype, (1, *key.dims),
                              copy_row(self.memory[at + s * rb : at + (s + 1) * rb]),
                              int(self.seqs[i]))
                for s, key in enumerate(self.captures)]


class _BlockRow:
    """What :class:`HeldRows` holds for row ``index`` of a :class:`HeldBlock`."""

    __slots__ = ("block", "index")

    def __init__(self, block: HeldBlock, index: int) -> None:
        self.block = block
        self.index = index

    @property
    def seq(self) -> int:
        """The capture step of the row."""
        return int(self.block.seqs[self.index])

    @property
    def start_token_idx(self) -> int:
        """The row's position."""
        return int(self.block.positions[self.index])

    @property
    def rows(self) -> int:
        """Tensor rows: one per capture."""
        return len(self.block.captures)


_Held = CaptureRecord | _BlockRow


class Emitted:
    """Record batches ready for the sink, with the counters the transport reports.

    Held request rows that are released arrive one by one (:meth:`add`), in order:
    consecutive records become one batch, and consecutive rows of held blocks one batch
    per block and run of its rows.
    """

    __slots__ = ("batches", "bytes", "copied", "discarded", "loose", "records", "rows")

    def __init__(self) -> None:
        self.batches: list[RecordBatch] = []
        self.loose: list[_Held] = []
        self.copied = 0
        """Payload bytes the host copied to make the loose records' batches."""
        self.records = 0
        self.rows = 0
        self.bytes = 0
        self.discarded = 0

    def add(self, record: _Held) -> None:
        """One record built elsewhere, or a held block's row (a released held row)."""
        self.loose.append(record)
        if isinstance(record, _BlockRow):
            n = record.rows
            self.records += n
            self.rows += n
            self.bytes += n * record.block.row_nbytes
            return
        self.records += 1
        self.rows += record.end_token_idx - record.start_token_idx
        self.bytes += len(record.payload)

    def add_batch(self, batch: RecordBatch) -> None:
        """A batch built from device or staging memory (after the loose records so far:
        arrival order is kept)."""
        self._close_loose()
        self.batches.append(batch)
        self.records += len(batch)
        self.rows += batch.rows
        self.bytes += batch.nbytes

    def batches_out(self) -> list[RecordBatch]:
        """Every batch, in arrival order (loose records become batches)."""
        self._close_loose()
        return self.batches

    def _close_loose(self) -> None:
        loose, self.loose = self.loose, []
        # runs of records, runs of block rows, in arrival order
        for of_blocks, run in itertools.groupby(loose, key=lambda r: isinstance(r, _BlockRow)):
            if of_blocks:
                self.batches.extend(_block_batches(list(run)))  # type: ignore[arg-type]
                continue
            records: list[CaptureRecord] = list(run)  # type: ignore[arg-type]
            span = back_to_back(records)
            batch = RecordBatch.from_records(records, payload=span)
            if span is None:
                self.copied += batch.nbytes
            self.batches.append(batch)


def _block_batches(rows: Sequence[_BlockRow]) -> Iterator[RecordBatch]:
    """Released rows of held blocks that arrived one after another: per block (in order
    of first arrival), a batch per run of consecutive rows (one for all of them when every
    row of the block is released together, as it is at the next flush). Blocks of other
    captures hold no record of the same request and capture, so none changes places;
    should two blocks of the same captures be among the rows, they go in arrival order
    (a batch per run of consecutive rows of one block)."""
    rank: dict[int, int] = {}  # a block's order of first arrival
    captures: set[tuple[RecordKey, ...]] = set()
    for r in rows:
        if id(r.block) not in rank:
            rank[id(r.block)] = len(rank)
            captures.add(r.block.captures)
    if len(captures) == len(rank):
        rows = sorted(rows, key=lambda r: (rank[id(r.block)], r.index))
    first = 0  # a batch per run of rows that follow each other in one block
    for i in range(1, len(rows) + 1):
        if i < len(rows) and rows[i].block is rows[first].block and (
                rows[i].index == rows[i - 1].index + 1):
            continue
        yield rows[first].block.batch(rows[first].index, rows[i - 1].index + 1)
        first = i


def back_to_back(records: Sequence[CaptureRecord]) -> Bytes1D | None:
    """The one buffer span the records' payloads fill back to back, in order (a record's
    memory of its own, or records sliced from one buffer in order), or None when they do
    not."""
    first = records[0].payload
    base = first.obj if isinstance(first, memoryview) else None
    if not isinstance(base, np.ndarray) or base.dtype != np.uint8 or base.ndim != 1:
        return None
    origin = _address(base)
    start = at = _address(first) - origin
    for r in records:
        view = r.payload
        if (not isinstance(view, memoryview) or view.obj is not base
                or _address(view) != origin + at):
            return None
        at += view.nbytes
    if start < 0 or at > base.shape[0]:
        return None
    span: Bytes1D = base[start:at]
    return span


def _address(buffer: memoryview | np.ndarray) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0])


class HeldRows:
    """The newest request row (``final_logits``) of each request, not stored yet.

    At most one step's request rows per request (one row per request-row capture).
    """

    def __init__(self) -> None:
        self._rows: dict[str, list[_Held]] = {}
        self._pinned: set[str] = set()
        """Requests whose held rows are views of shared pooled memory."""
        self.copied = 0
        """Payload bytes the host copied to hold rows (a prefill's, see :meth:`hold`) and
        to keep those that waited past the next flush (:meth:`detach_pinned`)."""

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rows

    def hold(self, record: CaptureRecord, *, pinned: bool = False,
             copied: bool = True) -> None:
        """Hold ``record`` (call :meth:`confirm` for its request first); ``pinned``: its
        payload is a view of memory it shares with other rows (see
        :meth:`detach_pinned`); ``copied``: the host copied its payload to hold it (a
        window flush's held rows arrive by device copy)."""
        if copied:
            self.copied += len(record.payload)
        self._rows.setdefault(record.request_id, []).append(record)
        if pinned:
            self._pinned.add(record.request_id)

    def hold_block(self, block: HeldBlock) -> None:
        """Hold every row of ``block`` (call :meth:`confirm` for its requests first): each
        is its request's newest request rows of the block's captures, in memory the rows
        share (see :meth:`detach_pinned`), filled by device copy."""
        rows, pinned = self._rows, self._pinned
        for i, request_id in enumerate(block.request_ids):
            rows.setdefault(request_id, []).append(_BlockRow(block, i))
            pinned.add(request_id)

    def detach_pinned(self) -> None:
        """Give the rows that still share memory memory of their own: they waited past
        the flush that should have confirmed them (a retracted request), and must not
        keep a whole pooled slab for one row."""
        for request_id in self._pinned:
            rows = self._rows.get(request_id)
            if rows:
                own: list[CaptureRecord] = []
                for r in rows:
                    if isinstance(r, _BlockRow):
                        own.extend(r.block.records(r.index))
                    else:
                        own.append(attrs.evolve(r, payload=copy_row(np.frombuffer(
                            r.payload, dtype=np.uint8))))
                self._rows[request_id] = [*own]
                self.copied += sum(len(r.payload) for r in own)
        self._pinned.clear()

    def confirm(self, request_id: str, out: Emitted, *, before: int | None = None) -> None:
        """A later row of the request arrived: its held rows decided a real token.

        ``before``: the capture step (``seq``) of the row that arrived; only rows of
        earlier steps are confirmed (a piecewise step's parts share one ``seq``: the
        rows an earlier part of the same step held stay held). None: every held row.
        """
        rows = self._rows.pop(request_id, None)
        if rows and before is not None and rows[-1].seq >= before:  # held in step order
            self._rows[request_id] = [r for r in rows if r.seq >= before]
            rows = [r for r in rows if r.seq < before]
        else:
            self._pinned.discard(request_id)
        if rows:
            for r in rows:
                out.add(r)

    def finish(self, request_id: str, logits_end: int | None, out: Emitted) -> None:
        """The request finished: keep held rows before ``logits_end`` (all when None)."""
        self._pinned.discard(request_id)
        for r in self._rows.pop(request_id, ()):
            if logits_end is not None and r.start_token_idx >= logits_end:
                out.discarded += r.rows
            else:
                out.add(r)

    def release_all(self, out: Emitted) -> None:
        """Store every held row (the run stops)."""
        for request_id in list(self._rows):
            self.confirm(request_id, out)


def copy_row(row: Bytes1D) -> memoryview:
    """A payload of its own holding a copy of ``row``.

    Held rows may wait long (a retracted request), so they must not pin a pooled slab;
    they are few (one per live request) and malloc reuses their memory.
    """
    own = np.empty(row.nbytes, dtype=np.uint8)
    own[:] = row
    return readonly(own)


class _SliceRows:
    """Slices as columns (rows, not bytes): request ids (distinct, in order), request
    index, start, end, first row, rows; and whether they tile the rows they cover from
    row 0 on."""

    __slots__ = ("at", "end", "ids", "request", "size", "slices", "start", "tiled")

    def __init__(self, slices: Sequence[RecordSlice]) -> None:
        self.slices = slices  # kept alive: the cache below compares identities
        ids: dict[str, int] = {}
        n = len(slices)
        self.request = np.empty(n, dtype=np.int32)
        self.start = np.empty(n, dtype=np.int32)
        self.end = np.empty(n, dtype=np.int32)
        self.at = np.empty(n, dtype=np.int64)
        self.size = np.empty(n, dtype=np.int64)
        for i, sl in enumerate(slices):
            self.request[i] = ids.setdefault(sl.request_id, len(ids))
            self.start[i], self.end[i] = sl.start, sl.end
            self.at[i], self.size[i] = sl.row_offset, sl.rows
        self.ids = tuple(ids)
        self.tiled = bool(n) and self.at[0] == 0 and bool(
            np.all(self.at[1:] == self.at[:-1] + self.size[:-1]))


_last_slices: list[_SliceRows] = []
"""The slices last turned into columns: every group of a step (and every chunk of a
group) has the same slices object, so they are converted once per step."""


def _slice_columns(slices: Sequence[RecordSlice], rb: int) -> tuple[
        tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """Per slice: request ids (distinct, in order), request index, start, end, byte offset
    in a segment, byte size; and whether the slices tile the segment's kept rows."""
    cols = _last_slices[0] if _last_slices else None
    if cols is None or cols.slices is not slices:
        cols = _SliceRows(slices)
        _last_slices[:] = [cols]
    return (cols.ids, cols.request, cols.start, cols.end, cols.at * rb, cols.size * rb,
            cols.tiled)


def chunk_batch(  # noqa: PLR0917 - one chunk's whole context
    run_id: str,
    labels: tuple[RecordKey, ...],
    slices: Sequence[RecordSlice],
    seq: int,
    rows: Bytes3D,
    kept_rows: int,
) -> RecordBatch | None:
    """The records of ``rows`` (``[segments, kept rows, row bytes]``, contiguous: a
    pooled chunk filled by one bulk copy), one per segment and slice, segment-major.

    The payload is ``rows`` itself when the slices tile the kept rows (the normal
    case); otherwise the sliced rows are gathered into a buffer of their own.
    """
    nseg, _, rb = rows.shape
    if not slices or not nseg:
        return None
    ids, request, start, end, at, size, tiled = _slice_columns(slices, rb)
    nsl = len(slices)
    seg_bytes = kept_rows * rb
    flat = rows.reshape(-1)
    if tiled and int(at[-1] + size[-1]) == seg_bytes:
        payload = flat
    else:  # rows outside every slice: keep only the sliced ones, in record order
        starts = (np.arange(nseg, dtype=np.int64)[:, None] * seg_bytes + at[None, :]).ravel()
        payload = np.concatenate([flat[a : a + n] for a, n in
                                  zip(starts.tolist(), np.tile(size, nseg).tolist(),
                                      strict=True)])
    offsets = np.zeros(nseg * nsl + 1, dtype=np.int64)
    np.cumsum(np.tile(size, nseg), out=offsets[1:])
    return RecordBatch(
        run_id, ids, labels,
        np.tile(request, nseg), np.repeat(np.arange(nseg, dtype=np.int32), nsl),
        np.tile(start, nseg), np.tile(end, nseg), np.full(nseg * nsl, seq, dtype=np.int64),
        offsets, payload,
    )


def build_records(
    run_id: str,
    plan: CommitPlan,
    program: Program,
    staging: Bytes2D,
    base: int,
    *,
    seq: int,
    pool: PayloadPool,
    held: HeldRows,
    out: Emitted,
    fill: Fill | None = None,
    request_rows: bool = True,
) -> None:
    """Record batches of one drained step or piece: one record per segment and request
    slice (a slice split where a chunk ends), one batch per chunk (:func:`spans`).

    Token rows go out now (pooled chunks, one bulk copy per chunk of segments, made by
    ``fill``: default from ``staging``); request rows are held back (see the module
    docstring; they are read from ``staging``), releasing the rows they confirm.
    ``request_rows=False`` leaves them to a later :func:`hold_request_rows`.
    """
    fill = fill or staging_fill(staging, base)
    segments = plan.segments
    request_groups: list[Group] = []
    for group, labels in zip(program.groups, program.labels, strict=True):
        if group.request_rows:
            request_groups.append(group)
            continue
        kept, rb = group.kept_rows, group.row_nbytes
        slices = plan.slices(segments[group.positions[0]])
        for span in spans(group, pool):
            n, nseg = span.r1 - span.r0, span.s1 - span.s0
            chunk = pool.alloc(nseg * n * rb)
            fill(group, span, chunk)
            part = slices if n == kept else clip(slices, span.r0, span.r1)
            batch = chunk_batch(run_id, labels[span.s0 : span.s1], part, seq,
                                chunk.array.reshape(nseg, n, rb), n)
            if batch is not None:
                out.add_batch(batch)
    if request_groups and request_rows:
        hold_request_rows(run_id, seq, plan, request_groups, staging, base, held, out)


_FINAL = (PositionRule.LAST_PROMPT, PositionRule.LAST)


def hold_request_rows(  # noqa: PLR0917 - the step's whole context
    run_id: str,
    seq: int,
    plan: CommitPlan,
    groups: Iterable[Group],
    staging: Bytes2D,
    base: int,
    held: HeldRows,
    out: Emitted,
) -> None:
    """Hold the request rows of ``groups`` (read from ``staging``), releasing the rows
    they confirm. Rows kept by ``last_prompt`` go out at once: the last prompt position's
    row decides the first generated token, never the overlap scheduler's extra forward,
    and no later row of the request would ever confirm it. So do ``last`` rows (a read
    plan's, of finished requests): they are final, and confirm nothing."""
    # each segment by its own rule and slices: a copy group may join segments of
    # different rules whose rows happen to be alike
    segments = [(group.metas[s], rows[s], plan.segments[at])
                for group in groups
                for rows in (host_rows(staging, base, group),)
                for s, at in enumerate(group.positions)]
    for _, _, seg in segments:
        if seg.positions.rule is not PositionRule.LAST:
            for sl in plan.slices(seg):
                held.confirm(sl.request_id, out, before=seq)
    for meta, seg_rows, seg in segments:
        keep = out.add if seg.positions.rule in _FINAL else held.hold
        for sl in plan.slices(seg):  # request rows: one row per slice
            payload = copy_row(np.ravel(seg_rows[sl.row_offset]))
            keep(CaptureRecord(
                run_id, sl.request_id, meta.act_name, meta.layer_no, 0, sl.start,
                sl.end, meta.dtype, (1, *meta.dims), payload, seq,
            ))
