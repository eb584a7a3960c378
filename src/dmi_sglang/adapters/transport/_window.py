"""Coalescing of decode rows on the device: one record per (request, hook, layer) and run.

A decode step gives every request one row per capture. Stored one record per token and
layer, a generation of 128 tokens over 28 layers is 3,584 records per hook and request.
The window keeps consecutive decode steps and emits, when it is flushed, one record per
request, capture and *run*: rows of consecutive positions. A position that does not
follow the previous one (a retracted and recomputed request) starts a new run, so rows
stay in position order and ranges stay exact.

**On the device.** The window lives in device memory laid out ``[segment, request, step,
row]`` per group. Appending a step is one strided device-to-device copy per group on the
drain's stream, straight from the ring (consecutive steps that queued up together move
with one copy per group) (the host copies nothing; the ring region is
freed once the copies completed). A flush gathers the rows that go out, in record order
(run by run, segment by segment), into a second device buffer with one ``index_select``
per group, and copies that to page-locked host memory with ONE device-to-host copy: the
host receives each payload byte once, already dense and in record order, and the
records are :class:`~dmi_sglang.columns.RecordBatch` columns over that memory (numpy, no
object per record). Rows of requests that left early and steps never reached before a
timeout are simply not gathered.

A request keeps its slot for the window's life. Within a window the decode batch can
only lose requests (a joining request had a prefill first, which flushed the window), so
the slots are the first step's requests; a step with a new request flushes and reopens.

Request rows (``final_logits``) follow the hold-back rule of ``_records``: each live
request's newest row is gathered after the others and copied by the device into memory
of its own, held until it is confirmed or its request finishes.

Flushed when all its steps are used, when its oldest step is older than the flush
timeout and the drain has nothing else queued (behind a backlog the rows wait for the
drain anyway), before any step that is not a plain decode step, and on stop. After a
window timed out, the next ones hold the steps that arrived before the timeout (x 1.25),
and they grow back (x 2 per full window) up to the buffer's size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from dmi_sglang.adapters.transport._device import DeviceOps, Marker
from dmi_sglang.adapters.transport._gil import GilSlice
from dmi_sglang.adapters.transport._pool import Bytes1D, PayloadPool
from dmi_sglang.adapters.transport._program import Group, Program
from dmi_sglang.adapters.transport._records import Emitted, HeldBlock, HeldRows
from dmi_sglang.columns import CaptureKey as RecordKey
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.errors import CaptureError

__all__ = ["DecodeWindow"]

_LIVE = object()
"""A request without a finish notice (its newest request row is held back)."""

_ALIGN = 16
"""Each group's cells start on this boundary (8-byte element views)."""
_SPARE_OUTPUTS = 2
"""Page-locked flush buffers kept for reuse (one more is made while the sink holds
both)."""
_GATHER_SLACK = 64 << 10
"""Gather buffer bytes beyond the window's: a flush aligns each group's kept rows and its
held rows apart (16 bytes at most each, so up to 2,048 groups)."""
_INDEX_BYTES = 4 << 20
"""Page-locked memory for a flush's gather indices (8 bytes a row gathered: a flush of
64 requests x 8 steps x 1,000 captures takes 4 MiB)."""
_HELD_SLABS = 2
"""Page-locked held-row slabs made when the first window with request rows opens."""
_HELD_SLAB_BYTES = 64 << 20
"""Slab of the held rows' pool: one flush's held rows of ``final_logits`` at batch 64 of
a 152k vocabulary (39 MB) fit one; larger ones get memory of their own."""

Ints = npt.NDArray[np.int64]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _elem(group: Group) -> int:
    """Bytes per element of the group's device copies (divides rows and offsets)."""
    return math.gcd(group.elem, group.row_nbytes)


def _step_rows(g: Group, program: Program, source: dict[int, torch.Tensor], *, start: int,
               step_bytes: int, k: int, from_arena: bool,
               device: torch.device) -> torch.Tensor:
    """A view (or, for a group with host indices, a gather) of group ``g``'s kept rows in
    ``k`` consecutive steps ``step_bytes`` apart from ``start`` in the ring or, with
    ``from_arena``, the arena (``source``: its wide views), as [segment, request row,
    step, element]: the window cells' own order."""
    e = _elem(g)
    w = g.row_nbytes // e
    if from_arena:
        rows, stride, offset = g.source_rows, g.arena_stride, g.arena_offset
    else:
        rows, stride, offset = g.ring_rows, g.ring_stride, g.ring_offset
    src = source[e].as_strided((g.count, rows, k, w), (stride // e, w, step_bytes // e, 1),
                               (start + offset) // e)
    if g.host_index is not None:
        return src.index_select(1, program.index(g.host_index, device))
    return src[:, : g.kept_rows] if rows != g.kept_rows else src


def _places(plans: Sequence[_GroupOut]) -> tuple[list[int], int, list[int], int]:
    """Where each group's kept rows and held rows go in a flush's gather buffer: the kept
    rows' offsets and their total, the held rows' offsets (after the kept rows) and
    their total, each group's part aligned."""
    places, held_places, at, held_at = [], [], 0, 0
    for p in plans:
        rb = p.group.row_nbytes
        held_bytes = len(p.held) * p.group.count * rb
        places.append(at)
        held_places.append(held_at)
        at += _align(len(p.index) * rb - held_bytes)
        held_at += _align(held_bytes)
    return places, at, held_places, held_at


def _concat_ranges(starts: Ints, lengths: Ints) -> Ints:
    """``[starts[0], starts[0] + lengths[0]), [starts[1], ...) ...`` as one index array."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(total, dtype=np.int64)


class _Runs:
    """Runs of a flush, by slot then step (numpy arrays): slot, first step, rows, first
    position, step number (``seq``) of the first row."""

    __slots__ = ("n", "seq", "slot", "start", "step")

    def __init__(self, slot: Ints, step: Ints, n: Ints, start: Ints, seq: Ints) -> None:
        self.slot = slot
        self.step = step
        self.n = n
        self.start = start
        self.seq = seq


@attrs.frozen(eq=False)
class _GroupOut:
    """What one group sends at a flush (see ``DecodeWindow._gather_plan``): the kept
    runs (``jobs``) and their rows, the cells to gather, the held runs."""

    group: Group
    labels: tuple[RecordKey, ...]
    jobs: Ints
    rows: Ints
    index: Ints
    held: Ints


class DecodeWindow:
    """Decode rows waiting on the device to be coalesced into records.

    Args:
        run_id: stored as ``model_id``.
        max_bytes: device memory of the window (and of its gather buffer, and of each
            page-locked flush buffer). A step larger than this is not coalesced
            (:meth:`fits`).
        timeout_s: longest time a row waits (``DMX_DRAIN_FLUSH_TIMEOUT_US``); a held
            request row waits for its confirmation instead.
        ops / ring: the transport's device and payload ring (appends copy from it).
        arena / arena_slot_bytes: the transport's decode-graph arena and the distance
            between its slots (appends of steps still in their slots copy from there).
        held: the drain's held request rows.
        gil: the drain's GIL slice (flushes give the GIL away between groups).
    """

    def __init__(
        self,
        run_id: str,
        max_bytes: int,
        timeout_s: float,
        *,
        ops: DeviceOps,
        ring: torch.Tensor,
        arena: torch.Tensor | None = None,
        arena_slot_bytes: int = 0,
        held: HeldRows | None = None,
        gil: GilSlice | None = None,
    ) -> None:
        self._run_id = run_id
        self._ops = ops
        self._gil = gil if gil is not None else GilSlice(0.0)
        self._max_bytes = max_bytes
        self._timeout = timeout_s
        self._held = held if held is not None else HeldRows()
        self._ring = ops.wide(ring)
        self._arena = ops.wide(arena) if arena is not None else None
        self._arena_slot_bytes = arena_slot_bytes
        self._cells_buf = ops.device_buffer(_align(max_bytes))
        self._gather_buf = ops.device_buffer(_align(max_bytes) + _GATHER_SLACK)
        self._cells_wide = ops.wide(self._cells_buf)
        self._gather_wide = ops.wide(self._gather_buf)
        self.host = PayloadPool(slab_bytes=_align(max_bytes), max_free_slabs=_SPARE_OUTPUTS,
                                buffer=ops.host_buffer)
        """Page-locked memory the flushes copy into (the batches' payloads)."""
        self.host.reserve(_SPARE_OUTPUTS)
        self._held_pool = PayloadPool(slab_bytes=_HELD_SLAB_BYTES, max_free_slabs=4,
                                      buffer=ops.host_buffer)
        """Page-locked memory the held request rows of a flush are copied into from the
        device (made when the first window with request rows opens)."""
        self._held_reserved = False
        self._key: Hashable = None
        self._groups: tuple[Group, ...] = ()
        self._labels: tuple[tuple[RecordKey, ...], ...] = ()
        self._cells: list[torch.Tensor] = []
        """Per group ``[segments, slots, steps, row elements]`` views of the window."""
        self._slots = 0
        self._steps = 0
        self._slot: dict[str, int] = {}
        self._rids: list[str] = []
        """The window's requests in slot order."""
        self._valid = np.zeros((0, 0), dtype=bool)
        self._pos = np.zeros((0, 0), dtype=np.int64)
        self._seq = np.zeros(0, dtype=np.int64)
        self._t = 0
        self.rows = 0
        self._finished: dict[str, int | None] = {}
        self._last_rids: tuple[str, ...] | None = None
        self._last_idx = np.zeros(0, dtype=np.int64)
        self._last_span: tuple[int, int] | None = None
        self._opened = 0.0
        self._steps_hint: int | None = None
        """Steps the last timed-out window reached (x 1.25): the next window is sized to
        what arrives before the timeout."""
        self._index_host: torch.Tensor | None = (
            ops.host_buffer(_INDEX_BYTES).view(torch.int64) if ops.is_cuda else None)
        """Page-locked memory the flushes' gather indices are uploaded from (made now:
        page-locked allocation synchronises the device; grown when a flush needs more)."""
        self._index_copied: torch.cuda.Event | None = None
        self.flushes = 0
        self.appends = 0
        """Appends so far (each moved one or more steps with one copy per group)."""
        self.gathered_bytes = 0

    @property
    def device_bytes(self) -> int:
        """Device memory the window holds (cells and gather buffer)."""
        return 2 * _align(self._max_bytes)

    def seconds_left(self) -> float | None:
        """Time until the window is due, or None when it is empty."""
        if not self.rows:
            return None
        return max(0.0, self._opened + self._timeout - time.monotonic())

    @property
    def full(self) -> bool:
        """True when every step of the window is used."""
        return bool(self.rows) and self._t >= self._steps

    def due(self) -> bool:
        """True when the window must be flushed now (full or timed out)."""
        return self.full or (bool(self.rows) and self._timed_out())

    def _timed_out(self) -> bool:
        return time.monotonic() >= self._opened + self._timeout

    def _bytes_for(self, program: Program, slots: int, steps: int) -> int:
        return sum(_align(g.count * slots * steps * g.row_nbytes) for g in program.groups)

    def fits(self, program: Program, layout: BatchLayout) -> bool:
        """True when one step of this shape fits the window at all."""
        return self._bytes_for(program, len(layout.request_ids), 1) <= self._max_bytes

    def can_take(self, program: Program, layout: BatchLayout) -> bool:
        """True when this plain decode step can join the window now."""
        if not self.rows:
            return True
        if program.host_key != self._key or self.full:
            return False
        rids = layout.request_ids
        return rids == self._last_rids or all(r in self._slot for r in rids)

    def has(self, request_id: str) -> bool:
        """True when rows of ``request_id`` wait in the window."""
        return bool(self.rows) and request_id in self._slot

    def finish(self, request_id: str, logits_end: int | None) -> None:
        """A finish notice for a request with rows in the window (applied at flush)."""
        self._finished[request_id] = logits_end

    def room(self, program: Program, layout: BatchLayout) -> int:
        """Steps of this shape the window can take now: what is left of it, or the size
        a window opened for this step would have (:meth:`can_take` said yes)."""
        if self.rows:
            return self._steps - self._t
        return self._steps_for(program, len(layout.request_ids))

    def _steps_for(self, program: Program, slots: int) -> int:
        per_step = max(1, program.host_row_bytes * slots)
        steps = max(1, self._max_bytes // per_step)
        if self._steps_hint is not None:
            steps = min(steps, self._steps_hint)
        while steps > 1 and self._bytes_for(program, slots, steps) > self._max_bytes:
            steps -= 1
        return steps

    def append(self, seqs: Sequence[int], program: Program, base: int,
               layouts: Sequence[BatchLayout], markers: Sequence[Marker], *,
               arena_slot: int = -1) -> None:
        """Queue the copies of consecutive plain decode steps' rows into their requests'
        slots (request ``i`` owns row ``i``), after the steps' device work (``markers``).

        The steps share ``program`` and their requests (in the same order), and their ring
        regions follow each other from ``base`` (``program.reserve_bytes`` apart), or,
        with ``arena_slot`` >= 0, their rows are still in consecutive arena slots from
        that one; so each group moves with ONE strided device copy for all of them.
        :meth:`can_take` said yes to the first, and the window has :meth:`room` for all.
        The ring regions (arena slots) may be reused only once the drain's stream passed
        these copies (a fence after them was waited for).
        """
        k = len(layouts)
        rids = layouts[0].request_ids if k else ()
        if not rids:
            return
        if not self.rows:
            self._open(program, rids)
        if k > self._steps - self._t:
            msg = f"{k} steps appended to a window with room for {self._steps - self._t}"
            raise ValueError(msg)
        if rids != self._last_rids:
            idx = np.fromiter((self._slot[r] for r in rids), dtype=np.int64, count=len(rids))
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            contiguous = hi - lo == len(rids) and bool(np.all(np.diff(idx) == 1))
            self._last_span = (lo, hi) if contiguous else None
            self._last_idx = idx
            self._last_rids = rids
        t, span, idx = self._t, self._last_span, self._last_idx
        groups, cells, device = program.groups, self._cells, self._ops.device
        source = self._arena if arena_slot >= 0 else self._ring
        assert source is not None
        step_bytes = program.reserve_bytes if arena_slot < 0 else self._arena_slot_bytes
        start = base if arena_slot < 0 else arena_slot * step_bytes

        def copy() -> None:
            # the contiguous-span copies go to the device in one call (see to_host_all)
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            for g, dst in zip(groups, cells, strict=True):
                src = _step_rows(g, program, source, start=start, step_bytes=step_bytes, k=k,
                                 from_arena=arena_slot >= 0, device=device)
                if span is not None:
                    dsts.append(dst[:, span[0] : span[1], t : t + k, :])
                    srcs.append(src)
                else:  # the batch's order changed: a scatter (rare)
                    dst[:, torch.from_numpy(idx).to(device), t : t + k, :] = src
            if dsts:
                torch._foreach_copy_(dsts, srcs)

        self._ops.on_drain_stream(markers, copy)
        self.appends += 1
        self._valid[idx, t : t + k] = True
        if k == 1:
            self._pos[idx, t] = layouts[0].starts
        else:
            self._pos[idx, t : t + k] = np.array([lay.starts for lay in layouts],
                                                 dtype=np.int64).T
        self._seq[t : t + k] = seqs
        self._t = t + k
        self.rows += k * len(rids)

    def _open(self, program: Program, rids: tuple[str, ...]) -> None:
        slots = len(rids)
        steps = self._steps_for(program, slots)
        cells, at = [], 0
        for g in program.groups:
            e = _elem(g)
            w = g.row_nbytes // e
            cells.append(self._cells_wide[e].as_strided(
                (g.count, slots, steps, w), (slots * steps * w, steps * w, w, 1), at // e))
            at += _align(g.count * slots * steps * g.row_nbytes)
        self._cells = cells
        if not self._held_reserved and any(g.request_rows for g in program.groups):
            self._held_pool.reserve(_HELD_SLABS)  # once: the pool keeps its slabs after
            self._held_reserved = True
        self._key, self._groups, self._labels = program.host_key, program.groups, program.labels
        self._slots, self._steps = slots, steps
        self._slot = {r: i for i, r in enumerate(rids)}
        self._rids = list(rids)
        self._valid = np.zeros((slots, steps), dtype=bool)
        self._pos = np.zeros((slots, steps), dtype=np.int64)
        self._seq = np.zeros(steps, dtype=np.int64)
        self._t = 0
        self._last_rids = None
        self._opened = time.monotonic()

    def flush(self, out: Emitted, *, final: bool = False) -> None:
        """Batches of everything in the window (one record per request, capture and
        run), each group's records as one :class:`RecordBatch`, over page-locked memory
        that copies queued on the drain's stream fill: wait for it (a fence) before the
        batches go anywhere; the held rows it holds are read only after that too. Call it
        once the previous flush was waited for (the held rows it left are read here).

        ``final`` (the run stops): nothing is held back any more.
        """
        if not self.rows:
            return
        if self.full:  # let the next window grow back
            self._steps_hint = None if self._steps_hint is None else 2 * self._steps_hint
        elif self._timed_out():
            self._steps_hint = max(2, self._t + (self._t + 3) // 4)
        runs = self._runs()
        groups = self._groups
        keep, holds = runs.n, np.zeros(0, dtype=np.int64)
        if any(g.request_rows for g in groups):
            self._gil.check()
            keep, holds = self._resolve(runs, out, final=final)
            self._held.detach_pinned()  # rows the flush did not confirm: still waiting
        else:  # no request rows in here: a finished request's rows held from an earlier
            for rid, logits_end in self._finished.items():  # step settle now, before
                self._held.finish(rid, logits_end, out)  # its commit follows this flush
        plans = []
        for g, labels in zip(groups, self._labels, strict=True):
            self._gil.check()
            plans.append(self._gather_plan(g, labels, runs, keep if g.request_rows else runs.n,
                                           holds if g.request_rows else None))
        self._gather(plans, runs, out)
        self.rows = 0
        self._slot = {}
        self._rids = []
        self._finished = {}
        self._last_rids = None
        self._cells = []
        self.flushes += 1

    def _runs(self) -> _Runs:
        """Maximal runs of consecutive positions per slot, by slot then step."""
        valid, pos = self._valid[:, : self._t], self._pos[:, : self._t]
        cont = np.zeros_like(valid)
        cont[:, 1:] = valid[:, 1:] & valid[:, :-1] & (pos[:, 1:] == pos[:, :-1] + 1)
        ends = valid.copy()
        ends[:, :-1] &= ~cont[:, 1:]
        slot, step = np.nonzero(valid & ~cont)
        _, last = np.nonzero(ends)  # same row-major order: one end per start
        return _Runs(slot.astype(np.int64), step.astype(np.int64),
                     (last - step + 1).astype(np.int64), pos[slot, step],
                     self._seq[step])

    def _resolve(self, runs: _Runs, out: Emitted, *, final: bool) -> tuple[Ints, Ints]:
        """Apply the hold-back rule to request rows: rows kept per run, and the runs
        whose last row is held back. Previously held rows are settled here."""
        rids = self._rids
        nruns = len(runs.n)
        keep = runs.n.copy()
        holds: list[int] = []
        slots, ns, starts = runs.slot.tolist(), runs.n.tolist(), runs.start.tolist()
        for j in range(nruns):
            slot, n, start = slots[j], ns[j], starts[j]
            rid = rids[slot]
            status = self._finished.get(rid, _LIVE)
            if final and status is _LIVE:
                status = None
            newest = j + 1 == nruns or slots[j + 1] != slot
            if j == 0 or slots[j - 1] != slot:  # the request's first run
                if status is _LIVE:
                    self._held.confirm(rid, out, before=int(runs.seq[j]))
                else:
                    self._held.finish(rid, status, out)  # type: ignore[arg-type]
            if status is _LIVE:
                if newest:
                    keep[j] = n - 1
                    holds.append(j)
            elif status is not None:
                k = max(0, min(n, status - start))
                out.discarded += (n - k) * sum(g.count for g in self._groups if g.request_rows)
                keep[j] = k
        return keep, np.asarray(holds, dtype=np.int64)

    def _gather_plan(self, g: Group, labels: tuple[RecordKey, ...], runs: _Runs,
                     counts: Ints, holds: Ints | None) -> _GroupOut:
        """What group ``g`` sends: its kept runs and their rows, and which rows to gather
        (rows of the group's cells viewed ``[segments x slots x steps, row]``, in record
        order: run by run, segment by segment, then the held rows)."""
        jobs = np.nonzero(counts > 0)[0]
        seg = np.arange(g.count, dtype=np.int64)
        first = ((seg[None, :] * self._slots + runs.slot[jobs][:, None]) * self._steps
                 + runs.step[jobs][:, None])
        index = _concat_ranges(first.ravel(), np.repeat(counts[jobs], g.count))
        held = holds if holds is not None else np.zeros(0, dtype=np.int64)
        if len(held):
            last = runs.step[held] + runs.n[held] - 1
            cells = (seg[None, :] * self._slots + runs.slot[held][:, None]) * self._steps
            index = np.concatenate([index, (cells + last[:, None]).ravel()])
        return _GroupOut(g, labels, jobs, counts[jobs], index, held)

    def _upload(self, index: Ints) -> Callable[[], torch.Tensor]:
        """What gives the device copy of ``index`` on the drain's stream (call it in the
        queued work): on CUDA from page-locked memory without waiting for anything (a
        pageable upload would wait for all the stream's queued work), the memory reused
        once the previous upload completed."""
        if not self._ops.is_cuda:
            return lambda: torch.from_numpy(index)
        if self._index_copied is not None:
            self._index_copied.synchronize()  # the previous flush's upload (long done)
        n = len(index)
        if self._index_host is None or self._index_host.numel() < n:
            size = max(n, 2 * self._index_host.numel() if self._index_host is not None
                       else _INDEX_BYTES // 8)
            self._index_host = self._ops.host_buffer(size * 8).view(torch.int64)
        host = self._index_host[:n]
        host.numpy()[:] = index
        done = self._index_copied = self._index_copied or torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        device = self._ops.device

        def upload() -> torch.Tensor:
            dev = torch.empty(n, dtype=torch.int64, device=device)
            dev.copy_(host, non_blocking=True)
            done.record()
            return dev
        return upload

    def _gather(self, plans: list[_GroupOut], runs: _Runs, out: Emitted) -> None:
        """Gather every group's rows on the device, the kept rows of all groups first and
        the held request rows after them, then queue the copy of each part to the host:
        the kept rows into a page-locked flush buffer (the batches' payloads), the held
        rows straight into the held rows' own page-locked memory (the host copies none of
        their bytes). Then make the batches and hold the held rows, over memory those
        copies fill: the caller waits for the drain's stream (a fence) before anything
        reads them."""
        places, kept_total, held_places, held_total = _places(plans)
        total = kept_total + held_total
        if not total:
            return
        if total > self._gather_buf.numel():
            msg = f"a flush gathers {total} bytes, its buffer holds {self._gather_buf.numel()}"
            raise CaptureError(msg)
        chunk = self.host.alloc(kept_total) if kept_total else None
        held_chunk = self._held_pool.alloc(held_total) if held_total else None
        cells, slots, steps = self._cells, self._slots, self._steps
        gather = self._gather_wide
        starts = np.zeros(len(plans) + 1, dtype=np.int64)
        np.cumsum([len(p.index) for p in plans], out=starts[1:])
        upload = self._upload(np.concatenate([p.index for p in plans]))

        def work() -> None:
            indices = upload()
            for p, place, held_place, src, at in zip(plans, places, held_places, cells,
                                                     starts[:-1].tolist(), strict=True):
                if not len(p.index):
                    continue
                e = _elem(p.group)
                w = p.group.row_nbytes // e
                flat = src.as_strided((p.group.count * slots * steps, w), (w, 1),
                                      src.storage_offset())
                index = indices[at : at + len(p.index)]
                kept_rows = len(p.index) - len(p.held) * p.group.count
                for rows, at_byte in ((index[:kept_rows], place),
                                      (index[kept_rows:], kept_total + held_place)):
                    if len(rows):
                        dst = gather[e][at_byte // e : at_byte // e + len(rows) * w]
                        torch.index_select(flat, 0, rows, out=dst.view(len(rows), w))
            # the copies return at once (CUDA); a fence waits for them
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            if chunk is not None:
                pairs.append((chunk.tensor, self._gather_buf[:kept_total]))
            if held_chunk is not None:
                pairs.append((held_chunk.tensor, self._gather_buf[kept_total:total]))
            self._ops.to_host_all(pairs)

        self._ops.on_drain_stream([], work)
        self.gathered_bytes += total
        host = chunk.array if chunk is not None else np.zeros(0, dtype=np.uint8)
        rids = tuple(self._rids)
        for p, place, held_place in zip(plans, places, held_places, strict=True):
            self._gil.check()
            rb, nseg = p.group.row_nbytes, p.group.count
            kept = int(p.rows.sum()) * nseg * rb
            if len(p.jobs):
                offsets = np.zeros(len(p.jobs) * nseg + 1, dtype=np.int64)
                np.cumsum(np.repeat(p.rows * rb, nseg), out=offsets[1:])
                start = runs.start[p.jobs]
                out.add_batch(RecordBatch(
                    self._run_id, rids, p.labels,
                    np.repeat(runs.slot[p.jobs], nseg),
                    np.tile(np.arange(nseg, dtype=np.int32), len(p.jobs)),
                    np.repeat(start, nseg), np.repeat(start + p.rows, nseg),
                    np.repeat(runs.seq[p.jobs], nseg), offsets, host[place : place + kept],
                ))
            if len(p.held):
                assert held_chunk is not None
                self._hold(p, runs, held_chunk.array[
                    held_place : held_place + len(p.held) * nseg * rb])

    def _hold(self, p: _GroupOut, runs: _Runs, own: Bytes1D) -> None:
        """Hold the newest request row of the live requests of ``p``'s held runs (their
        rows in ``own``, run by run, segment by segment: memory of the held rows' pool,
        filled by the device copy) as one :class:`~._records.HeldBlock`: columns, no
        object per record.

        Released together at the next flush, they become one batch over that memory
        without a copy; a row still waiting then gets memory of its own
        (:meth:`~._records.HeldRows.detach_pinned`), so no waiting row keeps a slab."""
        held = p.held
        last = runs.step[held] + runs.n[held] - 1
        rids = self._rids
        self._held.hold_block(HeldBlock(
            self._run_id, p.labels, row_nbytes=p.group.row_nbytes,
            request_ids=[rids[s] for s in runs.slot[held].tolist()],
            positions=runs.start[held] + runs.n[held] - 1, seqs=self._seq[last], memory=own))
