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
import functools
from collections.abc import Callable, Iterator, Sequence

import attrs

from dmi_sglang.domain.hooks import Hook, RowBasis, Selection, hook_by_name
from dmi_sglang.domain.layout import BatchLayout, ForwardKind
from dmi_sglang.domain.positions import PositionRule, Positions
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
    "emitting_rows",
    "make_plan",
    "make_read_plan",
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
        positions: the capture's position rule as it applies to this forward (the rows
            of the positions it keeps are in ``source_index``).
    """

    hook: Hook
    layer_no: int
    row: RowSpec
    source_rows: int
    kept_rows: int
    ring_rows: int
    source_index: tuple[int, ...] | None
    offset: int
    positions: Positions = attrs.field(factory=Positions)

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
class _Structure:
    """The layout-independent part of a plan, shared by every step of the same shape."""

    segments: tuple[Segment, ...]
    index: dict[tuple[str, int], Segment] = attrs.field(eq=False, hash=False)
    total_bytes: int
    kept_bytes: int
    ruled_rows: tuple[tuple[RowBasis, Positions, tuple[int, ...] | None, int], ...] = ()
    indexed: int = 0
    """Rows the row selections index (rules, requests left out, emitting rows)."""
    positions_free: bool = False
    """A decode structure whose rows kept do not depend on the requests' positions: the
    next decode step of the same requests has the same structure."""
    logit_rows: tuple[tuple[int, ...] | None, int] = (None, 0)
    """The source rows request-row captures without a position rule keep (the emitting
    requests' rows; ``None``: all of them) and how many."""


@attrs.frozen
class CommitPlan:
    """Everything one forward captures, decided before it runs.

    Attributes:
        layout: the packed layout of the requests it captures (the forward's, less the
            requests left out: see :func:`make_plan`'s ``skip``); records follow it.
        padded / strip / alignment: how it was planned (see :func:`make_plan`).
        segments: every captured tensor, in firing order.
        batch: the forward's whole layout (what the capture points see).

    Where each request's rows sit (:meth:`slices`) is derived on first use, off the
    scheduler's hot path (the drain thread asks).
    """

    layout: BatchLayout
    padded: bool
    strip: bool
    alignment: int
    _structure: _Structure = attrs.field(repr=False)
    _full: BatchLayout | None = attrs.field(default=None, repr=False)
    _prompts: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    """Prompt lengths of :attr:`layout`'s requests (given when a rule needs them)."""
    _skip: frozenset[str] = attrs.field(default=frozenset(), repr=False)
    """The requests left out when it was made (see :func:`make_plan`)."""
    _slices: dict[tuple[RowBasis, Positions], tuple[RecordSlice, ...]] = attrs.field(
        init=False, factory=dict, eq=False, hash=False, repr=False
    )

    @property
    def batch(self) -> BatchLayout:
        """The forward's whole layout (:attr:`layout` unless requests are left out)."""
        return self._full if self._full is not None else self.layout

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Every captured tensor of the step, in firing order."""
        return self._structure.segments

    @property
    def total_bytes(self) -> int:
        """Ring bytes the whole step reserves (aligned segments)."""
        return self._structure.total_bytes

    @property
    def kept_bytes(self) -> int:
        """Bytes that end up in records."""
        return self._structure.kept_bytes

    @property
    def entries(self) -> int:
        """Task entries the step needs (one per captured tensor)."""
        return len(self._structure.segments)

    @property
    def cacheable(self) -> bool:
        """False for a plan whose row selections index many rows (a long prefill under a
        position rule or with requests left out): a structure cache keyed by it would
        hold big keys that are unlikely to come back."""
        return self._structure.indexed <= _CACHED_INDEX_ROWS

    @property
    def ruled_rows(self) -> tuple[tuple[RowBasis, Positions, tuple[int, ...] | None, int], ...]:
        """Per row basis and position rule of the selection: the source rows it keeps
        this step (``None``: all of them) and how many; empty without rules. With
        :attr:`segments`' first and last, it determines the plan's structure."""
        return self._structure.ruled_rows

    @property
    def logit_rows(self) -> tuple[tuple[int, ...] | None, int]:
        """The source rows request-row captures without a position rule keep this step
        (``None``: all of them) and how many; with :attr:`ruled_rows` and
        :attr:`segments`' first and last, it determines the plan's structure."""
        return self._structure.logit_rows

    def slices(self, segment: Segment) -> tuple[RecordSlice, ...]:
        """Where each request's rows sit in ``segment`` (kept rows, in row order)."""
        key = (segment.hook.row_basis, segment.positions)
        cached = self._slices.get(key)
        if cached is None:
            cached = self._slices[key] = _slices(self.layout, *key, self._prompts)
        return cached

    def segment_for(self, hook_name: str, layer_no: int) -> Segment | None:
        """The segment a capture point fills, or None when nothing of it is kept."""
        return self._structure.index.get((hook_name, layer_no))

    def shares_structure(self, other: CommitPlan) -> bool:
        """True when both plans have the same structure (segments, offsets, row
        selections) by construction: a copy program made for one fits the other."""
        return self._structure is other._structure

    def part(self, start: int, stop: int) -> CommitPlan:
        """Segments ``[start, stop)`` (in firing order) as a plan of their own, placed from
        offset 0 the way :func:`make_plan` places a step's (grouped by row size), for a
        piecewise commit that moves several capture points at once."""
        placed, total = _place(self.segments[start:stop], self.alignment)
        return self._with_segments(placed, total)

    def subset(self, keep: Sequence[int]) -> CommitPlan:
        """The plan with only its segments ``keep`` (indices, in order), at their offsets:
        the region it reserves stays :attr:`total_bytes` (a part of a piecewise step cut
        short, whose other capture points go to later parts)."""
        return self._with_segments(tuple(self.segments[i] for i in keep), self.total_bytes)

    def _with_segments(self, segments: tuple[Segment, ...], total_bytes: int) -> CommitPlan:
        """This step's plan holding ``segments`` (placed already) in ``total_bytes``."""
        structure = _Structure(segments, {(s.hook.name, s.layer_no): s for s in segments},
                               total_bytes, sum(s.kept_bytes for s in segments))
        plan = attrs.evolve(self, structure=structure)
        # the same layout: where each request's rows sit is the same for every part
        object.__setattr__(plan, "_slices", self._slices)
        return plan

    def part_stop(self, start: int, room: int) -> int:
        """The end of the longest run of segments from ``start`` whose ring bytes fit
        ``room`` (:meth:`part`), one segment at least."""
        segs, alignment = self.segments, self.alignment
        stop, used = start + 1, segs[start].aligned_bytes(alignment)
        while stop < len(segs) and used + segs[stop].aligned_bytes(alignment) <= room:
            used += segs[stop].aligned_bytes(alignment)
            stop += 1
        return stop

    def pieces(self) -> Iterator[CommitPlan]:
        """The plan split into one-segment plans, for a piecewise commit."""
        for i in range(len(self.segments)):
            yield self.part(i, i + 1)


def make_plan(
    layout: BatchLayout,
    selection: Selection,
    shape: ModelShape,
    *,
    padded: bool,
    strip: bool = True,
    alignment: int = DEFAULT_ALIGNMENT,
    skip: frozenset[str] = frozenset(),
    prompts: Callable[[str], int | None] | None = None,
    previous: CommitPlan | None = None,
) -> CommitPlan:
    """Plan one forward.

    The layout-independent structure (segments, offsets, sizes) is cached per step shape,
    so planning a decode step costs a few microseconds plus one slice per request.

    Args:
        layout: the forward's packed layout.
        selection: the selected hooks and layers.
        shape: the model's sizes (row shapes).
        padded: True for a decode CUDA-graph replay (capture points see the padded
            batch), False for an eager forward.
        strip: drop padding rows on the GPU (``DMX_GPU_PADDING_STRIP``).
        alignment: segment alignment in bytes.
        skip: requests not captured (request sampling): their rows are left out on the
            device like padding, and the plan's :attr:`~CommitPlan.layout` holds the
            other requests only.
        prompts: a request's prompt length from its id (None: unknown); asked (for the
            captured requests) only when a ``last_prompt`` or ``generated`` rule applies
            to a forward other than a decode.
        previous: the plan of the forward before, made by this function with the same
            selection and shape: when both are decode forwards of the same requests (the
            same ``request_ids`` tuple object, as adapters pass an unchanged batch) and
            its rows kept do not depend on positions, its structure is reused without
            being looked up (the per-step cost of a steady decode batch).

    Raises:
        CommitError: a ``last_prompt`` or ``generated`` rule and a captured request
            without a prompt length.
    """
    if previous is not None and _continues(previous, layout, padded=padded, strip=strip,
                                           alignment=alignment, skip=skip):
        if previous._full is None:
            return CommitPlan(layout, padded, strip, alignment, previous._structure,
                              skip=skip)
        kept, _, rids = _kept(layout.request_ids, skip)
        return CommitPlan(layout.subset(kept, rids), padded, strip, alignment,
                          previous._structure, layout, skip=skip)
    padding = layout.padded_batch_size - layout.raw_batch_size if padded else 0
    keep: frozenset[int] | None = None
    captured = layout
    uniform = layout.is_uniform_decode
    if skip:
        kept, keep, rids = _kept(layout.request_ids, skip)
        if keep is not None:
            captured = layout.subset(kept, rids)
    if uniform and keep is None:
        logit_rows, logit_index = layout.raw_batch_size, None
    else:
        emitting = kept if uniform else tuple(
            i for i, (e, n) in enumerate(zip(layout.emits, layout.counts, strict=True))
            if e and n > 0 and (keep is None or i in keep)
        )
        logit_rows = len(emitting)
        logit_index = None if emitting == tuple(range(logit_rows)) else emitting
    decode = layout.kind is ForwardKind.DECODE
    token_rules, request_rules = _rules_by_basis(selection, decode)
    prompt_of = _prompt_lengths(layout, keep, prompts) if any(
        r.needs_prompt for r in token_rules | request_rules) else None
    if keep is not None:
        token_rules = token_rules | {_EVERY_POSITION}
    ruled = tuple(
        (RowBasis.TOKEN, rule, *((kept, len(kept)) if uniform and rule.is_all
                                 else _rule_rows(layout, rule, keep, prompt_of)))
        for rule in sorted(token_rules, key=str)
    ) + tuple(
        (RowBasis.REQUEST, rule, *_request_rows(layout, rule, keep, prompt_of))
        for rule in sorted(request_rules, key=str)
    )
    indexed = sum(len(r[2]) for r in ruled if r[2] is not None) + len(logit_index or ())
    # Row indices are part of the cache key: a long prefill's would fill the cache with
    # big keys that never come back, so those plans are built without it.
    build = _structure if indexed <= _CACHED_INDEX_ROWS else _structure.__wrapped__
    structure = build(
        selection,
        shape,
        decode=decode,
        ruled=ruled,
        indexed=indexed,
        token_rows=layout.token_rows,
        raw_batch=layout.raw_batch_size,
        padding=padding,
        logit_index=logit_index,
        logit_rows=logit_rows,
        padded=padded,
        strip=strip,
        alignment=alignment,
    )
    captured_prompts = None
    if prompt_of is not None:
        captured_prompts = tuple(p for i, p in enumerate(prompt_of)
                                 if keep is None or i in keep)
    return CommitPlan(captured, padded, strip, alignment, structure,
                      None if keep is None else layout, captured_prompts, skip)


def _continues(previous: CommitPlan, layout: BatchLayout, *, padded: bool, strip: bool,
               alignment: int, skip: frozenset[str]) -> bool:
    """``layout`` is the decode forward after ``previous``'s, of the same requests, and
    nothing else that decides the structure changed (see :func:`make_plan`)."""
    batch = previous.batch
    return (previous._structure.positions_free and layout.kind is ForwardKind.DECODE
            and layout.request_ids is batch.request_ids
            and layout.padded_batch_size == batch.padded_batch_size
            and previous.padded is padded and previous.strip is strip
            and previous.alignment == alignment and previous._skip is skip)


def emitting_rows(layout: BatchLayout) -> tuple[tuple[int, int, str, int], ...]:
    """Per request of a forward whose rows decide a generated token, the row that does:
    ``(token row, request row, request id, position)``; the token row is the request's
    last row in the forward, the request row its index (its ``final_logits`` row). These
    are the rows a ``last`` rule may keep (the newest such row of a request is its
    ``last`` position once it finished)."""
    out = []
    row = 0
    for i, (rid, start, n, emits) in enumerate(zip(layout.request_ids, layout.starts,
                                                   layout.counts, layout.emits,
                                                   strict=True)):
        row += n
        if emits and n > 0:
            out.append((row - 1, i, rid, start + n - 1))
    return tuple(out)


_LAST = Positions(PositionRule.LAST)


def make_read_plan(reads: Sequence[tuple[str, int]], selection: Selection,
                   shape: ModelShape, *, alignment: int = DEFAULT_ALIGNMENT) -> CommitPlan:
    """The plan of reading finished requests' ``last`` rows out of the device slots: one
    row per ``(request id, position)`` of ``reads`` in every capture whose rule is
    ``last``, laid out like a forward's plan (equal row sizes adjacent). Its rows are
    final: a request row (``final_logits:last``) is stored at once, never held back.

    Raises:
        ValueError: no reads, or no capture of the selection has the ``last`` rule.
    """
    if not reads or not selection.captures_kept_by(PositionRule.LAST):
        msg = "a read plan needs reads and captures with the last rule"
        raise ValueError(msg)
    n = len(reads)
    structure = _read_structure(selection, shape, n, alignment)
    rids = [rid for rid, _ in reads]
    layout = BatchLayout.extend(rids, [p for _, p in reads], [1] * n)
    plan = CommitPlan(layout, False, True, alignment, structure)
    slices = tuple(RecordSlice(rid, j, 1, p, p + 1) for j, (rid, p) in enumerate(reads))
    for basis in RowBasis:
        plan._slices[(basis, _LAST)] = slices  # the plan's own cache
    return plan


@functools.lru_cache(maxsize=8)
def _read_structure(selection: Selection, shape: ModelShape, n: int,
                    alignment: int) -> _Structure:
    """The structure of a read plan of ``n`` requests (the same for every read of as many:
    finished requests mostly leave a steady batch together, in reads of equal size)."""
    captures = selection.captures_kept_by(PositionRule.LAST)
    segments = [Segment(hook, layer, shape.capture_row(selection, hook, layer), n, n, n,
                        None, 0, _LAST) for hook, layer in captures]
    placed, total = _place(segments, alignment)
    index = {(seg.hook.name, seg.layer_no): seg for seg in placed}
    return _Structure(placed, index, total, sum(s.kept_bytes for s in placed))


def _place(segments: Sequence[Segment], alignment: int) -> tuple[tuple[Segment, ...], int]:
    """``segments`` with their ring offsets: grouped by row size (stable in firing order),
    so a transport can move each group between arena, ring and host with one strided
    copy; and the bytes they reserve."""
    placed: dict[int, Segment] = {}
    offset = 0
    for i in sorted(range(len(segments)), key=lambda i: segments[i].row.nbytes):
        placed[i] = attrs.evolve(segments[i], offset=offset)
        offset += segments[i].aligned_bytes(alignment)
    return tuple(placed[i] for i in range(len(segments))), offset


_EVERY_POSITION = Positions()
_CACHED_INDEX_ROWS = 2048
"""Plans whose row selections index more rows than this are not cached (see
:attr:`CommitPlan.cacheable`)."""


@functools.lru_cache(maxsize=16)
def _kept(request_ids: tuple[str, ...], skip: frozenset[str]) -> tuple[
        tuple[int, ...], frozenset[int] | None, tuple[str, ...]]:
    """The requests of a batch that are captured: their indices, the same as a set (None
    when every request is), their ids. Cached: consecutive decode steps of an unchanged
    batch ask again with the same tuples (and get the same ids tuple back, which the
    request tracker's fast path recognises)."""
    if skip.isdisjoint(request_ids):
        return tuple(range(len(request_ids))), None, request_ids
    kept = tuple(i for i, rid in enumerate(request_ids) if rid not in skip)
    return kept, frozenset(kept), tuple(request_ids[i] for i in kept)


_NO_POSITION = Positions(PositionRule.RANGE, first=1, last=0)
"""An empty range: what ``last_prompt`` keeps of a decode forward."""


def _effective(rule: Positions, decode: bool) -> Positions:
    """The rule as it applies to a forward: in a decode forward every position lies after
    the prompt (the first decode forward computes position ``prompt``), so ``generated``
    keeps every row and ``last_prompt`` none, without asking for prompt lengths. ``last``
    keeps no row of any forward: which position it keeps is known only when the request
    finished, so its rows wait in device slots (the transport's) and leave the device by
    a read plan (:func:`make_read_plan`)."""
    if rule.rule is PositionRule.LAST:
        return _NO_POSITION
    if decode and rule.rule is PositionRule.GENERATED:
        return _EVERY_POSITION
    if decode and rule.rule is PositionRule.LAST_PROMPT:
        return _NO_POSITION
    return rule


@functools.lru_cache(maxsize=64)
def _rules_by_basis(selection: Selection, decode: bool = False) -> tuple[
        frozenset[Positions], frozenset[Positions]]:
    """The position rules of the selection's token-row and request-row captures, as they
    apply to a decode forward or another one (rules that keep every row left out)."""
    token: set[Positions] = set()
    request: set[Positions] = set()
    for name, _, rule in selection.rules:
        by_request = hook_by_name(name).row_basis is RowBasis.REQUEST
        applied = _effective(rule, decode)
        if not applied.is_all:
            (request if by_request else token).add(applied)
    return frozenset(token), frozenset(request)


def _prompt_lengths(layout: BatchLayout, keep: frozenset[int] | None,
                    prompts: Callable[[str], int | None] | None) -> tuple[int, ...]:
    """Prompt lengths of the batch's requests (0 for those left out, never read)."""
    out = []
    for i, rid in enumerate(layout.request_ids):
        captured = keep is None or i in keep
        length = prompts(rid) if prompts is not None and captured else None
        if length is None and captured:
            msg = (f"a last_prompt or generated rule needs the prompt length of request "
                   f"{rid!r}")
            raise CommitError(msg)
        out.append(length or 0)
    return tuple(out)


def _rule_rows(layout: BatchLayout, rule: Positions, keep: frozenset[int] | None = None,
               prompt_of: Sequence[int] | None = None) -> tuple[tuple[int, ...] | None, int]:
    """The token rows of ``layout`` that ``rule`` keeps of the requests in ``keep``
    (None: every request), as an index (None: all rows) and a count."""
    if layout.kind is ForwardKind.DECODE and rule.rule is PositionRule.RANGE:  # row i: req i
        lo, hi = rule.first, rule.last
        if hi < lo:
            return (), 0
        kept = tuple(i for i, p in enumerate(layout.starts)
                     if lo <= p <= hi and (keep is None or i in keep))
        return (None if len(kept) == layout.token_rows else kept), len(kept)
    if layout.kind is ForwardKind.DECODE and rule.rule is PositionRule.EVERY:
        k = rule.k
        kept = tuple(i for i, p in enumerate(layout.starts)
                     if not p % k and (keep is None or i in keep))
        return (None if len(kept) == layout.token_rows else kept), len(kept)
    index: list[int] = []
    row = 0
    for i, (start, n) in enumerate(zip(layout.starts, layout.counts, strict=True)):
        if keep is None or i in keep:
            prompt = prompt_of[i] if prompt_of is not None else None
            held = rule.kept(start, start + n, prompt=prompt)
            index.extend(range(row + held.start - start, row + held.stop - start, held.step))
        row += n
    if len(index) == layout.token_rows:
        return None, len(index)
    return tuple(index), len(index)


def _request_rows(layout: BatchLayout, rule: Positions, keep: frozenset[int] | None,
                  prompt_of: Sequence[int] | None) -> tuple[tuple[int, ...] | None, int]:
    """The request rows (one per request, at its last position, for those that emit a
    token) that ``rule`` keeps of the requests in ``keep``: an index and a count."""
    if layout.kind is ForwardKind.DECODE and rule.rule in (PositionRule.RANGE,
                                                            PositionRule.EVERY):
        return _rule_rows(layout, rule, keep)  # one row per request, at its position
    index = []
    for i, (start, n, emits) in enumerate(zip(layout.starts, layout.counts, layout.emits,
                                              strict=True)):
        if emits and n > 0 and (keep is None or i in keep):
            prompt = prompt_of[i] if prompt_of is not None else None
            if rule.kept(start + n - 1, start + n, prompt=prompt):
                index.append(i)
    if index == list(range(layout.raw_batch_size)):
        return None, len(index)
    return tuple(index), len(index)


def _slices(layout: BatchLayout, basis: RowBasis, rule: Positions | None = None,
            prompts: tuple[int, ...] | None = None) -> tuple[RecordSlice, ...]:
    rows = zip(layout.request_ids, layout.starts, layout.counts, layout.emits, strict=True)
    out: list[RecordSlice] = []
    at = 0
    for i, (rid, start, n, emits) in enumerate(rows):
        prompt = prompts[i] if prompts is not None else None
        if basis is RowBasis.TOKEN:
            kept = range(start, start + n) if rule is None else rule.kept(
                start, start + n, prompt=prompt)
        elif emits and n > 0:
            kept = range(start + n - 1, start + n) if rule is None else rule.kept(
                start + n - 1, start + n, prompt=prompt)
        else:
            continue
        if kept.step == 1:  # one record per run of consecutive positions
            if kept:
                out.append(RecordSlice(rid, at, len(kept), kept.start, kept.stop))
                at += len(kept)
            continue
        for p in kept:  # a stride: one record per position
            out.append(RecordSlice(rid, at, 1, p, p + 1))
            at += 1
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _structure(
    selection: Selection,
    shape: ModelShape,
    *,
    decode: bool,
    ruled: tuple[tuple[RowBasis, Positions, tuple[int, ...] | None, int], ...],
    indexed: int,
    token_rows: int,
    raw_batch: int,
    padding: int,
    logit_index: tuple[int, ...] | None,
    logit_rows: int,
    padded: bool,
    strip: bool,
    alignment: int,
) -> _Structure:
    segments: list[Segment] = []
    rows_of = {(basis, rule): (index, kept) for basis, rule, index, kept in ruled}
    for hook, layer_no in selection.captures():
        row = shape.capture_row(selection, hook, layer_no)
        rule = _effective(selection.positions_of(hook.name, layer_no), decode)
        basis = hook.row_basis
        if basis is RowBasis.REQUEST:
            source = raw_batch + padding
            index, kept = rows_of.get((basis, rule), (logit_index, logit_rows))
        elif (basis, rule) in rows_of:
            source = token_rows + padding
            index, kept = rows_of[(basis, rule)]
        else:
            source, kept, index = token_rows + padding, token_rows, None
        if kept == 0:
            continue
        ring_rows = kept if strip or not padded else source
        segments.append(Segment(hook, layer_no, row, source, kept, ring_rows, index, 0, rule))
    ordered, offset = _place(segments, alignment)
    index_by_key = {(seg.hook.name, seg.layer_no): seg for seg in ordered}
    positions_free = decode and all(rule.is_all or rule.last < rule.first
                                    for _, rule, _, _ in ruled)
    return _Structure(ordered, index_by_key, offset, sum(seg.kept_bytes for seg in ordered),
                      ruled, indexed, positions_free, (logit_index, logit_rows))


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
