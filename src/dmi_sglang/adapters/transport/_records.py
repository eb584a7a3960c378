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
request's decisions end (rows at or past that position are discarded and counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from dmi_sglang.adapters.transport._pool import Bytes1D, Chunk, PayloadPool, readonly
from dmi_sglang.adapters.transport._program import Bytes2D, Group, Program, host_rows
from dmi_sglang.domain.plan import CommitPlan
from dmi_sglang.domain.records import CaptureRecord

__all__ = ["Emitted", "Fill", "HeldRows", "Yielder", "build_records", "copy_row",
           "hold_request_rows", "staging_fill"]

Fill = Callable[[Group, int, int, Chunk], None]
"""Copies segments ``[s0, s1)`` of a group's kept rows into a chunk, as
``[segments, kept rows, row bytes]``."""


def staging_fill(staging: Bytes2D, base: int) -> Fill:
    """A :data:`Fill` from host staging (the step's region starts at ``base``). A group's
    rows are taken from staging once (with a row selection that is a copy), not per chunk."""
    rows_of: dict[int, Bytes2D] = {}

    def fill(group: Group, s0: int, s1: int, chunk: Chunk) -> None:
        rows = rows_of.get(id(group))
        if rows is None:
            rows = rows_of[id(group)] = host_rows(staging, base, group)
        chunk.array.reshape(s1 - s0, group.kept_rows, group.row_nbytes)[...] = rows[s0:s1]
    return fill


class Yielder:
    """Hands the GIL to other threads every few hundred records.

    Building records holds the GIL (one Python object each; the payload bytes are copied
    beforehand with the GIL released). In a long burst the scheduler thread, at each of
    its own GIL releases (every torch call), would wait up to the interpreter's switch
    interval (5 ms) to get it back; a voluntary release every ~0.2 ms of work bounds it.
    """

    __slots__ = ("_records",)

    RECORDS = 128

    def __init__(self) -> None:
        self._records = 0

    def tick(self, records: int) -> None:
        """``records`` records were built."""
        self._records += records
        if self._records >= self.RECORDS:
            self._records = 0
            time.sleep(0)


class Emitted:
    """Records ready for the sink, with the counters the transport reports."""

    __slots__ = ("bytes", "discarded", "records", "rows")

    def __init__(self) -> None:
        self.records: list[CaptureRecord] = []
        self.rows = 0
        self.bytes = 0
        self.discarded = 0

    def add(self, record: CaptureRecord) -> None:
        """One record built elsewhere (a held row)."""
        self.records.append(record)
        self.rows += record.end_token_idx - record.start_token_idx
        self.bytes += len(record.payload)


class HeldRows:
    """The newest request row (``final_logits``) of each request, not stored yet.

    At most one step's request rows per request (one row per request-row capture).
    """

    def __init__(self) -> None:
        self._rows: dict[str, list[CaptureRecord]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rows

    def hold(self, record: CaptureRecord) -> None:
        """Hold ``record`` (call :meth:`confirm` for its request first)."""
        self._rows.setdefault(record.request_id, []).append(record)

    def confirm(self, request_id: str, out: Emitted) -> None:
        """A later row of the request arrived: its held row decided a real token."""
        rows = self._rows.pop(request_id, None)
        if rows:
            for r in rows:
                out.add(r)

    def finish(self, request_id: str, logits_end: int | None, out: Emitted) -> None:
        """The request finished: keep held rows before ``logits_end`` (all when None)."""
        for r in self._rows.pop(request_id, ()):
            if logits_end is not None and r.start_token_idx >= logits_end:
                out.discarded += r.end_token_idx - r.start_token_idx
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
    """Records of one drained step or piece: one per segment and request slice.

    Token rows go out now (slices of pooled chunks, one bulk copy per chunk of segments,
    made by ``fill``: default from ``staging``); request rows are held back (see the
    module docstring; they are read from ``staging``), releasing the rows they confirm.
    ``request_rows=False`` leaves them to a later :func:`hold_request_rows`.
    """
    fill = fill or staging_fill(staging, base)
    segments = plan.segments
    request_groups: list[Group] = []
    yielder = Yielder()
    append = out.records.append
    for group in program.groups:
        if group.request_rows:
            request_groups.append(group)
            continue
        kept, rb = group.kept_rows, group.row_nbytes
        slices = plan.slices(segments[group.positions[0]])
        per = max(1, pool.slab_bytes // max(kept * rb, 1))  # segments per chunk
        for s0 in range(0, group.count, per):
            s1 = min(group.count, s0 + per)
            chunk = pool.alloc((s1 - s0) * kept * rb)
            fill(group, s0, s1, chunk)
            view = chunk.view
            for s, meta in enumerate(group.metas[s0:s1]):
                seg_off = chunk.offset + s * kept * rb
                for sl in slices:
                    a = seg_off + sl.row_offset * rb
                    append(
                        CaptureRecord(
                            run_id, sl.request_id, meta.act_name, meta.layer_no, 0, sl.start,
                            sl.end, meta.dtype, (sl.rows, *meta.dims), view[a : a + sl.rows * rb],
                            seq,
                        )
                    )
                yielder.tick(len(slices))
        out.rows += group.count * kept
        out.bytes += group.count * kept * rb
    if request_groups and request_rows:
        hold_request_rows(run_id, seq, plan, request_groups, staging, base, held, out)


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
    they confirm."""
    per_group = [(g, host_rows(staging, base, g), plan.slices(plan.segments[g.positions[0]]))
                 for g in groups]
    for _, _, slices in per_group:
        for sl in slices:
            held.confirm(sl.request_id, out)
    for group, rows, slices in per_group:
        for s, meta in enumerate(group.metas):
            seg_rows = rows[s]
            for sl in slices:  # request rows: one row per slice
                payload = copy_row(np.ravel(seg_rows[sl.row_offset]))
                held.hold(
                    CaptureRecord(
                        run_id, sl.request_id, meta.act_name, meta.layer_no, 0, sl.start,
                        sl.end, meta.dtype, (1, *meta.dims), payload, seq,
                    )
                )
