"""The drain thread: sealed steps -> record batches -> the sink.

Per sealed item (a step, or one part of a piecewise step), in commit order:

0. a decode graph step still in its arena slot that does not join the window is copied
   to its ring region (a strided device copy per group, on the drain's own stream,
   after the step's marker);
1. plain decode steps join the :class:`~._window.DecodeWindow` on the device (a strided
   device copy per group for consecutive steps, on the drain's own stream, after the
   items' markers: from their arena slots, or from the ring);
2. *direct* items (a step that is not coalesced and whose token groups' rows lie
   contiguous in the ring: a prefill, for instance) are copied from the ring straight
   into their payload slabs (one device-to-host copy per chunk of segments, queued as
   the records are built), so their token bytes cost the host no copy; only their
   request rows (one per request, held back a step) pass through staging;
3. anything else first waits for everything before it, then its ring region is copied to
   the same offsets of pinned staging with ONE device-to-host copy and becomes record
   batches (``_records``) over pooled memory (``_pool``).

Nothing waits for the drain's stream as work is queued: what the host does once the
copies are done (free arena slots, release ring regions, hold direct items' request
rows, hand batches to the sink) goes into a *flight* behind a fence on that stream
(:meth:`Drain._launch`), and flights land in order (:meth:`Drain._land`), so the ring
frees in order and the sink gets batches in item order. A flight is launched every
:data:`_EMIT_BYTES` of batches and after each window flush, and landed one behind
(:meth:`Drain._hand_over`): the copies of one run on the copy engine while the next
records are built. Everything lands (waiting) before a finish notice, a staged item, a
window flush (held rows are read there) and when the drain has nothing else to do.

Finish notices (:class:`Finish`) travel through the same queue, so they are ordered after
every step sealed before them; they settle the request rows held back (``_records``).
A failure anywhere is reported once (sticky, see the transport) and ends the thread.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from dmi_sglang.adapters.transport._device import DeviceOps, Fence, Marker
from dmi_sglang.adapters.transport._gil import GilSlice
from dmi_sglang.adapters.transport._pool import Chunk, PayloadPool
from dmi_sglang.adapters.transport._program import Bytes2D, Group, Program
from dmi_sglang.adapters.transport._records import (
    Emitted,
    HeldRows,
    Span,
    build_records,
    hold_request_rows,
)
from dmi_sglang.adapters.transport._window import DecodeWindow
from dmi_sglang.columns import RecordSink
from dmi_sglang.domain.layout import ForwardKind
from dmi_sglang.domain.plan import CommitPlan
from dmi_sglang.domain.records import RequestManifest
from dmi_sglang.threads import OsNamedThread

__all__ = ["Drain", "DrainItem", "Finish", "coalescable", "direct_slab_bytes"]

log = structlog.get_logger("dmi_sglang.transport.drain")


class DrainItem:
    """One ring region to drain: a whole step, or one piece of a piecewise step.

    ``slot`` >= 0: a decode graph step whose rows are still in that arena slot; the
    drain copies them to the ring region first (``from_slot``) and frees the slot.
    """

    __slots__ = ("base", "discard", "marker", "nbytes", "plan", "program", "seq", "slot")

    def __init__(
        self,
        seq: int,
        plan: CommitPlan,
        program: Program,
        base: int,
        marker: Marker,
        *,
        discard: bool = False,
        slot: int = -1,
    ) -> None:
        self.seq = seq
        self.slot = slot
        self.plan = plan
        self.program = program
        self.base = base
        self.nbytes = program.reserve_bytes
        self.marker = marker
        self.discard = discard


def coalescable(plan: CommitPlan, program: Program) -> bool:
    """True for a plain decode step: one row per request in every segment."""
    return _not_plain(plan, program) is None


def _not_plain(plan: CommitPlan, program: Program) -> str | None:
    """Why a step is not a plain decode step (:data:`OUTSIDE_WINDOW`'s reasons), or None."""
    lay = plan.layout
    if lay.kind is not ForwardKind.DECODE or not lay.is_uniform_decode:
        return "not_decode"
    n = len(lay.request_ids)
    return None if all(g.kept_rows == n for g in program.groups) else "rows"


OUTSIDE_WINDOW = ("not_decode", "rows", "too_large", "discarded", "no_window")
"""Why the drain built an item outside the decode window: not a uniform decode step
(a prefill, a mixed or eager batch), a decode step some group of which keeps other than
one row per request, a step larger than the window, an item whose rows are discarded,
coalescing off."""


def in_slot_to_window(item: DrainItem) -> bool:
    """True for a decode step the window takes straight from its arena slot (no group
    gathers rows: those are copied to the ring first)."""
    return item.slot >= 0 and all(g.gather is None for g in item.program.groups)


def _follows(prev: DrainItem, item: DrainItem) -> bool:
    """``item``'s rows lie right after ``prev``'s: in the next arena slot for steps the
    window takes from their slots, else in the next ring region."""
    if in_slot_to_window(prev) or in_slot_to_window(item):
        return in_slot_to_window(prev) and in_slot_to_window(item) and item.slot == prev.slot + 1
    return item.base == prev.base + prev.nbytes


def _window_run(batch: list[DrainItem | Finish], start: int, window_items: set[int],
                room: int) -> list[DrainItem]:
    """The items from ``batch[start]`` on that join the window with one copy per group:
    at most ``room``, consecutive decode steps of the same program and requests whose
    rows follow each other (:func:`_follows`)."""
    first = batch[start]
    assert isinstance(first, DrainItem)
    run = [first]
    rids = first.plan.layout.request_ids
    for item in batch[start + 1 :]:
        prev = run[-1]
        if (len(run) >= room or not isinstance(item, DrainItem) or id(item) not in window_items
                or item.program is not first.program or not _follows(prev, item)
                or item.plan.layout.request_ids != rids):
            break
        run.append(item)
    return run


class _Flight:
    """Work queued on the drain's stream (behind ``fence``) and what the host does once
    it is done: free ``slots``, apply ``steps`` (see ``Drain._steps``), hand ``out`` to
    the sink."""

    __slots__ = ("fence", "out", "slots", "steps")

    def __init__(self, fence: Fence, out: Emitted, steps: list[int | DrainItem],
                 slots: list[int]) -> None:
        self.fence = fence
        self.out = out
        self.steps = steps
        self.slots = slots


class Finish:
    """A finish notice: where a request's stored request rows end (None: keep all), and
    the request's committed manifest when it finished cleanly (None: no commit)."""

    __slots__ = ("logits_end", "manifest", "request_id")

    def __init__(self, request_id: str, logits_end: int | None,
                 manifest: RequestManifest | None = None) -> None:
        self.request_id = request_id
        self.logits_end = logits_end
        self.manifest = manifest


_STOP = object()
_BATCH = 1024
"""Most items drained per wake-up (each wake-up costs GIL hand-overs; see docs)."""
_EMIT_BYTES = 64 << 20
"""Payload bytes after which a batch hands its records to the sink before going on."""
DIRECT_MIN_SLABS = 8
"""Page-locked slabs reserved at startup at the least (see ``direct_bytes``)."""
DIRECT_SLAB_MAX = 128 << 20
"""Largest slab of the direct items' pool (see :func:`direct_slab_bytes`)."""


def direct_slab_bytes(direct_bytes: int) -> int:
    """The slab of the direct items' pool for a largest direct item of ``direct_bytes``:
    the largest power of two (torch rounds page-locked blocks up to one: any other size
    would pin more than it uses) of which :data:`DIRECT_MIN_SLABS` fit the 1.25 x
    ``direct_bytes`` the pool reserves, between the pool's default and
    :data:`DIRECT_SLAB_MAX`. Each slab's worth of a group is one device copy and one
    batch, so a large prefill moves in fewer of both (each costs the drain's Python
    about a quarter of a millisecond)."""
    slab = PayloadPool.SLAB_BYTES
    while slab < DIRECT_SLAB_MAX and DIRECT_MIN_SLABS * 2 * slab <= direct_bytes * 5 // 4:
        slab *= 2
    return slab


class Drain:
    """The drain thread of one transport (see the module docstring).

    Args:
        window_bytes: bound of the decode coalescing window; None: no coalescing.
        flush_timeout_s: longest time a decode row waits in the window.
        linger_s: shortest time between two wake-ups for decode steps that join the
            window (see ``TransportOptions.linger_s``); :meth:`hurry` ends a wait.
        direct_bytes: the largest direct item expected (the largest prefill's token
            rows, at most the ring): that much page-locked payload memory is reserved at
            startup and kept for reuse, because page-locked allocation synchronises the
            device (a first long prefill would otherwise stall serving). More is allocated
            while the sink holds more payloads (torch caches it once allocated).
        direct_copies: copy direct items from the ring into payload memory (see the
            module docstring); False: every item through staging.
        gil_slice_s: longest stretch of the thread's Python between two hand-overs of
            the GIL (see ``_gil``); 0: only when it waits.
        from_slot: queues the device copies of a step's rows (its program) from an arena
            slot to its ring region (its base) on the current stream.
        free_slot: the arena slot may be written again (its copies completed).
        arena / arena_slot_bytes: the decode-graph arena and the distance between its
            slots (the window copies steps still in their slots from there).
        on_committed: told (on this thread) the manifests each ``commit_requests`` of
            the sink took, once it returned.
    """

    def __init__(
        self,
        *,
        ops: DeviceOps,
        ring: torch.Tensor,
        staging: torch.Tensor,
        release: Callable[[], None],
        sink: RecordSink,
        run_id: str,
        window_bytes: int | None,
        flush_timeout_s: float,
        on_failure: Callable[[BaseException, str], None],
        direct_copies: bool = True,
        linger_s: float = 0.0,
        direct_bytes: int = 0,
        gil_slice_s: float = 0.0,
        from_slot: Callable[[Program, int, int], None],
        free_slot: Callable[[int], None],
        arena: torch.Tensor,
        arena_slot_bytes: int,
        on_committed: Callable[[Sequence[RequestManifest]], None] | None = None,
    ) -> None:
        self._ops = ops
        self._on_committed = on_committed
        self._from_slot = from_slot
        self._free_slot = free_slot
        self.gil = GilSlice(gil_slice_s)
        self._linger_s = linger_s
        self._hurry = threading.Event()
        self._round_end = 0.0
        self.lingers = 0
        self._direct_copies = direct_copies
        self._ring = ring
        self._staging = staging
        self._staging_np: Bytes2D = staging.numpy()
        self._release = release
        self._sink = sink
        self._run_id = run_id
        self.pool = PayloadPool(max_free_slabs=8)
        """Slabs of staged steps and of compacted decode windows."""
        slab = direct_slab_bytes(direct_bytes)
        slabs = max(DIRECT_MIN_SLABS, -(-direct_bytes * 5 // 4 // slab))
        self.direct_pool = PayloadPool(slab_bytes=slab, max_free_slabs=slabs,
                                       buffer=ops.host_buffer)
        """Page-locked slabs that direct items are copied into (reserved at startup)."""
        if direct_copies:
            self.direct_pool.reserve(slabs)
        self.held = HeldRows()
        self._window = (
            DecodeWindow(run_id, window_bytes, flush_timeout_s, ops=ops, ring=ring,
                         arena=arena, arena_slot_bytes=arena_slot_bytes,
                         held=self.held, gil=self.gil)
            if window_bytes is not None else None
        )
        self._steps: list[int | DrainItem] = []
        """What the next flight does once the drain's stream passed its fence, in item
        order: an int releases that many ring regions (decode steps queued into the
        window, discarded items); a direct item releases its region and holds its
        request rows."""
        self._unfreed_slots: list[int] = []
        """Arena slots the drain stream's queued copies read (freed as the next flight
        lands)."""
        self._flights: collections.deque[_Flight] = collections.deque()
        """Work in flight on the drain's stream and what follows it on the host, oldest
        first (see :meth:`_launch`)."""
        self._on_failure = on_failure
        self._queue: queue.SimpleQueue[DrainItem | Finish | object] = queue.SimpleQueue()
        self._commits: list[RequestManifest] = []
        """Manifests of finished requests not committed yet (:meth:`_commit_finished`)."""
        self.committed_requests = 0
        self._thread = OsNamedThread(target=self._run, name="dmi-capture-drain", daemon=True)
        self.rows = self.bytes = self.records = self.batches = self.discarded = 0
        self.d2h_bytes = 0
        self.d2h_seconds = 0.0
        # of d2h_seconds: queueing the copies, then waiting for them (_queue_to_host,
        # _wait_for)
        self.d2h_call_seconds = self.d2h_wait_seconds = 0.0
        self.direct_items = 0
        # the items built outside the decode window, by why (OUTSIDE_WINDOW)
        self.outside_window = dict.fromkeys(OUTSIDE_WINDOW, 0)
        self.staged_copied_bytes = self.loose_copied_bytes = 0
        self.build_cpu_seconds = 0.0
        # of build_cpu_seconds: appending steps to the decode window, and flushing it
        # (its records, and queueing its copies)
        self.window_append_cpu_seconds = self.window_flush_cpu_seconds = 0.0
        self.sink_seconds = 0.0
        self.slot_items = self.slot_rounds = 0
        self.slot_seconds = 0.0

    @property
    def device_bytes(self) -> int:
        """Device memory of the decode window (0 without coalescing)."""
        return self._window.device_bytes if self._window is not None else 0

    @property
    def host_copied_bytes(self) -> int:
        """Payload bytes the host's CPU copied between the device and the sink: staged
        items (staging to payload memory), held request rows of staged items, rows held
        past the next flush, and released rows that are not back to back. Decode windows
        (their held rows included) and direct items arrive by DMA: none."""
        return self.staged_copied_bytes + self.held.copied + self.loose_copied_bytes

    @property
    def window_bytes(self) -> int:
        """Bytes the decode windows' flushes copied to the host so far."""
        return self._window.gathered_bytes if self._window is not None else 0

    @property
    def window_appends(self) -> int:
        """Appends to the decode window so far (one device copy per group each)."""
        return self._window.appends if self._window is not None else 0

    @property
    def window_flushes(self) -> int:
        """Decode windows flushed so far."""
        return self._window.flushes if self._window is not None else 0

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def put(self, item: DrainItem) -> None:
        """Hand a sealed item to the drain (never blocks)."""
        self._queue.put(item)

    def finish(self, request_id: str, logits_end: int | None,
               manifest: RequestManifest | None = None) -> None:
        """Queue a finish notice, ordered after every item handed over so far; with a
        manifest, the sink commits the request once its last rows were handed over."""
        self._queue.put(Finish(request_id, logits_end, manifest))

    def hurry(self) -> None:
        """Someone waits for ring space, or half the arena slots wait for the drain, or a
        step found its slot still waiting: end the current linger now, or skip the next
        one (thread-safe; cheap when already asked)."""
        if not self._hurry.is_set():
            self._hurry.set()

    def close(self) -> None:
        """Drain everything queued, flush the window and the held rows, end the thread."""
        self._queue.put(_STOP)
        self._hurry.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            stop = False
            while not stop:
                batch: list[DrainItem | Finish] = []
                item = self._next()
                self._linger(item)
                self.gil.restart()
                while item is not None:
                    if item is _STOP:
                        stop = True
                        break
                    assert isinstance(item, (DrainItem, Finish))
                    batch.append(item)
                    item = self._more(len(batch))
                if batch:
                    self._process(batch)
                if stop:
                    t0 = time.thread_time()
                    out = self._settle(Emitted())
                    if self._window is not None:
                        self._timed_flush(out, final=True)
                        out = self._settle(out)
                    self.held.release_all(out)
                    self._launch(out)
                    self._land(0)
                    self.build_cpu_seconds += time.thread_time() - t0
                self._round_end = time.monotonic()
        except BaseException as exc:  # reported to the transport, raised at stop
            self._on_failure(exc, "drain")

    def _linger(self, item: object) -> None:
        """Before a round that starts with a decode step for the window or a decode graph
        step in its arena slot, let the steps that follow it arrive (until ``linger_s``
        after the previous round, or a :meth:`hurry`), so they are moved together."""
        if (not self._linger_s or not isinstance(item, DrainItem) or not self._queue.empty()
                or self._flights or not (item.slot >= 0 or self._coalesce(item))):
            return  # (a flight in flight: the drain is busy, steps gather meanwhile)
        left = self._round_end + self._linger_s - time.monotonic()
        if self._window is not None and (due := self._window.seconds_left()) is not None:
            left = min(left, due)  # the flush timeout still bounds how long rows wait
        if left > 0 and not self._hurry.wait(left):
            self.lingers += 1  # waited the whole linger (a hurry ends it early)
        self._hurry.clear()

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
                self.gil.restart()  # the wait released the GIL
                t0 = time.thread_time()
                self._settle(self._flush_window(Emitted()))
                self.build_cpu_seconds += time.thread_time() - t0

    def _coalesce(self, item: DrainItem) -> bool:
        """True for an item that joins the decode window."""
        return self._outside(item) is None

    def _outside(self, item: DrainItem) -> str | None:
        """Why ``item`` does not join the decode window (:data:`OUTSIDE_WINDOW`), or
        None when it does."""
        if self._window is None:
            return "no_window"
        if item.discard:
            return "discarded"
        why = _not_plain(item.plan, item.program)
        if why is None and not self._window.fits(item.program, item.plan.layout):
            return "too_large"
        return why

    def _process(self, batch: list[DrainItem | Finish]) -> None:
        """Queue the batch's decode steps into the window, copy the other items to
        staging (direct items copy their own rows) and build their batches.

        A timed-out decode window is flushed only when nothing else waits for the drain:
        behind a backlog its rows wait for the drain anyway, and flushing every step or
        two would multiply the records (one per request and capture each flush).

        What it builds goes out in flights; the last one lands before it returns, or,
        with more queued, one behind."""
        items = [it for it in batch if isinstance(it, DrainItem)]
        window_items: set[int] = set()
        for it in items:
            why = self._outside(it)
            if why is None:
                window_items.add(id(it))
            else:
                self.outside_window[why] += 1
        self._out_of_slots(items, window_items)
        direct = {id(it) for it in items if id(it) not in window_items and self._direct(it)}
        out = Emitted()
        self._to_staging([it for it in items if id(it) not in window_items
                          and id(it) not in direct])
        t0 = time.thread_time()
        window = self._window
        n = 0
        while n < len(batch):
            self.gil.check()
            item = batch[n]
            if isinstance(item, Finish):
                out = self._settle(out)  # the request's held rows, in item order
                self._finish(item, out)
                n += 1
                continue
            if id(item) in window_items:
                n, out = self._to_window(batch, n, window_items, out)
                continue
            n += 1
            if window is not None and window.rows:
                out = self._flush_window(out)
            if item.discard:
                self._release_later(1)
                continue
            if id(item) in direct:
                self._build_direct(item, out)  # released once its copies are waited for
            else:
                out = self._settle(out)  # request rows held, regions released in order
                before = out.bytes
                build_records(self._run_id, item.plan, item.program, self._staging_np,
                              item.base, seq=item.seq, pool=self.pool, held=self.held,
                              out=out)
                self.staged_copied_bytes += out.bytes - before
                self._release()
            if out.bytes >= _EMIT_BYTES:
                out = self._hand_over(out)
        # more to drain: the last flight's copies run while the next wake-up builds;
        # else all lands now (the scheduler may wait for its ring space: no flight may
        # stay in flight while the drain waits for items)
        self._launch(out)
        self._land(1 if not self._queue.empty() else 0)
        self.build_cpu_seconds += time.thread_time() - t0

    def _to_window(self, batch: list[DrainItem | Finish], n: int, window_items: set[int],
                   out: Emitted) -> tuple[int, Emitted]:
        """Queue the run of window items that starts at ``batch[n]`` into the window
        (flushing it first when they do not fit, and after when it is full or due);
        the index after the run, and what is left to emit."""
        window, item = self._window, batch[n]
        assert window is not None
        assert isinstance(item, DrainItem)
        if not window.can_take(item.program, item.plan.layout):
            out = self._flush_window(out)
        run = _window_run(batch, n, window_items, window.room(item.program, item.plan.layout))
        from_slots = in_slot_to_window(item)
        cpu = time.thread_time()
        window.append([it.seq for it in run], item.program, item.base,
                      [it.plan.layout for it in run], [it.marker for it in run],
                      arena_slot=item.slot if from_slots else -1)
        self.window_append_cpu_seconds += time.thread_time() - cpu
        if from_slots:
            self._unfreed_slots += [it.slot for it in run]
        self._release_later(len(run))
        n += len(run)
        if window.full or (window.due() and n == len(batch) and self._queue.empty()):
            out = self._flush_window(out)
        return n, out

    def _out_of_slots(self, items: list[DrainItem], window_items: set[int]) -> None:
        """Queue the copies of the rows of the items still in arena slots that the window
        does not take from there to their ring regions; the items then go on as any
        other (their copies precede the drain stream's later work, so their markers are
        done with), and their slots are freed after the next wait for that stream."""
        slotted = [it for it in items if it.slot >= 0]
        if slotted:
            self.slot_items += len(slotted)
            self.slot_rounds += 1
        slotted = [it for it in slotted
                   if id(it) not in window_items or not in_slot_to_window(it)]
        if not slotted:
            return
        from_slot = self._from_slot
        moves = [(it.program, it.base, it.slot) for it in slotted]  # as they are now

        def copies() -> None:
            for program, base, slot in moves:
                from_slot(program, base, slot)

        t0 = time.perf_counter()
        self._ops.on_drain_stream([it.marker for it in slotted], copies)
        self.slot_seconds += time.perf_counter() - t0
        for it in slotted:
            self._unfreed_slots.append(it.slot)
            it.slot = -1
            it.marker = None

    def _finish(self, notice: Finish, out: Emitted) -> None:
        """Apply a finish notice: to the window when rows of the request wait there (at
        its flush), else to the held rows now; its manifest waits for the next emit."""
        window = self._window
        if window is not None and window.has(notice.request_id):
            window.finish(notice.request_id, notice.logits_end)
        else:
            self.held.finish(notice.request_id, notice.logits_end, out)
        if notice.manifest is not None:
            self._commits.append(notice.manifest)

    def _release_later(self, regions: int) -> None:
        """Release the next ``regions`` ring regions with the next flight (the ring
        frees in order)."""
        if self._steps and isinstance(self._steps[-1], int):
            self._steps[-1] += regions
        else:
            self._steps.append(regions)

    def _to_staging(self, items: list[DrainItem]) -> None:
        """Queue the copies of the items' ring regions to staging, one per contiguous
        span (each staged item waits for them: :meth:`_process` lands everything before
        building it)."""
        start = 0
        for i in range(1, len(items) + 1):
            if i == len(items) or items[i].base != items[i - 1].base + items[i - 1].nbytes:
                lo, hi = items[start].base, items[i - 1].base + items[i - 1].nbytes
                self._queue_to_host([it.marker for it in items[start:i]],
                                    [(self._staging[lo:hi], self._ring[lo:hi])])
                start = i

    def _queue_to_host(self, markers: list[Marker],
                       pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue device-to-host copies (:meth:`DeviceOps.queue_to_host`), counted in
        ``d2h_bytes``, ``d2h_seconds``, its queueing part and (the waits to keep at most
        ``copies_ahead`` pieces queued) its waiting part."""
        t0, waited = time.perf_counter(), self._ops.ahead_wait_seconds
        self.d2h_call_seconds += self._ops.queue_to_host(markers, pairs)
        self.d2h_seconds += time.perf_counter() - t0
        self.d2h_wait_seconds += self._ops.ahead_wait_seconds - waited  # DMX_DRAIN_COPY_AHEAD
        self.d2h_bytes += sum(dst.numel() for dst, _ in pairs)

    def _wait_for(self, fence: Fence) -> None:
        """Wait for the drain's stream to pass ``fence``, counted in ``d2h_seconds`` and
        its waiting part (not as build time)."""
        cpu, t0 = time.thread_time(), time.perf_counter()
        self._ops.wait(fence)
        waited = time.perf_counter() - t0
        self.d2h_seconds += waited
        self.d2h_wait_seconds += waited
        self.build_cpu_seconds -= time.thread_time() - cpu

    def _direct(self, item: DrainItem) -> bool:
        """True for an item copied from the ring straight into payload memory."""
        return self._direct_copies and item.program.direct and not item.discard

    def _build_direct(self, item: DrainItem, out: Emitted) -> None:
        """Records of a direct item: token chunks are allocated and sliced into records
        first, then filled by device-to-host copies queued on the drain's stream as they
        add up (every :data:`_EMIT_BYTES`, so the first run while the rest is built),
        which also bring the request rows' groups to staging. Not waited for here: the
        item's region is released and its request rows held by the flight that carries
        it (:meth:`_land`), and no batch reaches the sink before that flight's wait."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        markers: list[Marker] = [item.marker]  # waited for by the first copies only
        pending = 0

        def queue() -> None:
            nonlocal pairs, markers, pending
            self._queue_to_host(markers, pairs)
            pairs, markers, pending = [], [], 0

        def fill(group: Group, span: Span, chunk: Chunk) -> None:
            nonlocal pending
            assert group.dense  # a direct item's kept rows: one span of the ring
            rb = group.row_nbytes
            a = item.base + group.ring_offset + (span.s0 * group.kept_rows + span.r0) * rb
            n = (span.s1 - span.s0) * (span.r1 - span.r0)  # whole segments, or rows of one
            pairs.append((chunk.tensor, self._ring[a : a + n * rb]))
            pending += n * rb
            if pending >= _EMIT_BYTES:
                queue()

        build_records(self._run_id, item.plan, item.program, self._staging_np, item.base,
                      seq=item.seq, pool=self.direct_pool, held=self.held, out=out, fill=fill,
                      request_rows=False)
        for g in item.program.groups:
            if g.request_rows:
                a = item.base + g.ring_offset
                b = a + (g.count - 1) * g.ring_stride + g.ring_rows * g.row_nbytes
                pairs.append((self._staging[a:b], self._ring[a:b]))
        if pairs or markers:
            queue()
        self._steps.append(item)
        self.direct_items += 1

    def _flush_window(self, out: Emitted) -> Emitted:
        """Flush the window into a flight of its own (:meth:`_hand_over`): its copies
        run while the drain goes on. Everything before it lands first: the request rows
        held by earlier items, and the rows the previous flush left held, are read by
        this one."""
        out = self._settle(out)
        self._timed_flush(out)
        return self._hand_over(out)

    def _timed_flush(self, out: Emitted, *, final: bool = False) -> None:
        """Flush the decode window into ``out``, its CPU time counted."""
        assert self._window is not None
        cpu = time.thread_time()
        self._window.flush(out, final=final)
        self.window_flush_cpu_seconds += time.thread_time() - cpu

    def _launch(self, out: Emitted) -> Emitted:
        """Put ``out``, the steps and the arena slots so far in flight: behind a fence
        after everything queued on the drain's stream so far, landed in order by
        :meth:`_land`. Returns a fresh :class:`Emitted` for what comes next."""
        self._flights.append(_Flight(self._ops.fence(), out, self._steps,
                                     self._unfreed_slots))
        self._steps, self._unfreed_slots = [], []
        return Emitted()

    def _land(self, keep: int) -> None:
        """Land flights oldest first: those whose fence was passed, and, waiting for
        them, more until at most ``keep`` are left. Landing frees the flight's arena
        slots, releases its ring regions and holds its direct items' request rows in
        item order, then hands its batches to the sink."""
        flights = self._flights
        while flights and (len(flights) > keep or self._ops.done(flights[0].fence)):
            flight = flights.popleft()
            self._wait_for(flight.fence)
            free = self._free_slot
            for slot in flight.slots:
                free(slot)
            out = flight.out
            for step in flight.steps:
                self._release()
                if isinstance(step, int):
                    for _ in range(step - 1):
                        self._release()
                    continue
                requests = [g for g in step.program.groups if g.request_rows]
                if requests:
                    hold_request_rows(self._run_id, step.seq, step.plan, requests,
                                      self._staging_np, step.base, self.held, out)
            cpu = time.thread_time()
            self._emit(out)
            self.build_cpu_seconds -= time.thread_time() - cpu  # sink time is not build time

    def _settle(self, out: Emitted) -> Emitted:
        """Land everything queued so far (waiting for it), ``out`` last; returns what to
        build into next (``out`` itself when nothing was queued)."""
        if not (self._flights or self._steps or self._unfreed_slots or self._ops.unfenced):
            return out
        out = self._launch(out)
        self._land(0)
        return out

    def _hand_over(self, out: Emitted) -> Emitted:
        """Put ``out`` in flight and land the flights before it, waiting for those but
        not for it: its copies run while the next records are built."""
        out = self._launch(out)
        self._land(1)
        return out

    def _emit(self, out: Emitted) -> None:
        """Hand ``out`` to the sink, then the manifests it completes (called only as a
        flight lands: see :meth:`_commit_finished`)."""
        self.discarded += out.discarded
        if out.discarded:
            log.debug("request rows discarded", rows=out.discarded, total=self.discarded)
        batches = out.batches_out()
        if batches:
            t0 = time.perf_counter()
            for batch in batches:
                self.gil.check()
                self._sink.put(batch)
            self.sink_seconds += time.perf_counter() - t0
            self.batches += len(batches)
            self.loose_copied_bytes += out.copied
            self.records += out.records
            self.rows += out.rows
            self.bytes += out.bytes
        if self._commits:
            self._commit_finished()

    def _commit_finished(self) -> None:
        """Hand the sink the manifests of finished requests whose rows all went to it.
        Called as a flight lands, after its batches: a finish notice lands every flight
        before it, so the rows it released ride in the first flight to land after it;
        rows waiting in the decode window ride in the flight of the flush that takes
        them, likewise the first to land after it (a flush lands everything first). So a
        manifest waits only for its request to have left the window."""
        window = self._window
        ready: list[RequestManifest] = []
        waiting: list[RequestManifest] = []
        for m in self._commits:
            (waiting if window is not None and window.has(m.request_id) else ready).append(m)
        if ready:
            self._commits = waiting
            self._sink.commit_requests(ready)
            self.committed_requests += len(ready)
            if self._on_committed is not None:
                self._on_committed(ready)
