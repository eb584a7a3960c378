"""TorchCaptureTransport: the built-in capture transport behind the CaptureTransport port.

Owns a device payload ring, pinned host staging of the same size, the decode-graph
arena, the in-flight accounting (:class:`~dmi_sglang.domain.capacity.RingAllocator`) and
the drain thread. The scheduler thread drives it per forward:
``preflight`` (decode graph steps) -> ``commit`` -> capture points -> ``seal``.
See docs/transport.md for the design and the measured costs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs
import structlog
import torch

from dmi_sglang.adapters.transport import topk_flashinfer, topk_kernel
from dmi_sglang.adapters.transport._arena import Arena, CaptureKey
from dmi_sglang.adapters.transport._capturer import Capturer, Payloads
from dmi_sglang.adapters.transport._device import TORCH_DTYPES, DeviceOps
from dmi_sglang.adapters.transport._drain import Drain, DrainItem
from dmi_sglang.adapters.transport._last import LastSlots, ReadLayout
from dmi_sglang.adapters.transport._options import TransportOptions
from dmi_sglang.adapters.transport._program import Program, build_program, plan_key
from dmi_sglang.adapters.transport._steps import Mode, OpenStep, StepWriter
from dmi_sglang.adapters.transport.topk import CheckTimeoutError
from dmi_sglang.columns import RecordSink
from dmi_sglang.domain.capacity import (
    Decision,
    Preflight,
    RingAllocator,
    RingCapacity,
    RingUsage,
    arena_bytes,
    arena_slots,
    check_ring_fits,
    chunks_held,
    last_slot_requests,
    prefill_ring_bytes,
    preflight,
    ring_advice,
)
from dmi_sglang.domain.hooks import Selection, hook_by_name
from dmi_sglang.domain.plan import CommitPlan, make_read_plan
from dmi_sglang.domain.ports import TransportStats
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.records import RequestManifest
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.errors import (
    CapacityError,
    CaptureError,
    CommitError,
    UnsupportedConfigurationError,
)
from dmi_sglang.host_malloc import tune_host_malloc

__all__ = ["TorchCaptureTransport"]

log = structlog.get_logger("dmi_sglang.transport")

_FITS = Preflight(Decision.FITS, "fits the free ring space")
_NOTHING = Preflight(Decision.FITS, "captures nothing")
_PROGRAM_CACHE = 512
PART_SHARE = 4
"""A part of a piecewise step takes at most 1/``PART_SHARE`` of the ring, so the drain
moves one while the next ones are written."""
PART_MAX_BYTES = 256 << 20
"""Nor more than this: the drain starts on a part once its last capture point fired, so
with a large ring smaller parts start the copies sooner (at 256 MiB, an 8,192-token
sglang-full prefill chunk of Qwen3-0.6B is 29 parts instead of 341 capture points)."""


def _prefill_bytes(selection: Selection, shape: ModelShape, capacity: RingCapacity,
                   tokens: int) -> int:
    """Ring bytes of the longest eager forward the engine may run (``tokens`` positions);
    a warning with what helps when one does not fit the ring whole."""
    nbytes = prefill_ring_bytes(selection, shape, tokens)
    if nbytes > capacity.effective_bytes:
        advised = ring_advice(capacity, nbytes)
        helps = (f"DMX_RING_PAYLOAD_MB={advised} and DMX_RING_PINNED_MB={advised} hold "
                 f"{chunks_held(advised, nbytes)} whole (that much device memory, taken from "
                 f"the KV cache, and page-locked host memory: docs/settings.md); it helps "
                 f"only while the copies keep up with the capture (dmi-sglang plan --tok-s "
                 f"tells), else any ring fills"
                 if advised is not None
                 else "a smaller chunked_prefill_size makes them fit")
        log.warning(
            "dmi.prefill_larger_than_ring", prefill_tokens=tokens, prefill_bytes=nbytes,
            ring_bytes=capacity.effective_bytes, advised_ring_mb=advised,
            hint=f"every prefill chunk this large commits piecewise, in parts waiting for "
                 f"the drain; {helps}")
    return nbytes


def _reads_per_plan(selection: Selection, shape: ModelShape, capacity: RingCapacity) -> int:
    """How many finished requests one read of ``last`` rows takes: a quarter of the ring
    at most (1 without ``last`` captures).

    Raises:
        CapacityError: one request's ``last`` rows do not fit the ring.
    """
    if not selection.captures_kept_by(PositionRule.LAST):
        return 1
    one = make_read_plan([("-", 0)], selection, shape).total_bytes
    if one > capacity.effective_bytes:
        msg = (f"one request's rows under the last rule take {one} bytes, more than the "
               f"ring's {capacity.effective_bytes}; raise DMX_RING_PAYLOAD_MB and "
               f"DMX_RING_PINNED_MB")
        raise CapacityError(msg)
    return max(1, capacity.effective_bytes // 4 // one)


def _payloads(selection: Selection, shape: ModelShape, ops: DeviceOps, *,
              topk_chunk: int, topk_kernel: str, max_rows: int) -> Payloads | None:
    """The on-device transforms the selection's payload modifiers ask for (None: none);
    a top-k selects over chunks of ``topk_chunk`` columns (0: whole rows), or with the
    ``topk_kernel`` (``DMX_TOPK_KERNEL``) other than ``none``, checked here over 3 and
    ``max_rows`` rows (the largest decode graph batch); ``auto`` is FlashInfer's where
    that check passes, else ``none`` (logged, with why).

    Raises:
        UnsupportedConfigurationError: a ``topk_kernel`` that does not fit the top-k's
            shape or does not work on the device.
    """
    if not selection.payloads:
        return None
    casts: dict[CaptureKey, tuple[torch.dtype, torch.dtype]] = {}
    topk = 0
    for name, layer_no, payload in selection.payloads:
        key = (name, layer_no)
        topk = max(topk, payload.topk)
        stored = TORCH_DTYPES[shape.capture_row(selection, hook_by_name(name), layer_no).dtype]
        computed = TORCH_DTYPES[shape.row(hook_by_name(name),
                                          attrs.evolve(payload, dtype=None)).dtype]
        if stored != computed:
            casts[key] = (computed, stored)
    logits_dtype = TORCH_DTYPES[shape.logits_dtype]
    kernel = topk_kernel if topk else "none"
    if kernel == "auto":
        kernel = _auto_topk_kernel(ops.device, shape.vocab, topk, dtype=logits_dtype,
                                   batches=(3, max_rows))
    elif kernel != "none":
        _check_topk_kernel(kernel, ops.device, shape.vocab, topk, chunk=topk_chunk,
                           dtype=logits_dtype, batches=(3, max_rows))
    return Payloads(casts, topk, logits_dtype, ops.device, topk_chunk=topk_chunk,
                    topk_kernel=kernel)


def _auto_topk_kernel(device: torch.device, width: int, k: int, *, dtype: torch.dtype,
                      batches: tuple[int, ...]) -> str:
    """``DMX_TOPK_KERNEL=auto``: ``flashinfer`` where FlashInfer's top-k compiles and
    selects as ``torch.topk`` does over float32 logits (its start-up check), else
    ``none``, logged with why (a warning on a GPU, where it was expected to work).

    Raises:
        UnsupportedConfigurationError: the failed check left the GPU unusable (a
            kernel's fault is sticky: nothing would run after it), or its kernels did
            not finish.
    """
    seconds = 0.0
    if dtype != torch.float32:  # over bfloat16 rows it differed from torch.topk
        why: str | None = f"the logits are {dtype}; FlashInfer's top-k is used for float32"
    else:
        why, seconds = _timed_check(
            "auto", "flashinfer", k, width,
            lambda: topk_flashinfer.warm_up(device, width, k, dtype=dtype, batches=batches))
        if why is not None and device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except RuntimeError as exc:
                msg = (f"DMX_TOPK_KERNEL=auto: FlashInfer's top-k failed its check on "
                       f"{device} ({why}) and left the device unusable ({exc}); set "
                       "DMX_TOPK_KERNEL=none to select with torch.topk")
                raise UnsupportedConfigurationError((msg,)) from exc
    if why is None:
        log.info("dmi.topk_kernel", kernel="flashinfer", setting="auto",
                 check_seconds=round(seconds, 2))
        return "flashinfer"
    expected = dtype == torch.float32 and device.type == "cuda"  # where it should work
    (log.warning if expected else log.info)("dmi.topk_kernel", kernel="none",
                                            setting="auto", reason=why,
                                            check_seconds=round(seconds, 2))
    return "none"


def _timed_check(setting: str, kernel: str, k: int, width: int,
                 warm_up: Callable[[], str | None]) -> tuple[str | None, float]:
    """Run ``kernel``'s start-up check ``warm_up`` (None: it works, else why not) for
    ``DMX_TOPK_KERNEL=setting``, logged before it starts (it may compile for minutes: a
    slow start shows where it waits); what it said and the seconds it took.

    Raises:
        UnsupportedConfigurationError: its kernels did not finish: the device is not
            usable after it, so nothing is tried on it any more.
    """
    took = "minutes" if kernel == "flashinfer" else "seconds"
    log.info("dmi.topk_kernel_check", kernel=kernel, k=k, width=width,
             note=f"compiled on its first use on a machine ({took}); "
                  "DMX_TOPK_KERNEL=none skips it")
    started = time.perf_counter()
    try:
        why = warm_up()
    except CheckTimeoutError as exc:
        what = "the Triton top-k kernel" if kernel == "triton" else "FlashInfer's top-k"
        msg = (f"DMX_TOPK_KERNEL={setting}: {what} failed its start-up check ({exc}); the "
               "device is not usable after it: restart with DMX_TOPK_KERNEL=none")
        raise UnsupportedConfigurationError((msg,)) from exc
    return why, time.perf_counter() - started


def _check_topk_kernel(kernel: str, device: torch.device, width: int, k: int, *,
                       chunk: int, dtype: torch.dtype, batches: tuple[int, ...]) -> None:
    """Refuse ``DMX_TOPK_KERNEL=kernel`` where it does not fit or work (compiling it)."""
    if kernel == "triton":
        setting = (f"DMX_TOPK_KERNEL=triton (topk({k}) over {width} logits, "
                   f"DMX_TOPK_CHUNK={chunk})")
        if not topk_kernel.fits(width, k, chunk):
            why = (f"{setting}: the kernel needs {topk_kernel.NEEDS}; set "
                   "DMX_TOPK_KERNEL=none or another DMX_TOPK_CHUNK")
            raise UnsupportedConfigurationError((why,))
        failed, seconds = _timed_check(kernel, kernel, k, width, lambda: topk_kernel.warm_up(
            device, width, k, chunk, dtype=dtype, batches=batches))
    else:  # flashinfer (TransportOptions accepts no other kernel)
        setting = f"DMX_TOPK_KERNEL=flashinfer (topk({k}) over {width} logits)"
        failed, seconds = _timed_check(kernel, kernel, k, width, lambda: topk_flashinfer.warm_up(
            device, width, k, dtype=dtype, batches=batches))
    if failed is not None:
        why = (f"{setting}: the top-k kernel does not work on {device} ({failed}); "
               "set DMX_TOPK_KERNEL=none to select with torch.topk")
        raise UnsupportedConfigurationError((why,))
    log.info("dmi.topk_kernel", kernel=kernel, setting=kernel, check_seconds=round(seconds, 2))


class _SlotTurns:
    """Which arena slots hold a step the drain has not copied out yet (guarded by the
    transport's condition), the slot the next step takes, and the slot the device index
    names now."""

    __slots__ = ("busy", "count", "next", "selected")

    def __init__(self, slots: int, spare: int) -> None:
        self.busy = [False] * slots
        self.count = 0
        self.next = 0
        self.selected = spare


class TorchCaptureTransport:
    """The capture transport, in PyTorch (CUDA; CPU for tests).

    Create it before the model's weights load (its buffers are plain allocations that
    SGLang then sees as used memory). Install the capture points :attr:`capturer` wants,
    then per forward: :meth:`preflight` (decode graph steps: may say run eager),
    :meth:`commit` (before the forward), the forward, :meth:`seal` (after it returned).
    :meth:`stop` ends the run. Everything is called from the scheduler thread.

    Args:
        capacity: ring sizes (``DMX_RING_PAYLOAD_MB`` / ``_PINNED_MB`` / ``_TASK_ENTRIES``).
        selection: the resolved selection.
        shape: the model's row shapes.
        max_graph_batch: the largest decode CUDA-graph batch (arena rows).
        sink: where records go (``start_run`` is the caller's business).
        run_id: stored as every record's ``model_id``.
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        options: tuning (padding strip, flush timeout, coalescing, startup bounds).
        capture_probe: overrides "is a CUDA graph being captured now" (tests).

    Raises:
        CapacityError: the ring cannot hold one capture tensor of this configuration.
    """

    def __init__(
        self,
        *,
        capacity: RingCapacity,
        selection: Selection,
        shape: ModelShape,
        max_graph_batch: int,
        sink: RecordSink,
        run_id: str,
        device: str | torch.device = "cuda",
        options: TransportOptions | None = None,
        capture_probe: Callable[[], bool] | None = None,
    ) -> None:
        opts = options if options is not None else TransportOptions()
        if max_graph_batch <= 0 or capacity.effective_bytes % 16:
            msg = (
                f"need a positive decode batch and a ring size that is a multiple of 16 bytes, "
                f"got {max_graph_batch} / {capacity.effective_bytes}"
            )
            raise CapacityError(msg)
        check_ring_fits(
            capacity, selection, shape,
            max_token_rows=max(opts.max_prefill_tokens, max_graph_batch),
            max_request_rows=max(opts.max_requests, max_graph_batch),
        )
        prefill_bytes = _prefill_bytes(selection, shape, capacity,
                                      max(opts.max_prefill_tokens, max_graph_batch))
        reads_per_plan = _reads_per_plan(selection, shape, capacity)
        self.options = opts
        self.capacity = capacity
        self.run_id = run_id
        ops = DeviceOps(device, capture_probe, copy_piece_bytes=opts.copy_piece_bytes,
                        copies_ahead=opts.copies_ahead,
                        copy_kernel_programs=opts.copy_kernel_programs,
                        copy_gaps=opts.copy_gaps)
        self._payloads = _payloads(selection, shape, ops, topk_chunk=opts.topk_chunk,
                                   topk_kernel=opts.topk_kernel, max_rows=max_graph_batch)
        arena = Arena(selection, shape, max_graph_batch, ops, slots=arena_slots(
            arena_bytes(selection, shape, max_graph_batch=max_graph_batch),
            opts.arena_slots_bytes))
        nbytes = capacity.effective_bytes
        ring = ops.device_buffer(nbytes)
        self._ops = ops
        self._arena = arena
        self._ring = ring
        self._cond = threading.Condition()  # reentrant: guards the allocator and failure
        self._failure: tuple[BaseException, str] | None = None
        self._unusable = False
        self._stalls = 0
        self._stall_seconds = 0.0
        self._piecewise_stall_seconds = 0.0
        self._sink = sink
        self._alloc = RingAllocator(nbytes, capacity.task_entries)
        self._programs: dict[object, Program] = {}
        self._last: tuple[CommitPlan | None, Program | None] = (None, None)
        self._stopped = False
        self._forced_eager = 0
        self._piecewise = 0
        self._steps = 0
        self._tensors = 0
        self._turns = _SlotTurns(arena.slots, arena.spare)
        self._slots_missed = 0
        self._drain = Drain(
            ops=ops, ring=ring, staging=ops.host_buffer(nbytes), release=self._release,
            sink=sink, run_id=run_id,
            window_bytes=opts.coalesce_max_bytes if opts.coalesce_decode else None,
            flush_timeout_s=opts.flush_timeout_s, on_failure=self._fail,
            direct_copies=opts.direct_copies, linger_s=opts.linger_s,
            gil_slice_s=opts.gil_slice_s, from_slot=self._from_slot, free_slot=self._free_slot,
            arena=arena.buffer, arena_slot_bytes=arena.slot_bytes,
            direct_bytes=min(nbytes, prefill_bytes), on_committed=self._delivered,
        )
        self._drain.start()
        self._selection = selection
        self._shape = shape
        self._last_seq = 0
        self._fp16_overflows = 0
        self._read_programs: dict[int, tuple[Program, ReadLayout]] = {}
        self._reads_per_plan = reads_per_plan
        # every committed manifest handed over that the sink did not take yet, by request
        # id (the drain's thread removes what the sink took): those of finished requests
        # whose ``last`` reads wait among them
        self._undelivered: dict[str, RequestManifest] = {}
        self._last_slots = LastSlots(
            selection, shape,
            requests=last_slot_requests(max_requests=opts.max_requests,
                                        max_graph_batch=max_graph_batch),
            max_graph_batch=max_graph_batch, ops=ops)
        self._writer = StepWriter(ops, arena, ring, self._reserve_part, self._drain.put,
                                  last=self._last_slots, free_slot=self._free_slot,
                                  room=self._room, part_bytes=min(nbytes // PART_SHARE,
                                                 PART_MAX_BYTES),
                                  side_stream=opts.side_stream)
        self.capturer = Capturer(
            [(hook.name, layer) for hook, layer in selection.captures()], self._capture,
            payloads=self._payloads, live=self._writer.live,
            join=self._writer.side.join if self._writer.side is not None else None)
        """The object the hooked model calls (``wants`` / ``capture``)."""
        tuned = tune_host_malloc() if opts.tune_host_malloc else False
        log.info(
            "capture transport ready", device=str(ops.device), ring_bytes=nbytes,
            arena_bytes=arena.nbytes, captures=len(arena.offsets),
            arena_slots=arena.slots, max_graph_batch=max_graph_batch, strip=opts.strip,
            malloc_tuned=tuned, copy_piece_bytes=opts.copy_piece_bytes,
            copy_gaps=opts.copy_gaps, side_stream=opts.side_stream,
            topk_kernel=self.topk_kernel,
            window_bytes=self._drain.device_bytes, last_slot_bytes=self._last_slots.nbytes,
        )

    @property
    def topk_kernel(self) -> str | None:
        """The top-k selection ``final_logits:topk(K)`` runs (``DMX_TOPK_KERNEL``,
        ``auto`` resolved at start-up); None without a top-k."""
        payloads = self._payloads
        return payloads.kernel if payloads is not None and payloads.topk else None

    @property
    def device_bytes(self) -> int:
        """Device memory the transport holds (ring, arena and decode window): count it in
        capacity."""
        return (int(self._ring.numel()) + int(self._arena.device_bytes)
                + self._drain.device_bytes + self._last_slots.nbytes)

    def preflight(self, plan: CommitPlan,
                  eager_plan: Callable[[], CommitPlan] | None = None) -> Preflight:
        """How ``plan`` would be committed now (see :func:`~.capacity.preflight`).

        A decode graph step answered ``RUN_EAGER`` is counted as forced eager: the
        adapter is expected to run it eagerly with the plan ``eager_plan()`` makes (made
        only when the step does not fit now).
        """
        self._check_usable()
        if not plan.segments:
            return _NOTHING
        program = self._program(plan)
        usage = self._room()
        if program.reserve_bytes <= usage.free_bytes and program.entries <= usage.free_entries:
            return _FITS
        self._drain.hurry()
        result = preflight(plan, usage, self.capacity,
                           eager_plan=eager_plan() if eager_plan is not None else None)
        if result.decision is Decision.RUN_EAGER:
            self._forced_eager += 1
            log.info("decode step forced eager", reason=result.reason)
        return result

    def commit(self, plan: CommitPlan, *, step: int) -> None:
        """Reserve the step's ring space before its forward (waiting for the drain if needed).

        Raises:
            CommitError: the previous step was not sealed.
            CaptureError: the transport stopped or failed (sticky).
        """
        self._check_usable()
        if self._writer.open is not None:
            msg = f"step {step} committed while step {self._writer.open.seq} is not sealed"
            raise CommitError(msg)
        self._last_seq = step
        try:
            if self._last_slots:
                if self._last_slots.pending:
                    self._read_finished(step)
                self._last_slots.begin(plan)
            if plan.padded:
                self._arena.check_landing()
        except CaptureError as exc:
            self._fail(exc, "commit")
            raise
        if not plan.segments:
            if plan.padded:  # the replay writes the arena all the same: not a live slot
                self._select(self._arena.spare)
            self._writer.open = OpenStep(step, plan, None, Mode.EMPTY, -1)
            return
        slot, drained = 0, False
        try:
            program = self._program(plan)
            mode = Mode.ARENA if plan.padded else Mode.RING
            with self._cond:
                base = self._alloc.reserve(program.reserve_bytes, program.entries)
            if base is None:
                self._drain.hurry()
                usage = self._room()
                decision = preflight(plan, usage, self.capacity).decision
                if decision is Decision.PIECEWISE or decision is Decision.RUN_EAGER:
                    mode = Mode.PIECES if decision is Decision.PIECEWISE else Mode.ARENA_PIECES
                    self._piecewise += 1
                    log.info("step committed piecewise", step=step, bytes=program.reserve_bytes,
                             free=usage.free_bytes, padded=plan.padded)
                else:
                    base = self._wait_reserve(program.reserve_bytes, program.entries, step)
            if plan.padded:
                slot, drained = self._take_slot()
                self._select(slot)
        except CaptureError as exc:
            self._fail(exc, "commit")
            raise
        self._writer.open = OpenStep(step, plan, program, mode, -1 if base is None else base,
                                     slot=slot, drained=drained)
        self._steps += 1
        self._tensors += program.entries

    def seal(self) -> None:
        """The forward returned: queue the step's device copies and hand it to the drain.

        Raises:
            CommitError: no step is committed.
            CaptureError: a planned capture point never ran (sticky).
        """
        self._check_usable()
        step = self._writer.open
        if step is None:
            msg = "seal() without a committed step"
            raise CommitError(msg)
        self._writer.open = None
        try:
            if self._last_slots:
                self._last_slots.end()
            self._writer.seal(step)
        except CaptureError as exc:
            self._fail(exc, "seal")
            raise

    def abort(self) -> None:
        """The forward raised: free the open step's space without storing it (logged).

        Parts of a piecewise step that were already handed to the drain are stored.
        """
        step, self._writer.open = self._writer.open, None
        if step is not None and step.mode in (Mode.ARENA, Mode.ARENA_PIECES):
            self._arena.forget()  # its own rows: the landing was empty at its commit
        if self._last_slots:
            self._last_slots.abort()
        if step is None or step.mode is Mode.EMPTY:
            return
        if step.drained:  # later replays are queued after whatever this one wrote
            self._free_slot(step.slot)
        log.warning("capture step aborted; its rows are not stored", step=step.seq)
        if step.program is not None and step.base >= 0:
            self._drain.put(
                DrainItem(step.seq, step.plan, step.program, step.base, self._ops.mark(),
                          discard=True)
            )
        self._writer.end_part(step, discard=True)  # reserved, not handed over yet

    def uncommitted_replay(self) -> None:
        """A decode graph is about to replay with no committed step: what the graph
        records into the ``last`` slots goes to their spare row (see
        :meth:`LastSlots.guard_replay`), and what it records into the arena goes to the
        spare slot (no step's rows are overwritten); a cast's fp16 overflow counter
        counts what every replay casts, as documented."""
        if self._writer.open is not None:
            return
        self._select(self._arena.spare)
        if self._last_slots:
            self._last_slots.guard_replay()

    def abandon(self) -> None:
        """The run failed: no more device reads (the ``last`` slots' finish notices are
        not read at stop; later graph replays keep writing the slots)."""
        with self._cond:
            self._unusable = True
            self._cond.notify_all()

    def settle(self) -> None:
        """Between steps, no forward soon (the scheduler is idle): queue the ``last``
        rule's reads of finished requests and their notices now instead of at the next
        commit. The caller made sure the device finished the forwards that wrote the
        slots (on the forward stream). Never waits and never raises: with the drain
        behind (ring space in use) the reads wait for a later call or the next commit,
        and a failure here becomes the transport's sticky failure, reported by the stop.
        """
        if self._unusable or not self._last_slots or not self._last_slots.pending \
                or self._writer.open is not None:
            return
        with self._cond:
            if self._alloc.live_regions:  # a reservation could wait for the drain
                return
        try:
            self._read_finished(self._last_seq)
        except Exception as exc:  # any failure here is the run's failure
            self._fail(exc, "settle")

    def finish_request(self, request_id: str, logits_end: int | None,
                       manifest: RequestManifest | None = None) -> None:
        """The scheduler saw ``request_id`` finish (or the run is stopping): between steps.

        The drain holds back each request's newest ``final_logits`` row, because SGLang's
        overlap scheduler forwards the last generated token once more and that forward's
        logits decide nothing. This notice settles it: rows at positions ``>= logits_end``
        (``prompt + completion - 1``) are discarded (counted in
        ``discarded_logit_rows``), earlier ones stored; ``None`` stores everything (an
        unfinished request at stop). Ordered after every step sealed so far; call it
        before the request's id could be reused, never while a step is open.

        With captures under the ``last`` rule the notice waits for the next commit (or
        stop), which first reads the finished requests' rows out of their slots (at
        position ``logits_end - 1``; an unfinished request at stop has none).

        ``manifest`` (a request that finished cleanly) is handed to the sink's
        ``commit_requests`` once the drain handed it the request's last rows.

        Raises:
            CaptureError: the transport stopped or failed (sticky).
        """
        self._check_usable()
        if manifest is not None:
            self._undelivered[request_id] = manifest
        if self._last_slots:  # its manifest waits in _undelivered for the read
            self._last_slots.finished(request_id, logits_end)
            return
        self._drain.finish(request_id, logits_end, manifest)

    def undelivered_manifests(self) -> list[RequestManifest]:
        """See the port: the manifests the sink has not taken."""
        return list(self._undelivered.values())

    def _delivered(self, manifests: Sequence[RequestManifest]) -> None:
        """The sink took these (the drain's thread, after ``commit_requests`` returned)."""
        for m in manifests:
            if self._undelivered.get(m.request_id) is m:
                del self._undelivered[m.request_id]

    def stop(self) -> TransportStats:
        """Drain everything, flush the sink; terminal and idempotent.

        Held ``final_logits`` rows without a finish notice are stored.

        Raises:
            CaptureError: anything failed during the run (drain, sink, a capture); the
                same error on every later call.
        """
        if not self._stopped:
            step = self._writer.open
            if self._last_slots and not self._unusable and step is None:
                try:  # the finish notices still waiting for a commit
                    self._read_finished(self._last_seq)
                except Exception as exc:  # any failure here is the run's failure
                    self._fail(exc, "stop")
            self._stopped = True
            self._unusable = True
            if step is not None and (step.mode is not Mode.EMPTY or self._last_slots.active):
                self._fail(CaptureError(f"step {step.seq} was committed, never sealed"), "stop")
            self._drain.close()
            if self._payloads is not None and self._failure is None:
                try:
                    self._fp16_overflows = self._payloads.overflow_count()
                except Exception as exc:  # the device failed: the run's failure
                    self._fail(exc, "stop")
            try:
                self._sink.flush()
            except Exception as exc:  # any sink failure is the run's failure
                self._fail(exc, "sink flush")
            log.info("capture transport stopped", **attrs.asdict(self.stats()))
        self._check_failed()
        return self.stats()

    def stats(self) -> TransportStats:
        """Statistics so far."""
        return TransportStats(
            steps=self._steps, tensors=self._tensors, rows=self._drain.rows,
            bytes=self._drain.bytes, ring_high_water=self._alloc.high_water,
            stalls=self._stalls, stall_seconds=self._stall_seconds,
            piecewise_stall_seconds=self._piecewise_stall_seconds,
            forced_eager=self._forced_eager, piecewise_steps=self._piecewise,
            discarded_logit_rows=self._drain.discarded,
            fp16_overflows=self._fp16_overflows, capture_seconds=self.capturer.seconds,
        )

    def drain_counters(self) -> dict[str, float]:
        """Drain internals for benchmarks: records and batches, device-to-host bytes and
        seconds of staged and direct items (of these seconds: queueing the copies, and
        waiting for the drain's stream after that), direct payloads larger than a slab
        (pageable memory of their own), appends to the decode window (each moves one
        or more steps), decode windows flushed and the bytes they
        brought to the host, payload bytes the host's CPU copied on the way, CPU seconds
        the drain thread spent building batches (the waits for device copies excepted)
        and of those the CPU seconds of appends to the decode window and of its flushes,
        seconds in ``sink.put``, payload buffers allocated and reused, request rows held
        back now, lingers that ran their whole time (a step waiting for ring space ends one
        early), the times the drain gave the GIL away between pieces of its work and
        the seconds that took, the decode graph steps it moved out of arena slots, in how
        many wake-ups, and the seconds it took to queue their copies to the ring (the
        window's copies from slots not included), the decode graph steps whose slot
        still waited for the drain (their seal copied them out from the spare), the
        device-to-host copies queued (each piece of a copy cut by ``copy_piece_bytes``
        counts) and the times and seconds the drain waited to keep at most
        ``copies_ahead`` of them queued; and the items built outside the decode window,
        by why (``outside_window_<why>``, :data:`~._drain.OUTSIDE_WINDOW`)."""
        d = self._drain
        return {
            "records": d.records, "batches": d.batches,
            "d2h_bytes": d.d2h_bytes, "d2h_seconds": d.d2h_seconds,
            "d2h_call_seconds": d.d2h_call_seconds, "d2h_wait_seconds": d.d2h_wait_seconds,
            "oversized_direct_payloads": d.direct_pool.oversized,
            "direct_items": d.direct_items, "window_appends": d.window_appends,
            **{f"outside_window_{why}": n for why, n in d.outside_window.items()},
            "window_flushes": d.window_flushes,
            "window_bytes": d.window_bytes, "host_copied_bytes": d.host_copied_bytes,
            "build_cpu_seconds": d.build_cpu_seconds,
            "window_append_cpu_seconds": d.window_append_cpu_seconds,
            "window_flush_cpu_seconds": d.window_flush_cpu_seconds,
            "sink_seconds": d.sink_seconds,
            "buffers_allocated": d.pool.allocated, "buffers_reused": d.pool.reused,
            "pinned_buffers_allocated": d.direct_pool.allocated,
            "pinned_buffers_reused": d.direct_pool.reused,
            "held_rows": len(d.held), "lingers": d.lingers,
            "committed_requests": d.committed_requests,
            "gil_yields": d.gil.yields, "gil_yield_seconds": d.gil.yield_seconds,
            "slot_items": d.slot_items, "slot_rounds": d.slot_rounds,
            "slot_seconds": d.slot_seconds, "slots_missed": self._slots_missed,
            "d2h_pieces": self._ops.copy_pieces, "d2h_ahead_waits": self._ops.ahead_waits,
            "d2h_ahead_wait_seconds": self._ops.ahead_wait_seconds,
            "d2h_kernel_copies": self._ops.kernel_copies,
            "d2h_kernel_declined": self._ops.kernel_declined, "d2h_gaps": self._ops.gaps,
        }

    # -- internals -------------------------------------------------------------------------

    def _read_finished(self, seq: int) -> None:
        """Queue the reads of the finished requests' ``last`` rows on the current stream
        (before any later forward can write their slots again), then their notices."""
        reads, notices = self._last_slots.take_reads()
        step = self._reads_per_plan
        for at in range(0, len(reads), step):  # pieces of at most a quarter of the ring
            chunk = reads[at : at + step]
            plan = make_read_plan([(rid, p) for rid, p, _ in chunk], self._selection,
                                  self._shape)
            cached = self._read_programs.get(len(chunk))
            if cached is None:  # the same for every read of as many requests
                cached = self._read_programs[len(chunk)] = (
                    build_program(plan, self._arena), self._last_slots.read_layout(
                        {(seg.hook.name, seg.layer_no): (seg.offset, seg.nbytes)
                         for seg in plan.segments}, len(chunk)))
            program, layout = cached
            base = self._reserve(program.reserve_bytes, program.entries, seq)
            rows = self._last_slots.upload([row for _, _, row in chunk])
            region = self._ring[base : base + program.reserve_bytes]
            self._last_slots.read_into(layout, rows, region)
            self._drain.put(DrainItem(seq, plan, program, base, self._ops.mark()))
            self._steps += 1
            self._tensors += program.entries
        for rid, end in notices:
            self._drain.finish(rid, end, self._undelivered.get(rid))

    def _program(self, plan: CommitPlan) -> Program:
        last_plan, last_program = self._last
        if last_plan is not None and last_program is not None and (
                plan is last_plan or plan.shares_structure(last_plan)):
            self._last = (plan, last_program)
            return last_program
        key = plan_key(plan) if plan.cacheable else None  # a long prefill's: not cached
        cached = self._programs.get(key) if key is not None else None
        program = cached if cached is not None else build_program(plan, self._arena)
        if key is not None and cached is None:
            self._programs[key] = program
            if len(self._programs) > _PROGRAM_CACHE:
                del self._programs[next(iter(self._programs))]
        self._last = (plan, program)
        return program

    def _capture(self, key: CaptureKey, tensor: torch.Tensor) -> None:
        if self._unusable:
            self._check_usable()
        try:
            self._writer.capture(key, tensor)
        except CaptureError as exc:
            self._fail(exc, "capture")
            raise

    def _select(self, slot: int) -> None:
        """Point the arena's device index at ``slot`` (a device copy, when it moves)."""
        turns = self._turns
        if slot != turns.selected:
            self._arena.select(slot)
            turns.selected = slot

    def _take_slot(self) -> tuple[int, bool]:
        """The arena slot a padded step's replay writes, and whether the drain copies it
        out: the next slot once the drain copied its previous step out; else the spare
        (the step's seal copies it out at once, as with one slot: nothing waits). Wakes
        the drain while half the slots or more wait for it, and when a slot was missed."""
        turns = self._turns
        slots = len(turns.busy)
        if slots == 1:
            return 0, False
        slot = turns.next
        with self._cond:
            missed = turns.busy[slot]
            if not missed:
                turns.busy[slot] = True
                turns.count += 1
            busy = turns.count
        if missed:
            self._slots_missed += 1
            self._drain.hurry()
            return self._arena.spare, False
        if 2 * busy >= slots:
            self._drain.hurry()
        turns.next = (slot + 1) % slots
        return slot, True

    def _from_slot(self, program: Program, base: int, slot: int) -> None:
        self._writer.from_slot(program, base, slot)

    def _free_slot(self, slot: int) -> None:
        turns = self._turns
        with self._cond:
            if turns.busy[slot]:
                turns.busy[slot] = False
                turns.count -= 1

    def _release(self) -> None:
        with self._cond:
            self._alloc.release()
            self._cond.notify_all()

    def _room(self) -> RingUsage:
        """The largest contiguous ring reservation possible now, and the free entries."""
        with self._cond:
            return self._alloc.usage()

    def _reserve(self, nbytes: int, entries: int, seq: int, *, part: bool = False) -> int:
        with self._cond:
            base = self._alloc.reserve(nbytes, entries)
        return base if base is not None else self._wait_reserve(nbytes, entries, seq, part=part)

    def _reserve_part(self, nbytes: int, entries: int, seq: int) -> int:
        """:meth:`_reserve` for a part of a piecewise step (its waits also counted in
        ``piecewise_stall_seconds``)."""
        return self._reserve(nbytes, entries, seq, part=True)

    def _wait_reserve(self, nbytes: int, entries: int, seq: int, *, part: bool = False) -> int:
        t0 = time.monotonic()
        deadline = t0 + self.options.stall_timeout_s
        with self._cond:
            while (base := self._alloc.reserve(nbytes, entries)) is None:
                self._check_usable()
                if self._alloc.live_regions == 0:
                    msg = f"{nbytes} bytes / {entries} tensors can never fit the ring"
                    raise CaptureError(msg)
                self._drain.hurry()
                left = deadline - time.monotonic()
                if left <= 0:
                    msg = (f"step {seq} waited {self.options.stall_timeout_s:.0f} s for the drain "
                           f"without getting {nbytes} bytes of ring space")
                    raise CaptureError(msg)
                self._cond.wait(left)
        self._count_stall(seq, time.monotonic() - t0, what=f"{nbytes} bytes of ring space",
                          part=part)
        return base

    def _count_stall(self, seq: int, waited: float, *, what: str, part: bool = False) -> None:
        self._stalls += 1
        self._stall_seconds += waited
        if part:
            self._piecewise_stall_seconds += waited
        level = log.warning if self._stalls == 1 or waited > 1.0 else log.debug
        level("step waited for the drain", step=seq, seconds=round(waited, 6), waited_for=what,
              stalls=self._stalls)

    def _fail(self, exc: BaseException, where: str) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = (exc, where)
                log.error("capture failed", where=where, error=repr(exc))
            self._unusable = True
            self._cond.notify_all()

    @property
    def failure(self) -> CaptureError | None:
        """The sticky failure as :meth:`stop` would raise it (None while it works)."""
        if self._failure is None:
            return None
        exc, where = self._failure
        error = CaptureError(f"capture failed in {where}: {exc!r}")
        error.__cause__ = exc
        return error

    def _check_failed(self) -> None:
        failure = self.failure
        if failure is not None:
            raise failure

    def _check_usable(self) -> None:
        if self._unusable:
            self._check_failed()
            msg = "the capture transport is stopped"
            raise CaptureError(msg)
