"""Ring capacity accounting and the preflight decision.

The transport owns a GPU payload ring (``DMX_RING_PAYLOAD_MB``), pinned host staging
(``DMX_RING_PINNED_MB``) and a bounded number of in-flight captured tensors
(``DMX_RING_TASK_ENTRIES``). A step may hold at most ``min(payload, pinned)`` bytes in
flight: everything in the ring must also fit in staging on its way to the host.

Preflight, before a forward (never a silent drop):

* **fits**: the step's plan fits the free space now;
* **run eager**: a decode graph step whose padded plan does not fit, either because the
  unpadded (eager) plan fits the free space now, or because the padded plan could not
  fit even an empty ring; the eager step is then preflighted on its own;
* **wait for the drain**: a decode graph step that fits an empty ring but not the free
  space now: block until the drain frees enough, then commit it whole;
* **piecewise**: an eager step larger than the free space (a long prefill chunk): commit
  in parts (runs of capture points that fit the free space), waiting for the drain
  between them.

Refused at startup: a ring smaller than the largest single capture tensor the
configuration can produce (:func:`check_ring_fits`). An ordinary long prompt is never
refused: prefill chunks are bounded by SGLang's ``chunked_prefill_size``.
"""

from __future__ import annotations

import enum
import math
from collections import deque

import attrs

from dmi_sglang.domain.hooks import Hook, RowBasis, Selection
from dmi_sglang.domain.plan import DEFAULT_ALIGNMENT, CommitPlan, align_up
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.errors import CapacityError

__all__ = [
    "ARENA_SLOTS_BUDGET",
    "LANDING_MIN_PLACES",
    "RING_MB_MAX",
    "Decision",
    "Preflight",
    "RingAllocator",
    "RingCapacity",
    "RingUsage",
    "arena_bytes",
    "arena_captures",
    "arena_slots",
    "check_ring_fits",
    "largest_capture_bytes",
    "last_slot_bytes",
    "last_slot_groups",
    "last_slot_requests",
    "prefill_ring_bytes",
    "preflight",
    "ring_advice",
]

MIB = 1 << 20


@attrs.frozen
class RingCapacity:
    """The transport's fixed sizes."""

    payload_bytes: int
    pinned_bytes: int
    task_entries: int

    @classmethod
    def from_mb(cls, payload_mb: int, pinned_mb: int, task_entries: int) -> RingCapacity:
        """From the ``DMX_RING_*`` settings."""
        return cls(payload_mb * MIB, pinned_mb * MIB, task_entries)

    @property
    def effective_bytes(self) -> int:
        """Bytes that may be in flight at once."""
        return min(self.payload_bytes, self.pinned_bytes)

    def empty(self) -> RingUsage:
        """Usage of an empty ring."""
        return RingUsage(self.effective_bytes, self.task_entries)


@attrs.frozen
class RingUsage:
    """Free space right now: contiguous bytes a new reservation can take, and entries."""

    free_bytes: int
    free_entries: int

    def admits(self, plan: CommitPlan) -> bool:
        """True when the whole plan fits."""
        return plan.total_bytes <= self.free_bytes and plan.entries <= self.free_entries


class Decision(enum.Enum):
    """What to do with a step before its forward runs."""

    FITS = "fits"
    RUN_EAGER = "run eager"
    WAIT_FOR_DRAIN = "wait for the drain"
    PIECEWISE = "commit piecewise"


@attrs.frozen
class Preflight:
    """A preflight decision and why."""

    decision: Decision
    reason: str


def preflight(
    plan: CommitPlan,
    usage: RingUsage,
    capacity: RingCapacity,
    *,
    eager_plan: CommitPlan | None = None,
) -> Preflight:
    """Decide how a step is committed (see the module docstring).

    Args:
        plan: the plan the forward would run with (padded for a graph replay).
        usage: free space now.
        capacity: the ring's sizes.
        eager_plan: for a graph step, the unpadded plan it would have if run eagerly.
    """
    need = f"{plan.total_bytes} bytes in {plan.entries} tensors"
    free = f"{usage.free_bytes} bytes and {usage.free_entries} entries free"
    if usage.admits(plan):
        return Preflight(Decision.FITS, f"{need} fit ({free})")
    if plan.padded:
        if eager_plan is not None and usage.admits(eager_plan):
            return Preflight(
                Decision.RUN_EAGER,
                f"padded step needs {need}, {free}; the unpadded step "
                f"({eager_plan.total_bytes} bytes) fits",
            )
        if capacity.empty().admits(plan):
            reason = f"{need} exceed {free}; waiting for the drain"
            return Preflight(Decision.WAIT_FOR_DRAIN, reason)
        return Preflight(
            Decision.RUN_EAGER,
            f"padded step needs {need}, more than the whole ring "
            f"({capacity.effective_bytes} bytes, {capacity.task_entries} entries)",
        )
    return Preflight(
        Decision.PIECEWISE,
        f"eager step needs {need}, {free}; committing tensor by tensor",
    )


def largest_capture_bytes(
    selection: Selection,
    shape: ModelShape,
    *,
    max_token_rows: int,
    max_request_rows: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> tuple[int, str]:
    """The largest single capture tensor the configuration can produce, and its hook.

    Args:
        max_token_rows: most token rows one forward can hold: max(chunked prefill
            tokens, largest decode batch incl. padding when strip is off).
        max_request_rows: most requests one forward can hold.
    """
    best = (0, "")
    for hook, layer_no in selection.captures():
        rule = selection.positions_of(hook.name, layer_no).rule
        rows = max_request_rows if hook.row_basis is RowBasis.REQUEST else max_token_rows
        if rule is PositionRule.LAST:  # rows wait in slots of their own; reads are apart
            rows = 0
        elif rule is PositionRule.LAST_PROMPT:  # one row per request a forward at most
            rows = min(rows, max_request_rows)
        size = align_up(rows * shape.capture_row(selection, hook, layer_no).nbytes, alignment)
        best = max(best, (size, hook.name))
    return best


def check_ring_fits(
    capacity: RingCapacity,
    selection: Selection,
    shape: ModelShape,
    *,
    max_token_rows: int,
    max_request_rows: int,
) -> None:
    """Refuse a ring too small for one capture tensor.

    Raises:
        CapacityError: names the tensor's size and the ring's, and what to change.
    """
    size, hook = largest_capture_bytes(
        selection, shape, max_token_rows=max_token_rows, max_request_rows=max_request_rows
    )
    if size > capacity.effective_bytes:
        msg = (
            f"the capture ring holds {capacity.effective_bytes} bytes "
            f"(min of DMX_RING_PAYLOAD_MB={capacity.payload_bytes // MIB} and "
            f"DMX_RING_PINNED_MB={capacity.pinned_bytes // MIB}), but one {hook!r} tensor "
            f"can be {size} bytes ({max_token_rows} token rows / {max_request_rows} request "
            f"rows); raise both to at least {-(-size // MIB)} MiB or lower the chunked "
            f"prefill size / batch size"
        )
        raise CapacityError(msg)


def prefill_ring_bytes(selection: Selection, shape: ModelShape, tokens: int) -> int:
    """Ring bytes of one eager forward of ``tokens`` positions of one request: the most
    a prefill chunk of SGLang's ``chunked_prefill_size`` takes in the ring at once. A
    chunk of several requests holds as many token rows and one request row more per
    further request and request-row capture (``final_logits``, ``last_prompt`` rules):
    not counted here. A forward larger than the free ring space commits piecewise: in
    parts that fit the free space, each waiting for the drain to free its room.

    Per capture, the most rows such a chunk can keep, in closed form (no plan is built:
    a chunk of billions of positions costs no more to size): a request-row capture one
    (the chunk's row, kept when its last position is); ``last_prompt`` one; ``every(K)``
    one in K of a chunk from 0; ``positions(A-B)`` as many of the range as the chunk
    holds (a chunk from ``A``); every other rule all of them; ``last`` none (its rows wait
    in slots of their own)."""
    tokens = max(tokens, 1)
    total = 0
    for hook, layer_no in selection.captures():
        rule = selection.positions_of(hook.name, layer_no)
        if rule.rule is PositionRule.LAST:
            continue
        if hook.row_basis is RowBasis.REQUEST or rule.rule is PositionRule.LAST_PROMPT:
            rows = 1
        elif rule.rule is PositionRule.EVERY:
            rows = -(-tokens // rule.k)
        elif rule.rule is PositionRule.RANGE:
            rows = min(tokens, rule.last - rule.first + 1)
        else:
            rows = tokens
        total += align_up(rows * shape.capture_row(selection, hook, layer_no).nbytes,
                          DEFAULT_ALIGNMENT)
    return total


PREFILLS_IN_RING = 2
"""Prefill chunks the advised ring holds whole (:func:`ring_advice`): one captured while
the one before it drains."""


RING_MB_MAX = 131_072
"""The largest ``DMX_RING_PAYLOAD_MB`` / ``DMX_RING_PINNED_MB`` the settings accept."""


def ring_advice(capacity: RingCapacity, chunk_bytes: int) -> int | None:
    """``DMX_RING_PAYLOAD_MB`` (and ``_PINNED_MB``) to advise when one prefill chunk of
    ``chunk_bytes`` does not fit the ring: room for :data:`PREFILLS_IN_RING` chunks, in
    whole GiB, :data:`RING_MB_MAX` at most; None when a chunk fits, or when the ring is
    that large already (a smaller chunked prefill size is what helps then). Every MiB of
    it is device memory taken before SGLang sizes its KV cache, and page-locked host
    memory (docs/settings.md). Whether prefills still commit piecewise depends on how
    fast the drain frees the ring too."""
    if chunk_bytes <= capacity.effective_bytes:
        return None
    gib = 1024 * MIB
    advised = min(-(-PREFILLS_IN_RING * chunk_bytes // gib) * 1024, RING_MB_MAX)
    # a ring that cannot hold one chunk is no advice: a smaller chunk is what helps
    fits = advised * MIB > capacity.effective_bytes and advised * MIB >= chunk_bytes
    return advised if fits else None


def chunks_held(ring_mb: int, chunk_bytes: int) -> str:
    """How many whole prefill chunks of ``chunk_bytes`` a ring of ``ring_mb`` MiB holds,
    in words, up to :data:`PREFILLS_IN_RING` (the advice at :data:`RING_MB_MAX` may hold
    only one)."""
    held = min(PREFILLS_IN_RING, ring_mb * MIB // max(chunk_bytes, 1))
    return {0: "no chunk", 1: "one chunk", 2: "two chunks"}.get(held, f"{held} chunks")


def arena_bytes(
    selection: Selection,
    shape: ModelShape,
    *,
    max_graph_batch: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> int:
    """GPU bytes of one slot of the graph-replay arena: every capture at the largest
    decode batch."""
    total = 0
    for hook, layer_no in selection.captures():
        row = shape.capture_row(selection, hook, layer_no)
        total += align_up(max_graph_batch * row.nbytes, alignment)
    return total


LANDING_MIN_PLACES = 3
"""Fewest equal rows (arena places, or ``last`` captures of one dtype and width) for
which a decode graph's capture points write landing rows with plain copies and one
indexed copy moves them all, instead of an indexed copy each: on the H200 an indexed
copy costs a decode graph about 3 us, a plain one about 1 us."""


def arena_captures(selection: Selection) -> list[tuple[Hook, int]]:
    """The captures whose capture points write the graph-replay arena: the selection's,
    less those the ``last`` rule keeps in its own slots (their arena places serve the
    copy programs of its reads)."""
    last = set(selection.captures_kept_by(PositionRule.LAST))
    return [c for c in selection.captures() if c not in last]


ARENA_SLOTS_BUDGET = 256 * MIB
"""Default device bytes the arena's slots may take together, the spare and the landing
slot included (see :func:`arena_slots`)."""
ARENA_SLOTS_MAX = 32
ARENA_SLOTS_MIN = 4


def arena_slots(one_slot_bytes: int, budget_bytes: int = ARENA_SLOTS_BUDGET) -> int:
    """How many copies (slots) of the graph-replay arena a transport keeps for decode
    steps: as many as ``budget_bytes`` holds beside the spare slot and the landing slot
    (where a decode graph's capture points write before one copy moves their rows into
    the step's slot), at most 32: a committed step wakes a lingering drain while half the
    slots wait (16 decode steps, about 55 ms at batch 64 on Qwen3-0.6B, longer than the
    drain lingers), so the drain wakes when its linger ends, not every few steps (16
    slots woke it every 5 steps in serving; 64 woke it no less often and held twice the
    ring space for waiting steps). Each replayed step
    stays in its slot until the drain thread copied it out, so the scheduler thread
    queues no copies for it; a step whose slot still waits is copied out by the
    scheduler thread from the spare. With fewer than 4 most steps would, so such an
    arena keeps one slot and no spare (all its steps are copied out by the scheduler).
    """
    fit = min(ARENA_SLOTS_MAX, budget_bytes // max(one_slot_bytes, 1) - 2)
    return fit if fit >= ARENA_SLOTS_MIN else 1


def last_slot_requests(*, max_requests: int, max_graph_batch: int) -> int:
    """Requests that may hold ``last`` slots at once: twice the most running requests
    (a retracted request keeps its slot while it waits to run again)."""
    return 2 * max(max_requests, max_graph_batch, 1)


def last_slot_bytes(selection: Selection, shape: ModelShape, *, requests: int,
                    max_graph_batch: int = 0) -> int:
    """GPU bytes of the ``last`` rule's slots: per capture with that rule, two rows per
    request (by position parity: the overlap scheduler's extra forward writes the other)
    and one spare row; and for a group of :data:`LANDING_MIN_PLACES` or more captures of
    one dtype and width, the landing rows of a decode graph's capture points (the
    largest graph's batch; they are moved into the slots together)."""
    total = 0
    for members in last_slot_groups(selection, shape):
        landing = max_graph_batch if len(members) >= LANDING_MIN_PLACES else 0
        row = shape.capture_row(selection, *members[0])
        total += (2 * requests + 1 + landing) * row.nbytes * len(members)
    return total


def last_slot_groups(selection: Selection, shape: ModelShape) -> list[list[tuple[Hook, int]]]:
    """The captures with the ``last`` rule, grouped by equal rows (dtype and width), in
    :meth:`~dmi_sglang.domain.hooks.Selection.captures` order: the slots of a group are
    one buffer, and a group of :data:`LANDING_MIN_PLACES` or more lands (see
    :func:`last_slot_bytes`)."""
    groups: dict[tuple[str, int], list[tuple[Hook, int]]] = {}
    for hook, layer_no in selection.captures_kept_by(PositionRule.LAST):
        row = shape.capture_row(selection, hook, layer_no)
        groups.setdefault((row.dtype.value, math.prod(row.dims)), []).append((hook, layer_no))
    return list(groups.values())


class RingAllocator:
    """FIFO allocation of contiguous regions in a circular buffer.

    Regions are released in the order they were reserved (the drain frees steps in
    order). A region never wraps: when the end of the buffer is too short for it, those
    bytes are skipped and counted as part of the region until it is released.
    """

    def __init__(self, capacity_bytes: int, entries: int) -> None:
        if capacity_bytes <= 0 or entries <= 0:
            msg = f"ring needs positive size and entries, got {capacity_bytes} / {entries}"
            raise CapacityError(msg)
        self.capacity = capacity_bytes
        self.entries = entries
        self._head = 0
        self._used = 0
        self._used_entries = 0
        self._live: deque[tuple[int, int, int]] = deque()  # (begin, bytes incl. skip, entries)
        self.high_water = 0

    @property
    def used_bytes(self) -> int:
        """Bytes reserved (skipped ends included) and not yet released."""
        return self._used

    @property
    def used_entries(self) -> int:
        """Entries reserved and not yet released."""
        return self._used_entries

    @property
    def live_regions(self) -> int:
        """Reservations not yet released."""
        return len(self._live)

    def usage(self) -> RingUsage:
        """The largest contiguous reservation possible now, and the free entries."""
        return RingUsage(self._contiguous_free(), self.entries - self._used_entries)

    def _contiguous_free(self) -> int:
        if not self._live:
            return self.capacity
        if self._used >= self.capacity:
            return 0
        tail = self._live[0][0]
        if self._head >= tail:
            return max(self.capacity - self._head, tail)
        return tail - self._head

    def reserve(self, nbytes: int, entries: int = 1) -> int | None:
        """Reserve ``nbytes`` contiguous bytes and ``entries`` entries.

        Returns:
            The region's byte offset, or None when it does not fit now.
        """
        if nbytes < 0 or entries < 0:
            msg = f"cannot reserve {nbytes} bytes / {entries} entries"
            raise CapacityError(msg)
        if entries > self.entries - self._used_entries or nbytes > self._contiguous_free():
            return None
        if not self._live:
            self._head = 0
        begin = self._head
        tail = self._live[0][0] if self._live else 0
        fits_at_head = (
            self.capacity - self._head >= nbytes if self._head >= tail or not self._live
            else tail - self._head >= nbytes
        )
        offset = self._head if fits_at_head else 0
        used = nbytes if fits_at_head else (self.capacity - begin) + nbytes
        self._head = offset + nbytes
        self._used += used
        self._used_entries += entries
        self._live.append((begin, used, entries))
        self.high_water = max(self.high_water, self._used)
        return offset

    def release(self) -> None:
        """Release the oldest live reservation."""
        if not self._live:
            msg = "release without a live reservation"
            raise CapacityError(msg)
        _, nbytes, entries = self._live.popleft()
        self._used -= nbytes
        self._used_entries -= entries
        if not self._live:
            self._head = 0
