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
from dmi_sglang.adapters.transport._window import DecodeWindow, Yielder
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
    if lay.kind is not ForwardKind.DECODE or not lay.is_uniform_decode:
        return None
    out = list(zip(lay.request_ids, lay.starts, strict=True))
    if any(g.kept_rows != len(out) for g in program.groups):
        return None
    return out


def build_records(
    run_id: str, item: DrainItem, staging: Bytes2D
) -> list[CaptureRecord]:
    """Records of one drained item, one per segment and request slice."""
    records: list[CaptureRecord] = []
    segments = item.plan.segments
    yielder = Yielder()
    for group in item.program.groups:
        rows = host_rows(staging, item.base, group)
        slices = item.plan.slices(segments[group.positions[0]])
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
                yielder.tick(len(payload))
    return records


_STOP = object()
_BATCH = 1024
"""Most items drained per wake-up (each wake-up costs GIL hand-overs; see docs)."""


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
            stop = False
            while not stop:
                batch: list[DrainItem] = []
                item = self._next()
                while item is not None:
                    if item is _STOP:
                        stop = True
                        break
                    assert isinstance(item, DrainItem)
                    batch.append(item)
                    item = self._more(len(batch))
                out: list[CaptureRecord] = []
                if batch:
                    self._process(batch, out)
                if stop and self._window is not None:
                    out.extend(self._window.flush())
                self._emit(out)
        except BaseException as exc:  # reported to the transport, raised at stop
            self._on_failure(exc, "drain")

    def _more(self, have: int) -> object:
        """The next queued item without waiting, or None."""
        if have >= _BATCH or self._queue.empty():
            return None
        return self._queue.get_nowait()

    def _next(self) -> object:
        while True:
            timeout = self._window.seconds_left() if self._window else None
            try:
                return self._queue.get(timeout=timeout)
            except queue.Empty:
                assert self._window is not None
                self._emit(self._window.flush())

    def _process(self, batch: list[DrainItem], out: list[CaptureRecord]) -> None:
        """Copy the batch to staging (one copy per contiguous span), then build records."""
        start = 0
        for i in range(1, len(batch) + 1):
            if i == len(batch) or batch[i].base != batch[i - 1].base + batch[i - 1].nbytes:
                lo, hi = batch[start].base, batch[i - 1].base + batch[i - 1].nbytes
                t0 = time.perf_counter()
                markers = [it.marker for it in batch[start:i]]
                self._ops.to_host(markers, self._staging[lo:hi], self._ring[lo:hi])
                self.d2h_seconds += time.perf_counter() - t0
                self.d2h_bytes += hi - lo
                start = i
        window = self._window
        for item in batch:
            if item.discard:
                self._release()
                continue
            requests = decode_requests(item.plan, item.program) if window is not None else None
            if window is not None and requests is not None:
                if not window.can_take(item.program, len(requests)):
                    out.extend(window.flush())
                window.append(item.seq, item.program, self._staging_np, item.base, requests)
                self._release()
                if window.due():
                    out.extend(window.flush())
                continue
            if window is not None:
                out.extend(window.flush())
            out.extend(build_records(self._run_id, item, self._staging_np))
            self._release()

    def _emit(self, records: Sequence[CaptureRecord]) -> None:
        if not records:
            return
        self._sink.put(records)
        self.records += len(records)
        self.rows += sum(r.end_token_idx - r.start_token_idx for r in records)
        self.bytes += sum(len(r.payload) for r in records)
