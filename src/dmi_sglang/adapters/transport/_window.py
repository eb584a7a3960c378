"""Coalescing of decode rows: one record per (request, hook, layer) and run of steps.

A decode step gives every request one row per capture. Stored one record per token and
layer, a generation of 128 tokens over 28 layers is 3,584 records per hook and request,
and building them costs the drain (and the GIL) more than the bytes do. The window keeps
consecutive decode steps in host arrays (one bulk copy per segment group and step) and
emits, when it is flushed, one record per request, capture and *run*: rows of consecutive
positions. A position that does not follow the previous one (a retracted and recomputed
request) starts a new run, so rows stay in position order and ranges stay exact.

Flushed when full (bytes), when its oldest step is older than the flush timeout, before
any step that is not a plain decode step, and on stop.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np

from dmi_sglang.adapters.transport._program import Bytes2D, Group, Program, host_rows
from dmi_sglang.domain.records import CaptureRecord

__all__ = ["DecodeWindow", "Yielder"]


class Yielder:
    """Hands the GIL to other threads every few records or megabytes of payload.

    Building records holds the GIL (``tobytes`` copies under it). In a long burst the
    scheduler thread, at each of its own GIL releases (every torch call), would wait up
    to the interpreter's switch interval (5 ms) to get it back; a voluntary release every
    ~0.5 ms of work bounds that wait.
    """

    __slots__ = ("_bytes", "_records")

    RECORDS = 256
    BYTES = 2 << 20

    def __init__(self) -> None:
        self._records = 0
        self._bytes = 0

    def tick(self, nbytes: int) -> None:
        """One record of ``nbytes`` payload bytes was built."""
        self._records += 1
        self._bytes += nbytes
        if self._records >= self.RECORDS or self._bytes >= self.BYTES:
            self._records = 0
            self._bytes = 0
            time.sleep(0)


class _Run:
    """Consecutive positions of one request inside the window."""

    __slots__ = ("next", "rows", "seq", "start")

    def __init__(self, start: int, seq: int, row: int) -> None:
        self.start = start
        self.next = start + 1
        self.seq = seq
        self.rows = [row]


class DecodeWindow:
    """Decode rows waiting to be coalesced into records.

    Args:
        run_id: stored as ``model_id``.
        max_bytes: bound on the rows held (one step is always accepted).
        timeout_s: longest time a row waits (``DMX_DRAIN_FLUSH_TIMEOUT_US``).
    """

    def __init__(self, run_id: str, max_bytes: int, timeout_s: float) -> None:
        self._run_id = run_id
        self._max_bytes = max_bytes
        self._timeout = timeout_s
        self._key: Hashable = None
        self._groups: tuple[Group, ...] = ()
        self._arrays: list[Bytes2D] = []
        self._cap = 0
        self.rows = 0
        self._runs: dict[str, list[_Run]] = {}
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

    def append(
        self,
        seq: int,
        program: Program,
        staging: Bytes2D,
        base: int,
        requests: Sequence[tuple[str, int]],
    ) -> None:
        """Copy one decode step's rows out of staging (``requests[i]`` owns row ``i``)."""
        n = len(requests)
        if not self.rows:
            self._open(program, n)
        k = self.rows
        for array, group in zip(self._arrays, program.groups, strict=True):
            array[:, k : k + n, :] = host_rows(staging, base, group)
        runs = self._runs
        for i, (rid, pos) in enumerate(requests):
            mine = runs.get(rid)
            if mine is None:
                runs[rid] = [_Run(pos, seq, k + i)]
                continue
            last = mine[-1]
            if last.next == pos:
                last.rows.append(k + i)
                last.next += 1
            else:
                mine.append(_Run(pos, seq, k + i))
        self.rows = k + n

    def _open(self, program: Program, rows: int) -> None:
        cap = max(rows, self._max_bytes // max(program.host_row_bytes, 1))
        if program.host_key != self._key or cap > self._cap:
            self._arrays = [
                np.empty((g.count, cap, g.row_nbytes), dtype=np.uint8) for g in program.groups
            ]
            self._cap = cap
        self._key = program.host_key
        self._groups = program.groups
        self._opened = time.monotonic()

    def flush(self) -> list[CaptureRecord]:
        """Records of everything in the window (one per request, capture and run)."""
        if not self.rows:
            return []
        records: list[CaptureRecord] = []
        run_id = self._run_id
        yielder = Yielder()
        for array, group in zip(self._arrays, self._groups, strict=True):
            for rid, runs in self._runs.items():
                for run in runs:
                    n = len(run.rows)
                    first = run.rows[0]
                    if run.rows[-1] - first == n - 1:
                        block = array[:, first : first + n, :]
                    else:
                        block = array[:, run.rows, :]
                    for s, meta in enumerate(group.metas):
                        records.append(
                            CaptureRecord(
                                run_id, rid, meta.act_name, meta.layer_no, 0, run.start,
                                run.start + n, meta.dtype, (n, *meta.dims),
                                block[s].tobytes(), seq=run.seq,
                            )
                        )
                        yielder.tick(block.shape[1] * block.shape[2])
        self.rows = 0
        self._runs = {}
        return records
