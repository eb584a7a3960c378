"""The drain thread: sealed steps -> host staging -> records -> the sink.

Per sealed item (a step, or one piece of a piecewise step), in commit order:

1. wait for the item's marker and copy its ring region to the same offsets of pinned
   staging with ONE device-to-host copy, on the drain's own stream;
2. decode steps join the :class:`~._window.DecodeWindow`; anything else first flushes the
   window (rows of a request stay in position order), then becomes records directly;
3. release the region (the ring frees in order), then hand the records to the sink.

A failure anywhere is reported once (sticky, see the transport) and ends the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from dmi_sglang.adapters.transport._device import DeviceOps, Marker
from dmi_sglang.adapters.transport._program import Bytes2D, Program, host_rows
from dmi_sglang.adapters.transport._window import DecodeWindow
from dmi_sglang.domain.layout import ForwardKind
from dmi_sglang.domain.plan import CommitPlan
from dmi_sglang.domain.ports import RecordSink
from dmi_sglang.domain.records import CaptureRecord

__all__ = ["Drain", "DrainItem", "build_records", "decode_requests"]

log = structlog.get_logger("dmi_sglang.transport.drain")


class DrainItem:
    """One ring region to drain: a whole step, or one piece of a piecewise step."""

    __slots__ = ("base", "discard", "marker", "nbytes", "plan", "program", "seq")

    def __init__(
        self,
        seq: int,
        plan: CommitPlan,
        program: Program,
        base: int,
        marker: Marker,
        *,
        discard: bool = False,
    ) -> None:
        self.seq = seq
        self.plan = plan
        self.program = program
        self.base = base
        self.nbytes = program.reserve_bytes
        self.marker = marker
        self.discard = discard


def decode_requests(plan: CommitPlan, program: Program) -> list[tuple[str, int]] | None:
    """``(request, position)`` of row ``i`` of every segment, for a plain decode step."""
    lay = plan.layout
    if lay.kind is not ForwardKind.DECODE:
        return None
    out = []
    for i, r in enumerate(lay.requests):
        if r.count != 1 or not r.emits_token or r.row_offset != i:
            return None
        out.append((r.request_id, r.start))
    if any(g.kept_rows != len(out) for g in program.groups):
        return None
    return out


def build_records(
    run_id: str, item: DrainItem, staging: Bytes2D
) -> list[CaptureRecord]:
    """Records of one drained item, one per segment and request slice."""
    records: list[CaptureRecord] = []
    segments = item.plan.segments
    for group in item.program.groups:
        rows = host_rows(staging, item.base, group)
        slices = segments[group.positions[0]].slices
        for s, meta in enumerate(group.metas):
            seg_rows = rows[s]
            for sl in slices:
                payload = seg_rows[sl.row_offset : sl.row_offset + sl.rows].tobytes()
                records.append(
                    CaptureRecord(
                        run_id, sl.request_id, meta.act_name, meta.layer_no, 0, sl.start,
                        sl.end, meta.dtype, (sl.rows, *meta.dims), payload, seq=item.seq,
                    )
                )
    return records


_STOP = object()


class Drain:
    """The drain thread of one transport (see the module docstring)."""

    def __init__(
        self,
        *,
        ops: DeviceOps,
        ring: torch.Tensor,
        staging: torch.Tensor,
        release: Callable[[], None],
        sink: RecordSink,
        run_id: str,
        window: DecodeWindow | None,
        on_failure: Callable[[BaseException, str], None],
    ) -> None:
        self._ops = ops
        self._ring = ring
        self._staging = staging
        self._staging_np: Bytes2D = staging.numpy()
        self._release = release
        self._sink = sink
        self._run_id = run_id
        self._window = window
        self._on_failure = on_failure
        self._queue: queue.SimpleQueue[DrainItem | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dmi-capture-drain", daemon=True)
        self.rows = 0
        self.bytes = 0
        self.records = 0
        self.d2h_bytes = 0
        self.d2h_seconds = 0.0

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def put(self, item: DrainItem) -> None:
        """Hand a sealed item to the drain (never blocks)."""
        self._queue.put(item)

    def close(self) -> None:
        """Drain everything queued, flush the window, and end the thread."""
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                item = self._next()
                if item is _STOP:
                    self._emit(self._window.flush() if self._window else [])
                    return
                assert isinstance(item, DrainItem)
                self._process(item)
        except BaseException as exc:  # reported to the transport, raised at stop
            self._on_failure(exc, "drain")

    def _next(self) -> object:
        while True:
            timeout = self._window.seconds_left() if self._window else None
            try:
                return self._queue.get(timeout=timeout)
            except queue.Empty:
                assert self._window is not None
                self._emit(self._window.flush())

    def _process(self, item: DrainItem) -> None:
        lo, hi = item.base, item.base + item.nbytes
        t0 = time.perf_counter()
        self._ops.to_host(item.marker, self._staging[lo:hi], self._ring[lo:hi])
        self.d2h_seconds += time.perf_counter() - t0
        self.d2h_bytes += item.nbytes
        if item.discard:
            self._release()
            return
        window = self._window
        requests = decode_requests(item.plan, item.program) if window is not None else None
        if window is not None and requests is not None:
            if not window.can_take(item.program, len(requests)):
                self._emit(window.flush())
            window.append(item.seq, item.program, self._staging_np, item.base, requests)
            self._release()
            if window.due():
                self._emit(window.flush())
            return
        if window is not None:
            self._emit(window.flush())
        records = build_records(self._run_id, item, self._staging_np)
        self._release()
        self._emit(records)

    def _emit(self, records: Sequence[CaptureRecord]) -> None:
        if not records:
            return
        self._sink.put(records)
        self.records += len(records)
        self.rows += sum(r.end_token_idx - r.start_token_idx for r in records)
        self.bytes += sum(len(r.payload) for r in records)
