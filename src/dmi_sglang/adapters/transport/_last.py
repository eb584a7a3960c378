"""Device slots for the ``last`` position rule.

``last`` keeps the position that decided a request's last generated token; which one that
is becomes known only when the request finished, a forward or two after the row was
computed. So every forward writes the rows that decide a token (:func:`emitting_rows`)
of the captures with that rule into per-request slots on the device, and when the
request finished, one read plan (:func:`make_read_plan`) copies its row out: one row per
request and capture leaves the device, never the others.

Each request holds two slot rows, by the parity of the position: with SGLang's overlap
scheduler the request's extra forward (position ``last + 1``) runs before the scheduler
learns the request finished, and writes the other row. A slot is given back after the
read was queued on the current stream, so a request that reuses it writes after the
read. One more row takes what no slot wants (padding rows, requests left out).

A decode graph writes the slots through a static index tensor: a capture point of a
group of equal rows (dtype and width) with three members or more copies its rows into
fixed *landing* rows (a plain copy), and after the last ``last`` capture point one
``index_copy_`` per such group moves them into the slots (one indexed copy instead of
one per capture point); a capture point of a smaller group copies into the slots
itself (``index_copy_``). Then one ``bitwise_xor_`` of that index with a static flip
tensor (1 for a request's row, 0 for padding and requests left out): each replay moves
every request to its other slot row, which is where its next position goes. So a run of
decode graph steps of an unchanged batch, each request one position further, costs the
scheduler no device operation at all; the first step of a run uploads the index and the
flip together (one copy). A replay nobody committed (SGLang forwarding a batch the
session does not capture) is announced by :meth:`LastSlots.guard_replay`, which points
the index at the spare row with a zero flip first, so such a replay writes nowhere that
matters. Eager forwards use index tensors made for the step. Index lists reach the
device through page-locked staging without synchronising the scheduler. A finished
request's rows leave the slots by one indexed copy per group whose read regions follow
one another (:meth:`LastSlots.read_layout`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import attrs
import structlog
import torch

from dmi_sglang.adapters.transport._arena import CaptureKey, as_rows
from dmi_sglang.adapters.transport._device import TORCH_DTYPES, DeviceOps, copy_rows, widest
from dmi_sglang.adapters.transport._side import SideStream, on
from dmi_sglang.domain.capacity import LANDING_MIN_PLACES, last_slot_bytes, last_slot_groups
from dmi_sglang.domain.hooks import RESIDUAL_STREAM, RowBasis, Selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import CommitPlan, emitting_rows
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.shapes import ModelShape, RowSpec
from dmi_sglang.errors import CaptureError

__all__ = ["LastSlots", "ReadLayout"]

_UPLOAD_BUFFERS = 8

log = structlog.get_logger("dmi_sglang.transport")


class _Uploader:
    """Small int64 index lists to the device, on the current stream, without a host
    synchronisation: each list goes through one of a few page-locked buffers, reused
    once the copy that read it completed."""

    def __init__(self, ops: DeviceOps, capacity: int) -> None:
        self._ops = ops
        self._capacity = capacity
        self._buffers = [torch.empty(capacity, dtype=torch.int64, pin_memory=ops.is_cuda)
                         for _ in range(_UPLOAD_BUFFERS if ops.is_cuda else 1)]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._buffers)
        self._next = 0

    def __call__(self, values: Sequence[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """``values`` on the device: in a new tensor, or copied into ``into`` (contiguous,
        exactly ``len(values)`` elements)."""
        n = len(values)
        if n > self._capacity:
            msg = f"{n} index rows exceed the {self._capacity} the last slots were made for"
            raise CaptureError(msg)
        if not self._ops.is_cuda:
            made = torch.tensor(values, dtype=torch.int64)
            return made if into is None else into.copy_(made)
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None:
            event.synchronize()
        staged = self._buffers[i]
        staged.numpy()[:n] = values
        out = torch.empty(n, dtype=torch.int64, device=self._ops.device) if into is None else into
        out.copy_(staged[:n], non_blocking=True)
        if event is None:
            event = self._events[i] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return out


def _grouped(selection: Selection, shape: ModelShape, *, rows: int, landing_rows: int,
             device: torch.device) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor]], dict[CaptureKey, torch.Tensor],
        dict[CaptureKey, torch.Tensor], list[tuple[tuple[CaptureKey, ...], torch.Tensor]]]:
    """Slot rows per group of equal rows (:func:`~dmi_sglang.domain.capacity.
    last_slot_groups`), and landing rows for the groups of
    :data:`~dmi_sglang.domain.capacity.LANDING_MIN_PLACES` or more: the groups'
    ``(slots, landing)`` pairs, each capture's views of them, and every group's
    captures with its slot rows."""
    moves = []
    buffers: dict[CaptureKey, torch.Tensor] = {}
    lands: dict[CaptureKey, torch.Tensor] = {}
    groups = []
    for members in last_slot_groups(selection, shape):
        row = shape.capture_row(selection, *members[0])
        dtype, elements = TORCH_DTYPES[row.dtype], math.prod(row.dims)
        slots = torch.zeros((rows, len(members), elements), dtype=dtype, device=device)
        landing = None
        if len(members) >= LANDING_MIN_PLACES:
            # capture-major: each capture point's landing rows are contiguous, so its
            # copy is a plain memcpy (a strided destination takes an element-wise
            # kernel, slower on the GPU); the move reads them as [row, capture, elements]
            landing = torch.zeros((len(members), landing_rows, elements), dtype=dtype,
                                  device=device)
            moves.append((slots, landing.transpose(0, 1)))
        for k, (hook, layer_no) in enumerate(members):
            buffers[hook.name, layer_no] = slots[:, k]
            if landing is not None:
                lands[hook.name, layer_no] = landing[k]
        groups.append((tuple((hook.name, layer_no) for hook, layer_no in members), slots))
    return moves, buffers, lands, groups


@attrs.frozen(eq=False)
class ReadLayout:
    """A read plan's copies (:meth:`LastSlots.read_layout`): per group read at once, its
    slot rows as ``[capture, slot row, elements]``, and its byte offset and bytes in the
    plan's region; per capture read alone, its key, offset and bytes."""

    groups: tuple[tuple[torch.Tensor, int, int], ...]
    single: tuple[tuple[CaptureKey, int, int], ...]


class _Run:
    """Consecutive decode graph steps of one batch, each request one position further:
    every replay of the run flips the device index to the next step's rows by itself."""

    __slots__ = ("batch", "captured")

    def __init__(self, plan: CommitPlan) -> None:
        self.batch = plan.batch
        """The newest step's whole layout."""
        self.captured = plan.layout.request_ids

    def follows(self, plan: CommitPlan) -> bool:
        """True when ``plan`` is the next step of the run (same requests, same padding,
        same requests captured, every request one position further)."""
        batch, before = plan.batch, self.batch
        if batch.padded_batch_size != before.padded_batch_size or (
                plan.layout.request_ids != self.captured):
            return False
        if batch.moved_on_from(before):
            return True  # moved on from the run's uniform batch: uniform, one further
        return batch.is_uniform_decode and batch.follows(before)


class LastSlots:
    """The ``last`` slots of one transport (see the module docstring).

    Args:
        selection / shape: the captures with the ``last`` rule and their stored rows.
        requests: requests that may hold a slot at once (running ones, and retracted
            ones waiting to run again).
        max_graph_batch: rows of the largest decode graph (its static index).
        ops: the device primitives.
    """

    def __init__(self, selection: Selection, shape: ModelShape, *, requests: int,
                 max_graph_batch: int, ops: DeviceOps) -> None:
        self._keys: dict[CaptureKey, tuple[RowSpec, RowBasis]] = {
            (hook.name, layer): (shape.capture_row(selection, hook, layer), hook.row_basis)
            for hook, layer in selection.captures_kept_by(PositionRule.LAST)}
        self.requests = requests
        self.spare = 2 * requests
        """The row that takes what no slot wants."""
        width = max(max_graph_batch, 1)
        self._moves, self._buffers, self._lands, self._groups = _grouped(
            selection, shape, rows=self.spare + 1, landing_rows=width, device=ops.device)
        """Per group of equal rows that lands, its slot rows (``[slot row, capture, row
        elements]``) and where a decode graph's capture points put their rows first
        (stored capture by capture, seen here as ``[row, capture, row elements]``; after
        the last one, one ``index_copy_`` per group moves them into the slots); each
        capture's views of its slot rows, and of its landing rows (contiguous) when its
        group lands."""
        self._landed = 0
        """Rows the current step's (or recording's) capture points put in the landing."""
        self.nbytes = last_slot_bytes(selection, shape, requests=requests,
                                      max_graph_batch=width)
        self._idle = torch.tensor([[self.spare] * width, [0] * width], dtype=torch.int64,
                                  device=ops.device)
        self._control = self._idle.clone()
        """The decode graphs' static slot index (row 0) and its flip (row 1); a bucket of
        ``bs`` rows uses the first ``bs`` columns."""
        self._armed = False
        """True when :attr:`_control` holds a committed step's index, not the idle one."""
        self._upload = _Uploader(ops, max(requests, 2 * width, 1))
        self._slot_of: dict[str, int] = {}
        self._first: dict[str, int] = {}
        """Per request, the first position whose row went to its slot."""
        self._newest: dict[str, int] = {}
        """Per request, the newest such position (for those outside :attr:`_run`)."""
        self._run: _Run | None = None
        self._free = list(range(requests - 1, -1, -1))
        self._padded = False
        self._eager: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._pending: list[tuple[str, int | None]] = []
        self._notified: set[str] = set()
        """Requests notified (kept for the run, as the session keeps every request id): a
        forward after the notice (an abort SGLang still prefills once) writes nowhere."""
        self._slotless: set[str] = set()
        self.slotless = 0
        """Requests that found no free slot: they get no ``last`` row (read as
        incomplete), counted and logged instead of failing the run."""
        self._recorded: set[CaptureKey] = set()
        self._recording: set[CaptureKey] = set()
        """Captures recorded into the graph being captured (its flip follows the last)."""
        self._fired: set[CaptureKey] = set()
        self._stepped = False
        """The committed padded step run eagerly flipped the index already."""
        self._undo: list[tuple[str, int | None, int | None]] = []
        self._flipped: tuple[_Run, BatchLayout] | None = None
        self._began = False
        """A step began (and did not end or abort yet): what :meth:`abort` may undo."""

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def active(self) -> bool:
        """True while a committed step writes the slots."""
        return self._padded or self._eager is not None

    def begin(self, plan: CommitPlan) -> None:
        """A step is committed: where its emitting rows go (slots are taken here).

        A decode graph step whose batch is the previous one's, each request one position
        further, finds its index on the device already (the previous replay flipped it):
        no device op, no pass over the batch, no upload."""
        batch = plan.batch
        self._fired.clear()
        self._stepped = False
        self._landed = 0
        self._undo.clear()
        self._flipped = None
        self._began = True
        run = self._run
        if plan.padded and run is not None and run.follows(plan):
            self._flipped = (run, run.batch)
            run.batch = batch
            self._padded = True
            return
        self._end_run()
        captured = None if batch is plan.layout else frozenset(plan.layout.request_ids)
        token_src: list[int] = []
        request_src: list[int] = []
        dst: list[int] = []
        for token_row, request_row, rid, position in emitting_rows(batch):
            if captured is not None and rid not in captured:
                continue
            slot = self._slot(rid)
            if slot is None:
                continue
            token_src.append(token_row)
            request_src.append(request_row)
            dst.append(2 * slot + position % 2)
            newest = self._newest.get(rid)
            self._undo.append((rid, self._first.get(rid), newest))
            if newest is not None and position > newest + 1:  # positions never written:
                self._first[rid] = position  # the slot's rows before are not theirs
            else:
                self._first.setdefault(rid, position)
            self._newest[rid] = position
        if plan.padded:  # a decode graph: row i is request i, padding rows go spare
            self._check_recorded()
            width = self._control.shape[1]
            index, flip = [self.spare] * width, [0] * width
            uniform = batch.is_uniform_decode
            for row, d in zip(request_src, dst, strict=True):
                index[row] = d
                flip[row] = int(uniform)  # its next position is the other parity
            self._upload(index + flip, into=self._control.view(-1))  # one device op
            self._armed = self._padded = True
            if uniform:
                self._run = _Run(plan)
        elif dst:
            self._eager = (self._upload(token_src), self._upload(request_src),
                           self._upload(dst))

    def capture(self, key: CaptureKey, tensor: torch.Tensor, *, capturing: bool,
                side: SideStream | None = None) -> None:
        """Write ``tensor``'s emitting rows into the slots (recorded while capturing a
        graph; nothing outside a committed step). With ``side`` (a decode graph being
        captured), a residual-stream capture's copy, the moves into the slots and the
        index's flip go on that stream (:mod:`._side`)."""
        row, basis = self._keys[key]
        if capturing or self._padded:
            src = as_rows(tensor, key, row)
            n = src.shape[0]
            seen = self._recording if capturing else self._fired
            if capturing and key in seen:  # a recording began: the one before missed keys
                self._check_recorded()
            forked = side if side is not None and key[0] in RESIDUAL_STREAM else None
            if key in self._lands:
                self._land(key, src, forked)
            else:
                wide_buffer, wide_src = widest(self._buffers[key], src)
                on(forked, functools.partial(wide_buffer.index_copy_, 0, self._control[0, :n],
                                             wide_src))
            seen.add(key)
            if capturing:
                self._recorded.add(key)
            if len(seen) == len(self._keys) and (capturing or not self._stepped):
                # after the last capture point: the rows into the slots, then every
                # request to its next slot row
                index, flip, moves = self._control[0, :n], self._control[1, :n], self._moves

                def move() -> None:
                    for slots, landing in moves:
                        slots.index_copy_(0, index, landing[:n])
                    index.bitwise_xor_(flip)

                on(side, move)
                self._landed = 0
                self._recording.clear()
                self._stepped = not capturing
            return
        buffer = self._buffers[key]
        if self._eager is None:
            return
        self._fired.add(key)
        token_src, request_src, dst = self._eager
        src = as_rows(tensor, key, row)
        wide_buffer, wide_src = widest(buffer, src)
        wide_buffer.index_copy_(0, dst, wide_src.index_select(
            0, token_src if basis is RowBasis.TOKEN else request_src))

    def _land(self, key: CaptureKey, src: torch.Tensor, side: SideStream | None) -> None:
        """Put a decode graph capture point's rows in its landing rows (a plain copy; on
        ``side`` when given).

        Raises:
            CaptureError: more rows than the largest decode graph's, or another row count
                than the step's other capture points wrote (one move takes them all).
        """
        n = src.shape[0]
        landing = self._lands[key]
        if n > landing.shape[0] or (self._landed and n != self._landed):
            msg = (f"last capture {key}: {n} rows, where the step's landing holds "
                   f"{self._landed or landing.shape[0]} (the largest decode graph's batch, "
                   f"the same for every capture point of a step)")
            raise CaptureError(msg)
        on(side, functools.partial(copy_rows, landing[:n], src))
        self._landed = n

    def end(self) -> None:
        """The step is sealed.

        Raises:
            CaptureError: a step whose ``last`` capture points did not all run, eagerly
                or recorded in the decode graph it replayed (the slots would hold another
                request's rows).
        """
        eager, padded = self._eager is not None, self._padded
        self._reset()
        if padded and len(self._recorded) == len(self._keys):  # every point in the graphs
            return
        ran = self._fired | self._recorded if padded else self._fired
        if (eager or padded) and not ran >= self._keys.keys():
            missing = sorted(set(self._keys) - ran)
            msg = f"last capture points never ran in a committed step: {missing[:4]}"
            raise CaptureError(msg)

    def abort(self) -> None:
        """The step's forward raised: what it may have written is not known, so the
        requests' newest positions go back to what the steps before left."""
        if self._flipped is not None:  # whether the replay flipped the index is not known
            run, batch = self._flipped
            run.batch = batch
            self._end_run()  # the next graph step uploads its index again
        elif self._began:  # a run this step started holds its positions: forget it
            self._run = None
        for rid, first, newest in reversed(self._undo):
            for table, value in ((self._first, first), (self._newest, newest)):
                if value is None:
                    table.pop(rid, None)
                else:
                    table[rid] = value
        self._reset()

    def _check_recorded(self) -> None:
        """Raise when a decode graph was recorded without every ``last`` capture point:
        it holds no flip, so its replays would write the wrong slot rows."""
        if self._recording:
            missing = sorted(set(self._keys) - self._recording)
            self._recording.clear()
            msg = f"a decode graph was recorded without the last capture points {missing[:4]}"
            raise CaptureError(msg)

    def guard_replay(self) -> None:
        """A decode graph is about to replay with no committed step: point its slot index
        at the spare row, with a zero flip, so the replay writes nowhere that matters
        (one device op, only when a committed step's index is there)."""
        self._end_run()
        if self._armed:
            self._control.copy_(self._idle)
            self._armed = False

    def _reset(self) -> None:
        self._landed = 0
        self._padded = False
        self._eager = None
        self._undo.clear()
        self._flipped = None
        self._began = False

    @property
    def pending(self) -> bool:
        """Finish notices wait for :meth:`take_reads`."""
        return bool(self._pending)

    def finished(self, request_id: str, logits_end: int | None) -> None:
        """A finish notice, held until :meth:`take_reads` (the transport orders it after
        the read of the request's row)."""
        self._pending.append((request_id, logits_end))

    def take_reads(self) -> tuple[list[tuple[str, int, int]], list[tuple[str, int | None]]]:
        """The finish notices so far, and of them the reads to queue: ``(request id,
        position, slot row)`` of each finished request whose slot holds the row of
        position ``logits_end - 1`` (the one that decided its last token; a request that
        generated nothing has none). Their slots are free again once the caller queued
        the reads."""
        notices, self._pending = self._pending, []
        if notices:
            self._end_run()  # a slot the run's index holds may be given back
        reads = []
        for rid, end in notices:
            self._notified.add(rid)
            self._slotless.discard(rid)
            slot = self._slot_of.pop(rid, None)
            first, newest = self._first.pop(rid, None), self._newest.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
            if slot is None or first is None or newest is None:
                continue
            # A request's rows that decide tokens have consecutive positions; the row of
            # end - 1 is in its slot if it was written and not overwritten (only the
            # extra forward, at end, came after it).
            if end is not None and first <= end - 1 and end - 1 <= newest <= end:
                reads.append((rid, end - 1, 2 * slot + (end - 1) % 2))
        return reads, notices

    def read_layout(self, offsets: Mapping[CaptureKey, tuple[int, int]],
                    rows: int) -> ReadLayout:
        """How to read ``rows`` rows of every capture into a plan's region, where each
        capture's rows lie at ``offsets`` (its byte offset in the region and its bytes,
        the rows one after another): one indexed copy per group of captures whose
        regions follow one another in the group's order (the read goes to them as one
        ``[capture, row, elements]`` block), else one per capture.

        Raises:
            CaptureError: a capture's bytes are not ``rows`` of its rows.
        """
        grouped: list[tuple[torch.Tensor, int, int]] = []
        single: list[tuple[CaptureKey, int, int]] = []
        for keys, slots in self._groups:
            row_bytes = slots.shape[2] * slots.element_size()
            sizes = {key: offsets[key][1] for key in keys}
            if any(size != rows * row_bytes for size in sizes.values()):
                msg = f"a read of {rows} rows of {row_bytes} bytes planned as {sizes}"
                raise CaptureError(msg)
            first, size = offsets[keys[0]]
            if len(keys) > 1 and all(offsets[key] == (first + k * size, size)
                                     for k, key in enumerate(keys)):
                grouped.append((slots.transpose(0, 1), first, size * len(keys)))
            else:
                single += [(key, *offsets[key]) for key in keys]
        return ReadLayout(tuple(grouped), tuple(single))

    def read_into(self, layout: ReadLayout, rows: torch.Tensor, region: torch.Tensor) -> None:
        """Copy slot ``rows`` of every capture into ``region`` (the plan's bytes, as
        :meth:`read_layout` placed them)."""
        n = rows.shape[0]
        for slots, offset, nbytes in layout.groups:  # [capture, slot row, elements]
            out = region[offset : offset + nbytes].view(slots.dtype)
            torch.index_select(slots, 1, rows, out=out.view(slots.shape[0], n, -1))
        for key, offset, nbytes in layout.single:
            buffer = self._buffers[key]
            out = region[offset : offset + nbytes].view(buffer.dtype)
            torch.index_select(buffer, 0, rows, out=out.view(n, -1))

    def upload(self, values: Sequence[int]) -> torch.Tensor:
        """An index list on the device (see :class:`_Uploader`)."""
        return self._upload(values)

    def _end_run(self) -> None:
        """Leave the run of unchanged decode steps: its requests' newest positions go
        back to the per-request record."""
        run, self._run = self._run, None
        if run is None:
            return
        batch = run.batch
        for rid, start in zip(batch.request_ids, batch.starts, strict=True):
            if rid in self._newest:
                self._newest[rid] = start

    def _slot(self, request_id: str) -> int | None:
        """The request's slot; None for a request notified already, or while none is
        free (counted and logged once per request; a slot freed later is taken at the
        request's next forward, and its ``last`` row is read if it came that late)."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if request_id in self._notified:
            return None
        if not self._free:  # it tries again at its next forward (its rows from then on)
            if request_id in self._slotless:
                return None
            self._slotless.add(request_id)
            self.slotless += 1
            log.warning("dmi.last_slots_full", request_id=request_id, slots=self.requests,
                        requests_without=self.slotless,
                        hint="its last rows are not captured (it reads as incomplete); "
                             "start the engine with --max-running-requests set")
            return None
        slot = self._slot_of[request_id] = self._free.pop()
        return slot
