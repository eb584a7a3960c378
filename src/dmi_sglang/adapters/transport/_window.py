"""Coalescing of decode rows: one record per (request, hook, layer) and run of steps.

A decode step gives every request one row per capture. Stored one record per token and
layer, a generation of 128 tokens over 28 layers is 3,584 records per hook and request,
and building them costs the drain (and the GIL) more than the bytes do. The window keeps
consecutive decode steps in host memory and emits, when it is flushed, one record per
request, capture and *run*: rows of consecutive positions. A position that does not
follow the previous one (a retracted and recomputed request) starts a new run, so rows
stay in position order and ranges stay exact.

**Request-major.** The window's memory is laid out ``[segment, request, step, row
bytes]`` per group: appending a step writes each request's row straight into its place
(one strided copy per group and step, the GIL released, spread over a few threads
when the step is large: ``_copier``), so the rows of a run are
already contiguous and its records are slices of the window's own memory: no copy at
flush. A request keeps its slot for the window's life. Within a window the decode batch
can only lose requests (a joining request had a prefill first, which flushed the
window), so the slots are the first step's requests; a step with a new request flushes
and reopens. Slots of requests that left early, and steps never reached before a
timeout, stay unused: when less than half of the window's cells hold rows, the flush
gathers the rows into compact pooled chunks instead (one ``index_select`` per chunk), so
that records never pin much more memory than they hold.

Request rows (``final_logits``) follow the hold-back rule of ``_records``: each
request's newest row is held until confirmed or finished.

Flushed when all its steps are used, when its oldest step is older than the flush
timeout and the drain has nothing else queued (behind a backlog the rows wait for the
drain anyway), before any step that is not a plain decode step, and on stop. A window
holds at most ``max_bytes``; after a window timed out, the next ones hold the steps that
arrived before the timeout (x 1.25), so that they fill and are sliced in place, and they
grow back (x 2 per full window) up to ``max_bytes``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import numpy as np
import torch

from dmi_sglang.adapters.transport._copier import ParallelCopier
from dmi_sglang.adapters.transport._pool import Chunk, PayloadPool
from dmi_sglang.adapters.transport._program import Bytes2D, Group, Program, host_rows
from dmi_sglang.adapters.transport._records import Emitted, HeldRows, Yielder, copy_row
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.records import CaptureRecord

__all__ = ["DecodeWindow"]

_LIVE = object()
"""A request without a finish notice (its newest request row is held back)."""

_ELEMENT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16,
          torch.uint8: np.uint8}
_SPARE_WINDOWS = 2
"""Window-sized buffers kept for reuse."""
_ALIGN = 64
"""Each group's cells start on this boundary (typed views for ``index_select``)."""


def _wide(rows: np.ndarray, row_nbytes: int) -> torch.Tensor:
    """``rows`` ([segments, cells, row bytes]) as a tensor of the widest element that
    divides a row, sharing memory (for ``index_select``)."""
    elem = next(e for e in (8, 4, 2, 1) if row_nbytes % e == 0)
    return torch.from_numpy(rows).view(_ELEMENT[elem])


class _Runs:
    """Runs of a flush, by slot then step: slot, first step, rows, first position, step
    number (``seq``) of the first row."""

    __slots__ = ("n", "seq", "slot", "start", "step")

    def __init__(self, slot: list[int], step: list[int], n: list[int], start: list[int],
                 seq: list[int]) -> None:
        self.slot = slot
        self.step = step
        self.n = n
        self.start = start
        self.seq = seq


class DecodeWindow:
    """Decode rows waiting to be coalesced into records.

    Args:
        run_id: stored as ``model_id``.
        max_bytes: bound on the window's memory (one step is always accepted).
        timeout_s: longest time a row waits (``DMX_DRAIN_FLUSH_TIMEOUT_US``); a held
            request row waits for its confirmation instead.
        pool: where compacted payloads come from.
        held: the drain's held request rows.
        copier: copies each appended step into place (several threads for large steps).
    """

    def __init__(
        self,
        run_id: str,
        max_bytes: int,
        timeout_s: float,
        *,
        pool: PayloadPool | None = None,
        held: HeldRows | None = None,
        copier: ParallelCopier | None = None,
    ) -> None:
        self._run_id = run_id
        self._copier = copier if copier is not None else ParallelCopier(1)
        self._max_bytes = max_bytes
        self._timeout = timeout_s
        self._pool = pool if pool is not None else PayloadPool()
        self._held = held if held is not None else HeldRows()
        self._space = PayloadPool(slab_bytes=max(max_bytes, 1 << 20) + (1 << 16),  # + alignment
                                  max_free_slabs=_SPARE_WINDOWS)
        self._key: Hashable = None
        self._groups: tuple[Group, ...] = ()
        self._chunk: Chunk | None = None
        self._cells: list[np.ndarray] = []
        """Per group ``[segments, slots, steps, row bytes]`` views of the window memory."""
        self._offsets: list[int] = []
        """Per group, where its cells start in the chunk."""
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
        what arrives before the timeout, so that it fills and is sliced in place."""

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

    def can_take(self, program: Program, layout: BatchLayout) -> bool:
        """True when this plain decode step can join the window."""
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

    def append(
        self, seq: int, program: Program, staging: Bytes2D, base: int, layout: BatchLayout
    ) -> None:
        """Copy one plain decode step's rows out of staging into their requests' slots
        (request ``i`` owns row ``i``); :meth:`can_take` said yes."""
        rids = layout.request_ids
        if not rids:
            return
        if not self.rows:
            self._open(program, rids)
        if rids != self._last_rids:
            idx = np.fromiter((self._slot[r] for r in rids), dtype=np.int64, count=len(rids))
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            contiguous = hi - lo == len(rids) and bool(np.all(np.diff(idx) == 1))
            self._last_span = (lo, hi) if contiguous else None
            self._last_idx = idx
            self._last_rids = rids
        t, idx, span = self._t, self._last_idx, self._last_span
        if span is not None:
            self._copier.copy([(cells[:, span[0] : span[1], t, :], host_rows(staging, base, g))
                               for cells, g in zip(self._cells, program.groups, strict=True)])
        else:  # the batch's order changed: a scatter (rare)
            for cells, group in zip(self._cells, program.groups, strict=True):
                cells[:, idx, t, :] = host_rows(staging, base, group)
        self._valid[idx, t] = True
        self._pos[idx, t] = layout.starts
        self._seq[t] = seq
        self._t = t + 1
        self.rows += len(rids)

    def _open(self, program: Program, rids: tuple[str, ...]) -> None:
        slots = len(rids)
        steps = max(1, self._max_bytes // max(program.host_row_bytes * slots, 1))
        if self._steps_hint is not None:
            steps = min(steps, self._steps_hint)
        sizes = [g.count * slots * steps * g.row_nbytes for g in program.groups]
        chunk = self._space.alloc(sum(-(-n // _ALIGN) * _ALIGN for n in sizes))
        cells, offsets, at = [], [], 0
        for g, n in zip(program.groups, sizes, strict=True):
            cells.append(chunk.array[at : at + n].reshape(g.count, slots, steps, g.row_nbytes))
            offsets.append(at)
            at += -(-n // _ALIGN) * _ALIGN
        self._chunk, self._cells, self._offsets = chunk, cells, offsets
        self._key, self._groups = program.host_key, program.groups
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
        """Records of everything in the window (one per request, capture and run).

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
        token = [i for i, g in enumerate(groups) if not g.request_rows]
        request = [i for i, g in enumerate(groups) if g.request_rows]
        keep = runs.n
        if request:
            keep = self._resolve(runs, request, out, final=final)
        compact = 2 * int(self._valid[:, : self._t].sum()) < self._slots * self._steps
        yielder = Yielder()
        for i in token + request:
            counts = keep if groups[i].request_rows else runs.n
            if compact:
                self._gathered(i, runs, counts, out, yielder)
            else:
                self._in_place(i, runs, counts, out, yielder)
        self.rows = 0
        self._slot = {}
        self._rids = []
        self._finished = {}
        self._last_rids = None
        self._chunk = None  # its memory returns once the records let go of it
        self._cells = []
        self._space.release()  # ... for the next window to reuse (no fresh pages)

    def _runs(self) -> _Runs:
        """Maximal runs of consecutive positions per slot, by slot then step."""
        valid, pos = self._valid[:, : self._t], self._pos[:, : self._t]
        cont = np.zeros_like(valid)
        cont[:, 1:] = valid[:, 1:] & valid[:, :-1] & (pos[:, 1:] == pos[:, :-1] + 1)
        ends = valid.copy()
        ends[:, :-1] &= ~cont[:, 1:]
        slot, step = np.nonzero(valid & ~cont)
        _, last = np.nonzero(ends)  # same row-major order: one end per start
        return _Runs(slot.tolist(), step.tolist(), (last - step + 1).tolist(),
                     pos[slot, step].tolist(), self._seq[step].tolist())

    def _resolve(self, runs: _Runs, groups: list[int], out: Emitted, *,
                 final: bool) -> list[int]:
        """Apply the hold-back rule to request rows: rows kept per run. Held and
        discarded rows leave the window here."""
        rids = self._rids
        keep: list[int] = []
        nruns = len(runs.n)
        for j in range(nruns):
            slot, n, start = runs.slot[j], runs.n[j], runs.start[j]
            rid = rids[slot]
            status = self._finished.get(rid, _LIVE)
            if final and status is _LIVE:
                status = None
            newest = j + 1 == nruns or runs.slot[j + 1] != slot
            if j == 0 or runs.slot[j - 1] != slot:  # the request's first run
                if status is _LIVE:
                    self._held.confirm(rid, out)
                else:
                    self._held.finish(rid, status, out)  # type: ignore[arg-type]
            if status is _LIVE:
                k = n - 1 if newest else n
                if newest:
                    self._hold(rid, slot, runs.step[j] + n - 1, start + n - 1, groups)
            elif status is None:
                k = n
            else:
                k = max(0, min(n, status - start))  # type: ignore[operator]
                out.discarded += (n - k) * sum(self._groups[i].count for i in groups)
            keep.append(k)
        return keep

    def _hold(self, rid: str, slot: int, step: int, pos: int, groups: list[int]) -> None:
        seq = int(self._seq[step])
        for i in groups:
            group, cells = self._groups[i], self._cells[i]
            for s, meta in enumerate(group.metas):
                self._held.hold(
                    CaptureRecord(
                        self._run_id, rid, meta.act_name, meta.layer_no, 0, pos, pos + 1,
                        meta.dtype, (1, *meta.dims), copy_row(cells[s, slot, step]), seq,
                    )
                )

    def _in_place(self, i: int, runs: _Runs, counts: list[int], out: Emitted,
                  yielder: Yielder) -> None:
        """Records of group ``i``: slices of the window's own memory."""
        assert self._chunk is not None
        group, rids = self._groups[i], self._rids
        rb, slots, steps = group.row_nbytes, self._slots, self._steps
        base = self._chunk.offset + self._offsets[i]
        view, run_id, append = self._chunk.view, self._run_id, out.records.append
        metas = group.metas
        rows = 0
        for j, k in enumerate(counts):
            if not k:
                continue
            slot, t0, a, sq = runs.slot[j], runs.step[j], runs.start[j], runs.seq[j]
            rid, nbytes = rids[slot], k * rb
            for s, m in enumerate(metas):
                p = base + ((s * slots + slot) * steps + t0) * rb
                append(CaptureRecord(run_id, rid, m.act_name, m.layer_no, 0, a, a + k,
                                     m.dtype, (k, *m.dims), view[p : p + nbytes], sq))
            rows += k
            yielder.tick(len(metas))
        out.rows += rows * len(metas)
        out.bytes += rows * rb * len(metas)

    def _gathered(self, i: int, runs: _Runs, counts: list[int], out: Emitted,
                  yielder: Yielder) -> None:
        """Records of group ``i`` from compact pooled chunks of at most a slab: the kept
        rows gathered with one ``index_select`` per chunk."""
        group = self._groups[i]
        rb, count, steps = group.row_nbytes, group.count, self._steps
        src = _wide(self._cells[i].reshape(count, self._slots * steps, rb), rb)
        index = torch.from_numpy(np.concatenate(
            [np.arange(runs.slot[j] * steps + runs.step[j],
                       runs.slot[j] * steps + runs.step[j] + k, dtype=np.int64)
             for j, k in enumerate(counts)] or [np.zeros(0, dtype=np.int64)]))
        slab = self._pool.slab_bytes
        nruns = len(counts)
        j = r = 0
        while j < nruns:
            j0, r0, rows = j, r, 0
            while j < nruns and (not rows or count * (rows + counts[j]) * rb <= slab):
                rows += counts[j]
                j += 1
            r += rows
            if not rows:
                continue
            per = max(1, slab // (rows * rb))  # segments per chunk (all of them normally)
            for s0 in range(0, count, per):
                s1 = min(count, s0 + per)
                chunk = self._pool.alloc((s1 - s0) * rows * rb)
                dst = chunk.array.view(_NUMPY[src.dtype]).reshape(s1 - s0, rows, -1)
                torch.index_select(src[s0:s1], 1, index[r0 : r0 + rows],
                                   out=torch.from_numpy(dst))
                self._records(runs, group, counts, (j0, j), (s0, s1), rows, chunk, out,
                              yielder)

    def _records(  # noqa: PLR0917 - private helper of _gathered
        self,
        runs: _Runs,
        group: Group,
        counts: list[int],
        run_range: tuple[int, int],
        seg_range: tuple[int, int],
        rows: int,
        chunk: Chunk,
        out: Emitted,
        yielder: Yielder,
    ) -> None:
        """Records of runs ``run_range`` and segments ``seg_range`` of one chunk."""
        rids, run_id = self._rids, self._run_id
        rb = group.row_nbytes
        s0, s1 = seg_range
        seg_bytes = rows * rb
        metas = [(chunk.offset + (s - s0) * seg_bytes, m.act_name, m.layer_no, m.dtype, m.dims)
                 for s, m in enumerate(group.metas[s0:s1], start=s0)]
        view = chunk.view
        append = out.records.append
        at = 0
        for j in range(*run_range):
            n = counts[j]
            if not n:
                continue
            rid, a, sq = rids[runs.slot[j]], runs.start[j], runs.seq[j]
            nbytes = n * rb
            row_off = at * rb
            for seg_off, act, layer, dtype, dims in metas:
                p = seg_off + row_off
                append(CaptureRecord(run_id, rid, act, layer, 0, a, a + n, dtype, (n, *dims),
                                     view[p : p + nbytes], sq))
            at += n
            yielder.tick(len(metas))
        out.rows += at * len(metas)
        out.bytes += at * rb * len(metas)
