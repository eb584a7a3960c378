"""The open step: where capture points write, and how a step is sealed.

Modes of a committed step:

* ``ARENA``: a padded plan (decode graph replay); captures live in the arena and
  ``seal`` hands the step to the drain, which copies the real rows from the step's arena
  slot to its ring region, one strided copy per group (with a one-slot arena, or when
  the step's slot still waited and it wrote the spare, ``seal`` makes those copies
  itself, on the current stream). Run eagerly (the capture points fire), such a step
  lands its rows like a replay and ``seal`` first moves what landed
  (:meth:`~._arena.Arena.settle`); a capture point may fire once;
* ``ARENA_PIECES``: a padded plan too large for even an empty ring (the adapter should
  have run it eager): ``seal`` moves it segment by segment, waiting for the drain;
* ``RING``: an unpadded (eager) plan: capture points write the ring region directly;
* ``PIECES``: an eager plan larger than the free space: it is committed in *parts*,
  runs of consecutive capture points (in firing order) that fit the ring's free space
  when the first of them fires (a quarter of the ring and 256 MiB at most, one capture
  point at least, waiting for the drain then). A part is reserved by its first capture
  point, written by the next ones and handed to the drain as one item once its last one
  fired. A capture point that fires outside the open part ends that part first: it goes
  to the drain with the capture points written so far (the others go to later parts),
  so the ring, which frees in order, never holds a reservation that waits for a capture
  point while the step waits for room;
* ``EMPTY``: nothing is captured this forward.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from dmi_sglang.adapters.transport._arena import Arena, CaptureKey, as_rows
from dmi_sglang.adapters.transport._device import TORCH_DTYPES, DeviceOps, copy_rows, widest
from dmi_sglang.adapters.transport._drain import DrainItem
from dmi_sglang.adapters.transport._last import LastSlots
from dmi_sglang.adapters.transport._program import Program, build_program
from dmi_sglang.adapters.transport._side import SideStream
from dmi_sglang.domain.capacity import RingUsage
from dmi_sglang.domain.plan import CommitPlan, Segment
from dmi_sglang.errors import CaptureError

__all__ = ["Mode", "OpenStep", "Part", "StepWriter"]


class Mode(enum.Enum):
    """How the open step is written (see the module docstring)."""

    EMPTY = "empty"
    ARENA = "arena"
    ARENA_PIECES = "arena, piecewise"
    RING = "ring"
    PIECES = "ring, piecewise"


class Part:
    """A reserved run of a piecewise step's capture points (see the module docstring)."""

    __slots__ = ("base", "plan", "program", "start", "written")

    def __init__(self, plan: CommitPlan, program: Program, base: int, start: int) -> None:
        self.plan = plan
        self.program = program
        self.base = base
        self.start = start
        """Index of its first segment in the step's plan."""
        self.written: list[int] = []
        """Its segments written so far (indices into :attr:`plan`), in firing order."""

    def holds(self, index: int) -> bool:
        """True when the step's segment ``index`` belongs to this part."""
        return 0 <= index - self.start < len(self.plan.segments)


class OpenStep:
    """A committed, not yet sealed step."""

    __slots__ = ("base", "captured", "drained", "mode", "order", "part", "plan", "program",
                 "seq", "slot")

    def __init__(
        self, seq: int, plan: CommitPlan, program: Program | None, mode: Mode, base: int,
        *, slot: int = 0, drained: bool = False,
    ) -> None:
        self.seq = seq
        self.slot = slot
        """The arena slot a padded step's replay writes."""
        self.drained = drained
        """The drain copies the step out of its slot and frees it (else ``seal`` copies
        it out on the current stream, before any later replay)."""
        self.plan = plan
        self.program = program
        self.mode = mode
        self.base = base
        self.captured: set[CaptureKey] = set()
        self.part: Part | None = None
        """A piecewise step's open part (reserved, not handed to the drain yet)."""
        self.order: dict[CaptureKey, int] = {}
        """A piecewise step's segment index per capture (made at its first capture)."""


Reserve = Callable[[int, int, int], int]
"""``reserve(nbytes, entries, seq) -> ring offset``, waiting for the drain if needed."""


class StepWriter:
    """Writes captures of the open step and seals it (scheduler thread only)."""

    def __init__(
        self,
        ops: DeviceOps,
        arena: Arena,
        ring: torch.Tensor,
        reserve: Reserve,
        enqueue: Callable[[DrainItem], None],
        *,
        last: LastSlots,
        free_slot: Callable[[int], None],
        room: Callable[[], RingUsage] = lambda: RingUsage(0, 0),
        part_bytes: int = 0,
        side_stream: bool = False,
    ) -> None:
        self._ops = ops
        self._arena = arena
        self._ring = ring
        self._ring_wide = ops.wide(ring)
        self._arena_wide = ops.wide(arena.buffer)
        self._reserve = reserve
        self._enqueue = enqueue
        self._last = last
        self._free_slot = free_slot
        self._room = room
        """The ring's free space now (what a piecewise step's next part may take)."""
        self._part_bytes = part_bytes
        """Most ring bytes of one part (0: one capture point a part)."""
        self.open: OpenStep | None = None
        self.side = SideStream(ops.device) if side_stream else None
        """Where a decode graph's residual-stream copies and landing moves are recorded
        (:mod:`._side`; None: on the forward's stream); the capture points join it."""

    def live(self, key: CaptureKey) -> bool:
        """True when a capture of ``key`` now would be used: a graph is being captured,
        or the open step stores rows of it (so a transform is worth its device work)."""
        if key in self._last:
            return self._ops.capturing() or self._last.active
        if key not in self._arena:
            return False
        if self._ops.capturing():
            return True
        step = self.open
        return (step is not None and step.mode is not Mode.EMPTY
                and step.plan.segment_for(*key) is not None)

    def capture(self, key: CaptureKey, tensor: torch.Tensor) -> None:
        """Route one capture point's tensor (see :class:`~._capturer.Capturer`)."""
        if key in self._last:
            capturing = self._ops.capturing()
            self._last.capture(key, tensor, capturing=capturing,
                               side=self.side if capturing else None)
            return
        if key not in self._arena:
            return
        if self._ops.capturing():
            self._arena.write(key, tensor, side=self.side)
            return
        step = self.open
        if step is None or step.mode is Mode.EMPTY:
            return
        seg = step.plan.segment_for(*key)
        if seg is None:
            return
        if step.mode is Mode.ARENA or step.mode is Mode.ARENA_PIECES:
            if key in step.captured:
                msg = f"capture {key} fired twice in step {step.seq}"
                raise CaptureError(msg)
            if tensor.shape[0] != seg.source_rows:
                msg = f"capture {key}: {tensor.shape[0]} rows, the plan has {seg.source_rows}"
                raise CaptureError(msg)
            self._arena.write(key, tensor)
        elif step.mode is Mode.RING:
            assert step.program is not None
            self._write_ring(step.base + seg.offset, seg, key, tensor, step.program)
        else:
            if key in step.captured:
                msg = f"capture {key} fired twice in piecewise step {step.seq}"
                raise CaptureError(msg)
            self._write_part(step, key, tensor)
        step.captured.add(key)

    def _write_part(self, step: OpenStep, key: CaptureKey, tensor: torch.Tensor) -> None:
        """Write a piecewise step's capture into the open part (ended first when it does
        not hold the capture; opened when none is), and hand the part to the drain once
        its last capture point fired."""
        if not step.order:
            step.order = {(sg.hook.name, sg.layer_no): i
                          for i, sg in enumerate(step.plan.segments)}
        index = step.order[key]
        part = step.part
        if part is not None and not part.holds(index):
            self.end_part(step)
            part = None
        if part is None:
            part = step.part = self._open_part(step, index)
        placed = part.plan.segments[index - part.start]
        self._write_ring(part.base + placed.offset, placed, key, tensor, part.program)
        part.written.append(index - part.start)
        if len(part.written) == len(part.plan.segments):
            step.part = None
            self._enqueue(DrainItem(step.seq, part.plan, part.program, part.base,
                                    self._ops.mark()))

    def end_part(self, step: OpenStep, *, discard: bool = False) -> None:
        """Hand a piecewise step's open part to the drain now: its capture points written
        so far (``discard``: none, the region is only freed)."""
        part, step.part = step.part, None
        if part is None:
            return
        plan, program = part.plan, part.program
        if part.written and len(part.written) < len(plan.segments) and not discard:
            plan = plan.subset(sorted(part.written))
            program = build_program(plan, self._arena)
        self._enqueue(DrainItem(step.seq, plan, program, part.base, self._ops.mark(),
                                discard=discard or not part.written))

    def _open_part(self, step: OpenStep, start: int) -> Part:
        """Reserve the part of a piecewise step that starts with segment ``start``: the
        segments after it that fit the free ring space (and :attr:`_part_bytes`) and the
        free task entries, up to the first one that fired already (waits for the drain
        when not even ``start``'s fits; no other part is open then)."""
        plan = step.plan
        free = self._room()
        stop = plan.part_stop(start, min(free.free_bytes, self._part_bytes))
        stop = min(stop, start + max(free.free_entries, 1))
        for i in range(start + 1, stop):
            seg = plan.segments[i]
            if (seg.hook.name, seg.layer_no) in step.captured:
                stop = i
                break
        piece = plan.part(start, stop)
        program = build_program(piece, self._arena)
        base = self._reserve(program.reserve_bytes, program.entries, step.seq)
        return Part(piece, program, base, start)

    def _write_ring(
        self, offset: int, seg: Segment, key: CaptureKey, tensor: torch.Tensor, program: Program
    ) -> None:
        src = as_rows(tensor, key, seg.row)
        if src.shape[0] != seg.source_rows:
            msg = f"capture {key}: {src.shape[0]} rows, the plan has {seg.source_rows}"
            raise CaptureError(msg)
        dst = self._ring[offset : offset + seg.nbytes].view(TORCH_DTYPES[seg.row.dtype])
        dst = dst.view(seg.ring_rows, -1)
        if seg.source_index is None:
            copy_rows(dst, src[: seg.ring_rows])
        else:
            wide_dst, wide_src = widest(dst, src)
            torch.index_select(wide_src, 0, program.index(seg.source_index, src.device),
                               out=wide_dst)

    def seal(self, step: OpenStep) -> None:
        """Queue the step's device work and hand it to the drain.

        Raises:
            CaptureError: a planned capture point never ran.
        """
        program = step.program
        if program is None:
            return
        if step.mode is Mode.RING or step.mode is Mode.PIECES:
            if len(step.captured) != program.entries:
                missing = [
                    (s.hook.name, s.layer_no) for s in step.plan.segments
                    if (s.hook.name, s.layer_no) not in step.captured
                ]
                msg = f"step {step.seq}: planned capture points never ran: {missing[:8]}"
                self.end_part(step, discard=True)  # its region is freed, nothing stored
                raise CaptureError(msg)
            if step.mode is Mode.RING:
                self._enqueue(DrainItem(step.seq, step.plan, program, step.base, self._ops.mark()))
            return
        self._arena.settle()  # an eager step's landed rows (a replay moved its own)
        if not program.arena_checked:
            program.check_arena(step.plan, self._arena)
            program.arena_checked = True
        if step.mode is Mode.ARENA:
            if step.drained:  # the drain moves the rows out of the slot
                self._enqueue(DrainItem(step.seq, step.plan, program, step.base,
                                        self._ops.mark(), slot=step.slot))
                return
            self._from_arena(step.seq, step.plan, program, step.base, step.slot)
            return
        for piece in step.plan.pieces():
            piece_program = build_program(piece, self._arena)
            base = self._reserve(piece_program.reserve_bytes, piece_program.entries, step.seq)
            self._from_arena(step.seq, piece, piece_program, base, step.slot)
        if step.drained:  # later replays are queued after these copies
            self._free_slot(step.slot)

    def from_slot(self, program: Program, base: int, slot: int) -> None:
        """Queue ``program``'s copies from arena ``slot`` to the ring region at ``base``
        on the current stream (the drain's, when the drain asks)."""
        program.copy_from_arena(base, arena_wide=self._arena_wide, ring_wide=self._ring_wide,
                                slot_offset=slot * self._arena.slot_bytes)

    def _from_arena(self, seq: int, plan: CommitPlan, program: Program, base: int,
                    slot: int) -> None:
        self.from_slot(program, base, slot)
        self._enqueue(DrainItem(seq, plan, program, base, self._ops.mark()))

