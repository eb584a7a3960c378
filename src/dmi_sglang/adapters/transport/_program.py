"""Copy programs: how one step's segments move, as few strided copies as possible.

A :class:`Program` is derived once per plan *structure* (rows per segment, padding,
strip) and cached; only record slices change from step to step. It groups the plan's
segments into runs of equal row size, equal row count and equal spacing, both in the
ring and in the arena, so that moving a group is one strided copy on the device (arena
-> ring after a graph replay) and one strided view on the host (staging -> records).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import attrs
import numpy as np
import numpy.typing as npt
import torch

from dmi_sglang.adapters.transport._arena import Arena, CaptureKey
from dmi_sglang.columns import CaptureKey as RecordKey
from dmi_sglang.domain.hooks import RowBasis
from dmi_sglang.domain.plan import CommitPlan, Segment, align_up
from dmi_sglang.errors import CaptureError

__all__ = ["Group", "Program", "SegmentMeta", "build_program", "host_rows", "plan_key"]

RING_ALIGNMENT = 16
"""Every ring region starts on this boundary (regions are reserved in multiples of it)."""

Bytes2D = npt.NDArray[np.uint8]


@attrs.frozen
class SegmentMeta:
    """What a record of one segment is labelled with."""

    key: CaptureKey
    act_name: str
    layer_no: int
    dtype: str
    dims: tuple[int, ...]


@attrs.frozen
class Group:
    """Equally spaced segments of one row size and row count, moved together.

    Attributes:
        positions: indices into ``plan.segments``, in ring order.
        source_rows: rows each segment's capture has (the arena's, for padded plans).
        ring_rows / kept_rows: rows in the ring per segment / rows kept in records.
        host_index: rows of the ring copy the host keeps when they are not the first
            ``kept_rows`` (padding strip off with a row selection), else None.
        gather: rows the device gathers from the arena (strip on with a row selection).
        ring_offset / ring_stride: first segment's offset in the step region, spacing.
        arena_offset / arena_stride: the same in the arena (padded plans only, else -1).
        elem: bytes per element of the device copy (8, 4, 2 or 1).
        request_rows: the segments hold request rows (``final_logits``): one row per
            request that emits a token, held back by the drain until confirmed.
    """

    positions: tuple[int, ...]
    metas: tuple[SegmentMeta, ...]
    row_nbytes: int
    source_rows: int
    ring_rows: int
    kept_rows: int
    host_index: tuple[int, ...] | None
    gather: tuple[int, ...] | None
    ring_offset: int
    ring_stride: int
    arena_offset: int
    arena_stride: int
    elem: int
    request_rows: bool = False

    @property
    def count(self) -> int:
        """Segments in the group."""
        return len(self.positions)

    @property
    def dense(self) -> bool:
        """The kept rows of all segments are one contiguous span of the ring (from
        ``ring_offset``, ``count * kept_rows * row_nbytes`` bytes)."""
        return (self.host_index is None and self.ring_rows == self.kept_rows
                and (self.count == 1 or self.ring_stride == self.kept_rows * self.row_nbytes))


class Program:
    """The cached copy program of a plan structure (see the module docstring)."""

    __slots__ = (
        "_arena_views",
        "_indices",
        "arena_checked",
        "direct",
        "entries",
        "groups",
        "host_key",
        "host_row_bytes",
        "labels",
        "reserve_bytes",
    )

    def __init__(self, groups: tuple[Group, ...], total_bytes: int) -> None:
        self.groups = groups
        self.entries = sum(g.count for g in groups)
        self.reserve_bytes = align_up(total_bytes, RING_ALIGNMENT)
        self.host_key: Hashable = tuple((g.row_nbytes, *(m.key for m in g.metas)) for g in groups)
        self.host_row_bytes = sum(g.count * g.row_nbytes for g in groups)
        self.labels = tuple(tuple(RecordKey(m.act_name, m.layer_no, m.dtype, m.dims)
                                  for m in g.metas) for g in groups)
        """Per group, what its segments' records are labelled with (the batches'
        ``captures``)."""
        self.direct = any(not g.request_rows for g in groups) and all(
            g.dense for g in groups if not g.request_rows)
        """Every token group's kept rows lie contiguous in the ring: the drain may copy
        them from the device straight into payload memory (request rows, held back one
        step, still go through staging)."""
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}
        self._arena_views: dict[int, list[torch.Tensor]] = {}
        """Per arena slot (by its byte offset), each group's places in it (made once)."""
        self.arena_checked = False

    def index(self, rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A cached device index tensor of ``rows``."""
        cached = self._indices.get(rows)
        if cached is None:
            cached = torch.tensor(rows, dtype=torch.int64, device=device)
            self._indices[rows] = cached
        return cached

    def copy_from_arena(
        self, base: int, *, arena_wide: dict[int, torch.Tensor],
        ring_wide: dict[int, torch.Tensor], slot_offset: int = 0,
    ) -> None:
        """Queue the arena -> ring copies of a replayed step on the current stream, from
        the arena slot that starts ``slot_offset`` bytes into the arena.

        Two or more groups copied whole go with one ``torch._foreach_copy_`` call: the
        calling thread (the scheduler's, at a decode step's end) releases and retakes the
        GIL once for them all instead of once a group, and each retake may wait for
        another thread's Python (the drain's). One goes by ``copy_``: a dense pair alone
        would take ``_foreach_copy_``'s kernel for many small tensors, where ``copy_``
        makes one device memcpy."""
        views = self._arena_views.get(slot_offset)
        if views is None:
            views = [_arena_view(g, arena_wide, slot_offset) for g in self.groups]
            self._arena_views[slot_offset] = views
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for g, src in zip(self.groups, views, strict=True):
            e = g.elem
            if g.gather is None:
                width = g.ring_rows * g.row_nbytes // e
                dsts.append(ring_wide[e].as_strided(
                    (g.count, width), (g.ring_stride // e, 1), (base + g.ring_offset) // e
                ))
                srcs.append(src)
                continue
            # every segment of the group keeps the same rows: one gather for all of them
            row = g.row_nbytes // e
            dst = ring_wide[e].as_strided(
                (g.count, g.ring_rows, row), (g.ring_stride // e, row, 1),
                (base + g.ring_offset) // e,
            )
            torch.index_select(src, 1, self.index(g.gather, src.device), out=dst)
        if len(dsts) > 1:
            torch._foreach_copy_(dsts, srcs)
        elif dsts:
            dsts[0].copy_(srcs[0])

    def check_arena(self, plan: CommitPlan, arena: Arena) -> None:
        """Raise unless every segment's slot was recorded with enough rows.

        Raises:
            CaptureError: a capture point never ran during graph capture, so its slot
                would hold stale bytes.
        """
        for g in self.groups:
            for pos, meta in zip(g.positions, g.metas, strict=True):
                need = plan.segments[pos].source_rows
                if arena.written.get(meta.key, 0) < need:
                    msg = (
                        f"capture point {meta.key} was not recorded in the decode graph for "
                        f"{need} rows (installed after graph capture?); its slot is stale"
                    )
                    raise CaptureError(msg)


def _arena_view(group: Group, arena_wide: dict[int, torch.Tensor],
                slot_offset: int) -> torch.Tensor:
    """A group's places in one arena slot: ``[segments, row elements]`` when every row
    is copied, ``[segments, source rows, row elements]`` when the device gathers some of
    them."""
    e = group.elem
    stride = group.arena_stride // e
    start = (slot_offset + group.arena_offset) // e
    if group.gather is None:
        return arena_wide[e].as_strided(
            (group.count, group.ring_rows * group.row_nbytes // e), (stride, 1), start)
    row = group.row_nbytes // e
    return arena_wide[e].as_strided(
        (group.count, group.source_rows, row), (stride, row, 1), start)


def plan_key(plan: CommitPlan) -> Hashable:
    """What determines the structure of a plan made by ``make_plan`` (not its slices).

    ``make_plan`` gives every token-row segment of one position rule the same rows and
    every request-row segment of one rule the same rows, so the forward's row counts,
    the first and the last segment, the rows each rule keeps (``plan.ruled_rows``) and
    the rows request-row segments without a rule keep (``plan.logit_rows``) describe
    them all: the key costs O(1) per step instead of O(segments). Plans from
    anything else must not share a transport's cache (pieces are never cached).
    """
    segs = plan.segments
    if not segs:
        return (plan.padded, plan.strip, plan.alignment, 0)
    first, last = segs[0], segs[-1]
    batch = plan.batch
    return (
        plan.padded, plan.strip, plan.alignment, len(segs), batch.padded_batch_size,
        batch.raw_batch_size, batch.token_rows,
        first.hook.name, first.layer_no, first.source_rows, first.kept_rows, first.ring_rows,
        first.source_index, last.hook.name, last.layer_no, last.source_rows, last.kept_rows,
        last.ring_rows, last.source_index, plan.ruled_rows, plan.logit_rows,
    )


def _meta(seg: Segment) -> SegmentMeta:
    return SegmentMeta(
        (seg.hook.name, seg.layer_no), seg.hook.act_name, seg.layer_no,
        seg.row.dtype.value, seg.row.dims,
    )


def _same_kind(a: Segment, b: Segment) -> bool:
    # Only the bytes matter for moving rows; each segment keeps its own dtype and dims.
    return (
        a.row.nbytes == b.row.nbytes and a.kept_rows == b.kept_rows and a.ring_rows == b.ring_rows
        and a.source_rows == b.source_rows and a.source_index == b.source_index
        and a.hook.row_basis is b.hook.row_basis
    )


def build_program(plan: CommitPlan, arena: Arena) -> Program:
    """Derive the copy program of ``plan``.

    Raises:
        CaptureError: the plan captures something outside the transport's selection.
    """
    segs = plan.segments
    for seg in segs:
        if (seg.hook.name, seg.layer_no) not in arena:
            msg = f"plan captures {(seg.hook.name, seg.layer_no)}, which is not selected"
            raise CaptureError(msg)
    runs: list[list[int]] = []
    for i in sorted(range(len(segs)), key=lambda i: segs[i].offset):
        run = runs[-1] if runs else None
        if run is not None and _same_kind(segs[run[0]], segs[i]):
            step = _spacing(plan, run[-1], i, arena)
            if step[0] > 0 and step[1] >= 0 and (
                len(run) == 1 or step == _spacing(plan, run[0], run[1], arena)
            ):
                run.append(i)
                continue
        runs.append([i])
    groups = tuple(_group(plan, run, arena) for run in runs)
    return Program(groups, plan.total_bytes)


def _spacing(plan: CommitPlan, i: int, j: int, arena: Arena) -> tuple[int, int]:
    """Ring and (padded plans only) arena distance from segment ``i`` to ``j``."""
    a, b = plan.segments[i], plan.segments[j]
    if not plan.padded:
        return b.offset - a.offset, 0
    offsets = arena.offsets
    arena_step = offsets[(b.hook.name, b.layer_no)] - offsets[(a.hook.name, a.layer_no)]
    return b.offset - a.offset, arena_step if arena_step > 0 else -1


def _group(plan: CommitPlan, run: list[int], arena: Arena) -> Group:
    segs = plan.segments
    first = segs[run[0]]
    ring_stride, arena_stride = _spacing(plan, run[0], run[1], arena) if len(run) > 1 else (0, 0)
    key = (first.hook.name, first.layer_no)
    selected = first.source_index
    stripped = first.ring_rows == first.kept_rows
    gather = selected if plan.padded and stripped and selected is not None else None
    host_index = selected if not stripped and selected is not None else None
    arena_offset = arena.offsets[key] if plan.padded else -1
    nbytes = first.ring_rows * first.row.nbytes
    # a gather moves single rows: their width must be whole elements too
    row = first.row.nbytes if gather is not None else 0
    align = math.gcd(nbytes, row, ring_stride, arena_stride, first.offset,
                     max(arena_offset, 0), 8)
    return Group(
        positions=tuple(run),
        metas=tuple(_meta(segs[i]) for i in run),
        row_nbytes=first.row.nbytes,
        source_rows=first.source_rows,
        ring_rows=first.ring_rows,
        kept_rows=first.kept_rows,
        host_index=host_index,
        gather=gather,
        ring_offset=first.offset,
        ring_stride=ring_stride,
        arena_offset=arena_offset,
        arena_stride=arena_stride,
        elem=max(e for e in (8, 4, 2, 1) if align % e == 0),
        request_rows=first.hook.row_basis is RowBasis.REQUEST,
    )


def host_rows(staging: Bytes2D, base: int, group: Group) -> Bytes2D:
    """The kept rows of a group in host staging, as ``[segments, kept rows, row bytes]``."""
    rows = np.ndarray(
        (group.count, group.ring_rows, group.row_nbytes),
        dtype=np.uint8,
        buffer=staging,
        offset=base + group.ring_offset,
        strides=(group.ring_stride, group.row_nbytes, 1),
    )
    if group.host_index is not None:
        return rows[:, list(group.host_index), :]
    if group.ring_rows != group.kept_rows:
        return rows[:, : group.kept_rows, :]
    return rows
