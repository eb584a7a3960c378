"""Coalescing of decode rows: one record per (request, hook, layer) and run of steps.

A decode step gives every request one row per capture. Stored one record per token and
layer, a generation of 128 tokens over 28 layers is 3,584 records per hook and request,
and building them costs the drain (and the GIL) more than the bytes do. The window keeps
consecutive decode steps in host arrays (one bulk copy per segment group and step, plus
three small columns per row: request, position, step) and emits, when it is flushed, one
record per request, capture and *run*: rows of consecutive positions. A position that
does not follow the previous one (a retracted and recomputed request) starts a new run,
so rows stay in position order and ranges stay exact.

A flush is vectorised: one stable argsort orders the rows by request (then step), run
breaks are found with array comparisons, and each group is gathered into its section of
ONE pooled buffer with one ``index_select`` (GIL released); records are read-only slices
of that buffer. Request rows (``final_logits``) follow the hold-back rule of
``_records``: each request's newest row is held until confirmed or finished.

Flushed when full (bytes), when its oldest step is older than the flush timeout, before
any step that is not a plain decode step, and on stop.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import numpy as np
import torch

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


def _wide(array: Bytes2D, row_nbytes: int) -> torch.Tensor:
    """``array`` ([segments, rows, row bytes]) as a tensor of the widest element that
    divides a row, sharing memory (for ``index_select``)."""
    elem = next(e for e in (8, 4, 2, 1) if row_nbytes % e == 0)
    return torch.from_numpy(array).view(_ELEMENT[elem])


class DecodeWindow:
    """Decode rows waiting to be coalesced into records.

    Args:
        run_id: stored as ``model_id``.
        max_bytes: bound on the rows held (one step is always accepted).
        timeout_s: longest time a row waits (``DMX_DRAIN_FLUSH_TIMEOUT_US``); a held
            request row waits for its confirmation instead.
        pool: where flushed payload buffers come from.
        held: the drain's held request rows.
    """

    def __init__(
        self,
        run_id: str,
        max_bytes: int,
        timeout_s: float,
        pool: PayloadPool | None = None,
        held: HeldRows | None = None,
    ) -> None:
        self._run_id = run_id
        self._max_bytes = max_bytes
        self._timeout = timeout_s
        self._pool = pool if pool is not None else PayloadPool()
        self._held = held if held is not None else HeldRows()
        self._key: Hashable = None
        self._groups: tuple[Group, ...] = ()
        self._arrays: list[Bytes2D] = []
        self._tensors: list[torch.Tensor] = []
        self._cap = 0
        self.rows = 0
        self._req = np.empty(0, dtype=np.int64)
        self._pos = np.empty(0, dtype=np.int64)
        self._seq = np.empty(0, dtype=np.int64)
        self._index: dict[str, int] = {}
        self._finished: dict[str, int | None] = {}
        self._last_rids: tuple[str, ...] | None = None
        self._last_req = self._req
        self._opened = 0.0

    def seconds_left(self) -> float | None:
        """Time until the window is due, or None when it is empty."""
        if not self.rows:
            return None
        return max(0.0, self._opened + self._timeout - time.monotonic())

    def due(self) -> bool:
        """True when the window must be flushed now (full or timed out)."""
        return bool(self.rows) and (
            self.rows >= self._cap or time.monotonic() >= self._opened + self._timeout
        )

    def can_take(self, program: Program, rows: int) -> bool:
        """True when a step of ``rows`` rows with this program can join the window."""
        return not self.rows or (program.host_key == self._key and self.rows + rows <= self._cap)

    def has(self, request_id: str) -> bool:
        """True when rows of ``request_id`` wait in the window."""
        return bool(self.rows) and request_id in self._index

    def finish(self, request_id: str, logits_end: int | None) -> None:
        """A finish notice for a request with rows in the window (applied at flush)."""
        self._finished[request_id] = logits_end

    def append(
        self, seq: int, program: Program, staging: Bytes2D, base: int, layout: BatchLayout
    ) -> None:
        """Copy one plain decode step's rows out of staging (request ``i`` owns row ``i``)."""
        rids = layout.request_ids
        n = len(rids)
        if not self.rows:
            self._open(program, n)
        k = self.rows
        for array, group in zip(self._arrays, program.groups, strict=True):
            array[:, k : k + n, :] = host_rows(staging, base, group)
        if rids != self._last_rids:
            index = self._index
            self._last_req = np.fromiter(
                (index.setdefault(r, len(index)) for r in rids), dtype=np.int64, count=n
            )
            self._last_rids = rids
        self._req[k : k + n] = self._last_req
        self._pos[k : k + n] = layout.starts
        self._seq[k : k + n] = seq
        self.rows = k + n

    def _open(self, program: Program, rows: int) -> None:
        cap = max(rows, self._max_bytes // max(program.host_row_bytes, 1))
        if program.host_key != self._key or cap > self._cap:
            self._arrays = [
                np.empty((g.count, cap, g.row_nbytes), dtype=np.uint8) for g in program.groups
            ]
            self._tensors = [
                _wide(a, g.row_nbytes) for a, g in zip(self._arrays, program.groups, strict=True)
            ]
            self._req = np.empty(cap, dtype=np.int64)
            self._pos = np.empty(cap, dtype=np.int64)
            self._seq = np.empty(cap, dtype=np.int64)
            self._cap = cap
        self._key = program.host_key
        self._groups = program.groups
        self._opened = time.monotonic()

    def flush(self, out: Emitted, *, final: bool = False) -> None:
        """Records of everything in the window (one per request, capture and run).

        ``final`` (the run stops): nothing is held back any more.
        """
        total = self.rows
        if not total:
            return
        req = self._req[:total]
        order = np.argsort(req, kind="stable")  # by request, then step
        rq = req[order]
        pos = self._pos[:total][order]
        breaks = np.flatnonzero((rq[1:] != rq[:-1]) | (pos[1:] != pos[:-1] + 1)) + 1
        firsts = np.concatenate(([0], breaks))
        counts = np.diff(np.append(firsts, total))
        run = _Runs(
            rids=list(self._index),
            req=rq[firsts].tolist(),
            start=pos[firsts].tolist(),
            n=counts.tolist(),
            first=firsts.tolist(),
            seq=self._seq[:total][order[firsts]].tolist(),
        )
        groups = self._groups
        token = [i for i, g in enumerate(groups) if not g.request_rows]
        request = [i for i, g in enumerate(groups) if g.request_rows]
        keep: list[int] = run.n
        kept_order = order
        if request:
            keep, kept_order = self._resolve(run, order, request, out, final=final)
        index = torch.from_numpy(order)
        kept_index = index if kept_order is order else torch.from_numpy(kept_order)
        yielder = Yielder()
        for i in token + request:
            if groups[i].request_rows:
                self._group_records(i, run, keep, kept_index, out, yielder)
            else:
                self._group_records(i, run, run.n, index, out, yielder)
        self.rows = 0
        self._index = {}
        self._finished = {}
        self._last_rids = None

    def _resolve(
        self, run: _Runs, order: np.ndarray, groups: list[int], out: Emitted, *, final: bool
    ) -> tuple[list[int], np.ndarray]:
        """Apply the hold-back rule to request rows: rows kept per run, and their window
        rows in output order. Held and discarded rows leave the window here."""
        keep: list[int] = []
        mask = np.zeros(len(order), dtype=bool)
        nruns = len(run.n)
        for j in range(nruns):
            rid = run.rids[run.req[j]]
            n, start, first = run.n[j], run.start[j], run.first[j]
            status = self._finished.get(rid, _LIVE)
            if final and status is _LIVE:
                status = None
            newest = j + 1 == nruns or run.req[j + 1] != run.req[j]
            if j == 0 or run.req[j - 1] != run.req[j]:  # the request's first run
                if status is _LIVE:
                    self._held.confirm(rid, out)
                else:
                    self._held.finish(rid, status, out)  # type: ignore[arg-type]
            if status is _LIVE:
                k = n - 1 if newest else n
                if newest:
                    self._hold(run, j, int(order[first + n - 1]), groups)
            elif status is None:
                k = n
            else:
                k = max(0, min(n, status - start))  # type: ignore[operator]
                out.discarded += (n - k) * sum(self._groups[i].count for i in groups)
            keep.append(k)
            if k:
                mask[first : first + k] = True
        return keep, order[mask]

    def _hold(self, run: _Runs, j: int, row: int, groups: list[int]) -> None:
        rid = run.rids[run.req[j]]
        pos = run.start[j] + run.n[j] - 1
        seq = int(self._seq[row])
        for i in groups:
            group, array = self._groups[i], self._arrays[i]
            for s, meta in enumerate(group.metas):
                payload = copy_row(array[s, row])
                self._held.hold(
                    CaptureRecord(
                        self._run_id, rid, meta.act_name, meta.layer_no, 0, pos, pos + 1,
                        meta.dtype, (1, *meta.dims), payload, seq,
                    )
                )

    def _group_records(  # noqa: PLR0917 - private helper of flush
        self,
        i: int,
        run: _Runs,
        counts: list[int],
        index: torch.Tensor,
        out: Emitted,
        yielder: Yielder,
    ) -> None:
        """Gather group ``i``'s rows (``index``: window rows in output order, ``counts[j]``
        of run ``j``) into pooled chunks of at most a slab, and make their records."""
        group, src = self._groups[i], self._tensors[i]
        rb, count = group.row_nbytes, group.count
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
                self._records(run, group, counts, j0, j, s0, s1, rows, chunk, out, yielder)

    def _records(  # noqa: PLR0917 - private helper of flush
        self,
        run: _Runs,
        group: Group,
        counts: list[int],
        j0: int,
        j1: int,
        s0: int,
        s1: int,
        rows: int,
        chunk: Chunk,
        out: Emitted,
        yielder: Yielder,
    ) -> None:
        """Records of runs ``[j0, j1)`` and segments ``[s0, s1)`` of one chunk."""
        run_id = self._run_id
        rb = group.row_nbytes
        seg_bytes = rows * rb
        metas = [(chunk.offset + (s - s0) * seg_bytes, m.act_name, m.layer_no, m.dtype, m.dims)
                 for s, m in enumerate(group.metas[s0:s1], start=s0)]
        view = chunk.view
        append = out.records.append
        rids, req, start, seq = run.rids, run.req, run.start, run.seq
        at = 0
        for j in range(j0, j1):
            n = counts[j]
            if not n:
                continue
            rid, a, sq = rids[req[j]], start[j], seq[j]
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


class _Runs:
    """Runs of a flush: request index, first position, rows, first output row, step."""

    __slots__ = ("first", "n", "req", "rids", "seq", "start")

    def __init__(
        self,
        *,
        rids: list[str],
        req: list[int],
        start: list[int],
        n: list[int],
        first: list[int],
        seq: list[int],
    ) -> None:
        self.rids = rids
        self.req = req
        self.start = start
        self.n = n
        self.first = first
        self.seq = seq
