"""The per-forward commit plan and the one-commit-per-forward protocol.

A :class:`CommitPlan` says, before a forward runs, every tensor it will capture: hook,
layer, rows kept, bytes, and the aligned byte offset of each segment inside the step's
region of the payload ring. Two variants exist:

* unpadded (eager forwards): capture points see exactly the real rows;
* padded (decode CUDA-graph replay): capture points see ``padded_batch_size`` rows; with
  padding strip on (the default) only the real rows reach the ring, with it off the
  padded rows do and the host strips them.

:class:`StepProtocol` enforces exactly one commit per forward.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

import attrs

from dmi_sglang.domain.hooks import Hook, RowBasis, Selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.shapes import ModelShape, RowSpec
from dmi_sglang.errors import CommitError

__all__ = [
    "DEFAULT_ALIGNMENT",
    "CommitPlan",
    "RecordSlice",
    "Segment",
    "StepProtocol",
    "StepState",
    "align_up",
    "make_plan",
]

DEFAULT_ALIGNMENT = 16
"""Bytes every ring segment starts on (vectorised copies need 16)."""


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment


@attrs.frozen
class RecordSlice:
    """Where one request's rows sit inside a captured segment.

    ``row_offset`` counts rows from the segment's first kept row; the stored token
    range is ``[start, end)``.
    """

    request_id: str
    row_offset: int
    rows: int
    start: int
    end: int


@attrs.frozen
class Segment:
    """One captured tensor of a forward.

    Attributes:
        hook / layer_no: what is captured (``layer_no = -1`` for global hooks).
        row: the row shape and dtype.
        source_rows: rows the capture point sees (padded under graph replay).
        kept_rows: real rows that end up in records.
        ring_rows: rows written to the ring (``kept_rows``, or ``source_rows`` when
            padding strip is off).
        source_index: for request-row hooks, which source rows are kept (requests that
            emit a token), or None when the kept rows are the first ``kept_rows``.
        offset: aligned byte offset inside the step's ring region. Segments are placed
            grouped by row size (then in firing order), so equal-width segments are
            adjacent and equally spaced.
    """

    hook: Hook
    layer_no: int
    row: RowSpec
    source_rows: int
    kept_rows: int
    ring_rows: int
    source_index: tuple[int, ...] | None
    offset: int
    slices: tuple[RecordSlice, ...]

    @property
    def nbytes(self) -> int:
        """Bytes written to the ring."""
        return self.ring_rows * self.row.nbytes

    @property
    def kept_bytes(self) -> int:
        """Bytes that end up in records."""
        return self.kept_rows * self.row.nbytes

    def aligned_bytes(self, alignment: int) -> int:
        """Ring bytes this segment reserves."""
        return align_up(self.nbytes, alignment)


@attrs.frozen
class CommitPlan:
    """Everything one forward captures, decided before it runs."""

    layout: BatchLayout
    padded: bool
    strip: bool
    alignment: int
    segments: tuple[Segment, ...]
    _index: dict[tuple[str, int], Segment] = attrs.field(
        init=False, eq=False, repr=False, hash=False
    )

    def __attrs_post_init__(self) -> None:
        index = {(s.hook.name, s.layer_no): s for s in self.segments}
        object.__setattr__(self, "_index", index)

    @property
    def total_bytes(self) -> int:
        """Ring bytes the whole step reserves (aligned segments)."""
        return sum(s.aligned_bytes(self.alignment) for s in self.segments)

    @property
    def kept_bytes(self) -> int:
        """Bytes that end up in records."""
        return sum(s.kept_bytes for s in self.segments)

    @property
    def entries(self) -> int:
        """Task entries the step needs (one per captured tensor)."""
        return len(self.segments)

    @property
    def largest_segment_bytes(self) -> int:
        """Ring bytes of the largest single segment."""
        return max((s.aligned_bytes(self.alignment) for s in self.segments), default=0)

    def segment_for(self, hook_name: str, layer_no: int) -> Segment | None:
        """The segment a capture point fills, or None when nothing of it is kept."""
        return self._index.get((hook_name, layer_no))

    def pieces(self) -> Iterator[CommitPlan]:
        """The plan split into one-segment plans, for a piecewise commit."""
        for seg in self.segments:
            yield attrs.evolve(self, segments=(attrs.evolve(seg, offset=0),))


def make_plan(
    layout: BatchLayout,
    selection: Selection,
    shape: ModelShape,
    *,
    padded: bool,
    strip: bool = True,
    alignment: int = DEFAULT_ALIGNMENT,
) -> CommitPlan:
    """Plan one forward.

    Args:
        layout: the forward's packed layout.
        selection: the selected hooks and layers.
        shape: the model's sizes (row shapes).
        padded: True for a decode CUDA-graph replay (capture points see the padded
            batch), False for an eager forward.
        strip: drop padding rows on the GPU (``DMX_GPU_PADDING_STRIP``).
        alignment: segment alignment in bytes.
    """
    padding = layout.padded_batch_size - layout.raw_batch_size if padded else 0
    token_slices = tuple(
        RecordSlice(r.request_id, r.row_offset, r.count, r.start, r.end)
        for r in layout.requests
        if r.count > 0
    )
    emitting = [(i, r) for i, r in enumerate(layout.requests) if r.emits_token and r.count > 0]
    logit_slices = tuple(
        RecordSlice(r.request_id, j, 1, r.end - 1, r.end) for j, (_, r) in enumerate(emitting)
    )
    logit_index = tuple(i for i, _ in emitting)
    segments: list[Segment] = []
    for hook, layer_no in selection.captures():
        row = shape.row(hook)
        if hook.row_basis is RowBasis.REQUEST:
            source = layout.raw_batch_size + padding
            kept = len(emitting)
            index = None if logit_index == tuple(range(kept)) else logit_index
            slices = logit_slices
        else:
            source = layout.token_rows + padding
            kept = layout.token_rows
            index = None
            slices = token_slices
        if kept == 0:
            continue
        ring_rows = kept if strip or not padded else source
        segments.append(Segment(hook, layer_no, row, source, kept, ring_rows, index, 0, slices))
    # Offsets group segments of equal row size (stable in firing order): a transport can
    # then move each group between arena, ring and host with one strided copy.
    placed: dict[int, Segment] = {}
    offset = 0
    for i in sorted(range(len(segments)), key=lambda i: segments[i].row.nbytes):
        placed[i] = attrs.evolve(segments[i], offset=offset)
        offset += segments[i].aligned_bytes(alignment)
    ordered = tuple(placed[i] for i in range(len(segments)))
    return CommitPlan(layout, padded, strip, alignment, ordered)


def request_rows(plan: CommitPlan) -> dict[str, int]:
    """Token rows per request in a plan (for checks and statistics)."""
    rows: dict[str, int] = {}
    for r in plan.layout.requests:
        rows[r.request_id] = rows.get(r.request_id, 0) + r.count
    return rows


class StepState(enum.Enum):
    """States of :class:`StepProtocol`."""

    IDLE = "idle"
    FORWARDING = "forwarding"
    COMMITTED = "committed"


class StepProtocol:
    """Exactly one commit per forward.

    ``begin`` -> ``commit`` (once) -> ``end``. A second commit, an ``end`` without a
    commit, a commit outside a forward and a ``begin`` inside a forward raise
    :class:`CommitError`. Forwards that capture nothing still commit (an empty plan).
    """

    def __init__(self) -> None:
        self._state = StepState.IDLE
        self._plan: CommitPlan | None = None
        self._step = 0

    @property
    def state(self) -> StepState:
        """Where the protocol stands."""
        return self._state

    @property
    def step(self) -> int:
        """Number of the current (or last) forward, from 1."""
        return self._step

    @property
    def plan(self) -> CommitPlan | None:
        """The committed plan of the current forward."""
        return self._plan

    def begin(self) -> int:
        """A forward starts; returns its step number."""
        if self._state is not StepState.IDLE:
            msg = (
                f"forward {self._step + 1} began while forward {self._step} is "
                f"{self._state.value}"
            )
            raise CommitError(msg)
        self._step += 1
        self._state = StepState.FORWARDING
        self._plan = None
        return self._step

    def commit(self, plan: CommitPlan) -> None:
        """The forward's plan is final."""
        if self._state is StepState.COMMITTED:
            msg = f"forward {self._step} was committed twice"
            raise CommitError(msg)
        if self._state is StepState.IDLE:
            msg = "commit outside a forward"
            raise CommitError(msg)
        self._plan = plan
        self._state = StepState.COMMITTED

    def end(self) -> CommitPlan:
        """The forward finished; returns its plan."""
        if self._state is not StepState.COMMITTED or self._plan is None:
            msg = f"forward {self._step} ended without a commit"
            self._state = StepState.IDLE
            raise CommitError(msg)
        self._state = StepState.IDLE
        return self._plan

    def abort(self) -> None:
        """The forward raised; forget it so the next one can begin."""
        self._state = StepState.IDLE
        self._plan = None
