"""What the transport asks of the device: buffers, the capture probe, ordering, host copies.

One class covers CUDA and CPU. On CPU (the unit tests) the ordering markers are ``None``
and "pinned" staging is a plain host tensor, so the same transport code runs and its
bookkeeping is tested without a GPU. The drain stream's work runs at once on CPU, or,
with :attr:`DeviceOps.defer_on_cpu`, only when it is waited for (:meth:`DeviceOps.wait`):
the tests run that way, so a host read of a copy that was
never waited for, or a ring region released before its copy ran, shows as wrong bytes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence

import structlog
import torch

from dmi_sglang.adapters.transport.kernel_copy import kernel_copy, warm_up
from dmi_sglang.domain.shapes import DType

log = structlog.get_logger("dmi_sglang.transport.device")

__all__ = ["TORCH_DTYPES", "DeviceOps", "Fence", "Marker", "copy_rows",
           "widest"]

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.FLOAT32: torch.float32,
    DType.FLOAT64: torch.float64,
    DType.INT8: torch.int8,
    DType.UINT8: torch.uint8,
    DType.INT16: torch.int16,
    DType.INT32: torch.int32,
    DType.INT64: torch.int64,
    DType.BOOL: torch.bool,
}
"""Domain dtypes to torch dtypes."""

WIDE_DTYPES: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
"""Element types used to move raw bytes (wider elements, fewer threads per byte)."""

Marker = tuple[torch.cuda.Event, int] | None
"""Orders the drain after the device work of a step: (event, stream id); None on CPU."""


def _never() -> bool:
    return False


class Fence:
    """A point in the work queued on the drain's stream (:meth:`DeviceOps.fence`): the
    host may use what that work wrote, and the device memory it read may be written
    again, once :meth:`DeviceOps.wait` returned for it."""

    __slots__ = ("event", "markers", "upto")

    def __init__(self, event: torch.cuda.Event | None, markers: list[torch.cuda.Event],
                 upto: int) -> None:
        self.event = event
        self.markers = markers
        """Markers the work before it waited for (recycled once it is waited for)."""
        self.upto = upto
        """Work items queued before it (CPU: the deferred ones it waits for)."""


class DeviceOps:
    """Device primitives for one transport.

    Args:
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        capture_probe: returns True while a CUDA graph is being captured on the current
            stream; defaults to ``torch.cuda.is_current_stream_capturing`` on CUDA and to
            "never" on CPU (tests pass their own to simulate a graph capture).
        copy_piece_bytes: the largest single device-to-host copy :meth:`to_host_all` queues
            (a larger one goes in pieces); 0: every copy whole.
        copies_ahead: the most device-to-host pieces queued on the drain's stream and
            not yet done: before queueing one more, :meth:`to_host_all` waits for the oldest
            (on CPU every copy is done when queued: the waits return at once); 0: no
            limit.
        copy_kernel_programs: above 0, :meth:`to_host_all` copies each piece into
            page-locked memory with a copy kernel of this many programs (the GPU's cores;
            :mod:`~dmi_sglang.adapters.transport.kernel_copy`) instead of the copy engine;
            on CPU with Triton's interpreter only (the tests). 0: the copy engine.
        copy_gaps: after each device-to-host piece :meth:`to_host_all` queues, queue a tiny
            kernel on the same stream: while it runs the stream has no copy for the copy
            engine, which can serve another stream's copy (SGLang's) in between, where
            back-to-back copies of one stream would hold it until they run out.
    """

    defer_on_cpu = False
    """On CPU, run the drain stream's work only when it is waited for, as a GPU would
    have it done only then at the earliest (set by the tests; read at construction)."""

    def __init__(
        self, device: str | torch.device, capture_probe: Callable[[], bool] | None = None,
        *, copy_piece_bytes: int = 0, copies_ahead: int = 0, copy_kernel_programs: int = 0,
        copy_gaps: bool = False,
    ) -> None:
        for name, value, zero in (("copy_piece_bytes", copy_piece_bytes, "no limit"),
                                  ("copies_ahead", copies_ahead, "no limit"),
                                  ("copy_kernel_programs", copy_kernel_programs,
                                   "the copy engine")):
            if value < 0:
                msg = f"{name} {value}: expected >= 0 (0: {zero})"
                raise ValueError(msg)
        dev = torch.device(device)
        self.is_cuda = dev.type == "cuda"
        if self.is_cuda and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._index = dev.index if dev.index is not None else 0
        if capture_probe is None:
            capture_probe = torch.cuda.is_current_stream_capturing if self.is_cuda else _never
        self.capturing: Callable[[], bool] = capture_probe
        self._drain_stream = torch.cuda.Stream(dev) if self.is_cuda else None  # type: ignore[no-untyped-call]
        self._free_events: list[torch.cuda.Event] = []
        self._free_fences: list[torch.cuda.Event] = []
        self._pending: list[torch.cuda.Event] = []
        """Markers waited for by work queued on the drain stream since the last fence
        (the next fence takes them)."""
        self._defer = not self.is_cuda and self.defer_on_cpu
        self._deferred: collections.deque[Callable[[], None]] = collections.deque()
        self._queued = 0
        """Work items queued on the drain stream so far (CPU: run or deferred)."""
        self._fenced = 0
        """``_queued`` at the last fence."""
        self._piece_bytes = copy_piece_bytes
        self._ahead = copies_ahead
        self._ahead_events: collections.deque[torch.cuda.Event | _Done] = collections.deque()
        self._kernel_programs = copy_kernel_programs
        if copy_kernel_programs:
            warm_up(dev, copy_kernel_programs)  # compiled and checked before the first flush
        self._gap: tuple[torch.Tensor, torch.Tensor] | None = None
        """A gap's (destination, source): two int64 elements copied from every other one
        of four, so the copy is strided and runs as a kernel, never on the copy engine."""
        if copy_gaps:
            self._gap = (torch.zeros(2, dtype=torch.int64, device=dev),
                         torch.ones(4, dtype=torch.int64, device=dev)[::2])
        self.copy_pieces = 0
        """Device-to-host copies :meth:`to_host_all` queued (a copy in pieces counts each)."""
        self.ahead_waits = 0
        """Times :meth:`to_host_all` found its oldest piece not yet done and waited for it
        before queueing one more."""
        self.ahead_wait_seconds = 0.0
        """Seconds those waits took."""
        self.gaps = 0
        """Gap kernels queued after the copy engine's pieces (``copy_gaps``)."""
        self.kernel_copies = 0
        """Of :attr:`copy_pieces`, those a copy kernel made (``copy_kernel_programs``)."""
        self.kernel_declined = 0
        """Of :attr:`copy_pieces`, those the copy engine made although
        ``copy_kernel_programs`` asked for the kernel (see :meth:`_by_kernel`)."""

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """A byte buffer on the device (outside any SGLang pool: a plain allocation)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer, page-locked on CUDA so device-to-host copies are async."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_cuda)

    def mark(self) -> Marker:
        """Record a marker on the current stream after the work queued so far."""
        if not self.is_cuda:
            return None
        stream = torch.cuda.current_stream(self._index)
        event = self._free_events.pop() if self._free_events else torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event, stream.cuda_stream

    def queue_to_host(self, markers: Sequence[Marker],
                      pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Queue the copy of each ``src`` (device) into its ``dst`` (host) on the drain's
        own stream, once every marker completed, without waiting for them: :meth:`wait`
        for a :meth:`fence` after them before the host reads a ``dst`` or the device
        writes a ``src`` again. The copies overlap the next forward. Markers of one stream
        complete in order, so only the last marker of each stream is waited for; each
        marker is used once (recycled once a fence after it was waited for).

        Returns:
            The seconds queueing took (a ``copy_`` call returns at once for page-locked
            memory; a pageable destination makes it wait for its copy, and so for the
            device work before it on the drain's stream), the waits for ``copies_ahead``
            not included (:attr:`ahead_wait_seconds`).
        """
        def copy() -> None:
            self.to_host_all(pairs)
        t0, waited = time.perf_counter(), self.ahead_wait_seconds
        self.on_drain_stream(markers, copy)
        return time.perf_counter() - t0 - (self.ahead_wait_seconds - waited)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """:meth:`to_host_all` of one pair."""
        self.to_host_all(((dst, src),))

    def to_host_all(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(dst, src)`` pair's ``src`` (device) into its ``dst`` (host, same
        shape) on the current stream, the drain's inside :meth:`on_drain_stream`'s work:
        in pieces of at most ``copy_piece_bytes`` (split along the first dimensions, whole
        rows where a row fits), with at most ``copies_ahead`` of them queued and not yet
        done. A copy engine runs the device-to-host copies of every stream one after
        another, so a small copy SGLang's scheduler waits for (a step's sampled tokens)
        can wait for a large one of the drain queued before it; bounded pieces bound that
        wait.

        Without ``copies_ahead`` and the copy kernel, every piece (and the gap after it)
        is queued by one ``torch._foreach_copy_`` call (host destinations, device
        sources: it makes the copies one by one, in order): the drain thread releases
        and retakes the GIL once for all of them instead of once a piece (twice with
        gaps), and each retake may make the scheduler thread wait for it."""
        if self._ahead or self._kernel_programs:
            for dst, src in pairs:
                self._to_host_piecewise(dst, src)
            return
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        pieces = 0
        for dst, src in pairs:
            for d, s in _pieces(dst, src, self._piece_bytes):
                dsts.append(d)
                srcs.append(s)
                pieces += 1
                if self._gap is not None:  # a kernel, not a copy: the stream's gap
                    dsts.append(self._gap[0])
                    srcs.append(self._gap[1])
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=self.is_cuda)
        self.copy_pieces += pieces  # counted once queued, as a piece at a time counts
        self.gaps += pieces if self._gap is not None else 0

    def _to_host_piecewise(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """:meth:`to_host_all` of one pair a piece at a time: with ``copies_ahead`` (waits
        between pieces) or the copy kernel."""
        queued = self._ahead_events
        for d, s in _pieces(dst, src, self._piece_bytes):
            event: torch.cuda.Event | _Done | None = None
            if self._ahead:
                if len(queued) >= self._ahead:
                    event = queued.popleft()
                    if not event.query():  # still queued: wait (a blocking event sleeps)
                        t0 = time.perf_counter()
                        event.synchronize()
                        self.ahead_waits += 1
                        self.ahead_wait_seconds += time.perf_counter() - t0
                elif self.is_cuda:
                    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                else:
                    event = _Done()
            if self._by_kernel(d, s):
                kernel_copy(d, s, self._kernel_programs)
                self.kernel_copies += 1
            else:
                if self._kernel_programs:
                    self._declined(d, s)
                d.copy_(s, non_blocking=self.is_cuda)
                if self._gap is not None:
                    self._gap[0].copy_(self._gap[1], non_blocking=self.is_cuda)
                    self.gaps += 1
            self.copy_pieces += 1
            if event is not None:
                event.record()  # on the current stream: the drain's
                queued.append(event)

    def _by_kernel(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether a copy kernel can make this copy: asked for, the source on this
        device, same shape and dtype, both contiguous, the destination page-locked (on
        CUDA: a kernel reaches no other host memory). Else the copy engine makes it (a
        broadcasting, strided or pageable copy)."""
        return (self._kernel_programs > 0 and src.device == self.device
                and dst.shape == src.shape and dst.dtype == src.dtype
                and dst.is_contiguous() and src.is_contiguous()
                and (dst.is_pinned() if self.is_cuda else True))

    def _declined(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Count a copy the kernel could not make; say so once, with why."""
        self.kernel_declined += 1
        if self.kernel_declined == 1:
            log.warning("dmi.copy_kernel_declined", nbytes=src.numel() * src.element_size(),
                        contiguous=dst.is_contiguous() and src.is_contiguous(),
                        same_shape=dst.shape == src.shape,
                        page_locked=dst.is_pinned() if self.is_cuda else None,
                        note="the copy engine makes this copy and any like it "
                             "(d2h_kernel_declined counts them)")

    def on_drain_stream(self, markers: Sequence[Marker], work: Callable[[], None]) -> None:
        """Queue ``work`` (device copies) on the drain's own stream after the device work
        the markers follow; returns without waiting for it (on CPU it runs now, unless
        deferred). :meth:`wait` for a :meth:`fence` after it before the host reads what
        it wrote or the ring space it read is reused. Each marker is used once: it is
        recycled once a fence after it was waited for."""
        self._queued += 1
        stream = self._drain_stream
        if stream is None:
            if self._defer:
                self._deferred.append(work)
            else:
                work()
            return
        events = [m for m in markers if m is not None]
        with torch.cuda.stream(stream):
            for event in {stream_id: ev for ev, stream_id in events}.values():
                stream.wait_event(event)
            work()
        self._pending.extend(event for event, _ in events)

    def fence(self) -> Fence:
        """A fence after the work queued on the drain's stream so far: :meth:`wait` for
        it (once) before the host reads what that work wrote or the device memory it read
        is reused; work queued later may still run."""
        event = None
        if self._drain_stream is not None:
            event = self._free_fences.pop() if self._free_fences else torch.cuda.Event(  # type: ignore[no-untyped-call]
                blocking=True)
            event.record(self._drain_stream)
        markers, self._pending = self._pending, []
        self._fenced = self._queued
        return Fence(event, markers, self._queued)

    @property
    def unfenced(self) -> bool:
        """True when work was queued on the drain's stream after the last fence."""
        return self._queued > self._fenced

    def done(self, fence: Fence) -> bool:
        """True when the work before ``fence`` is done (never blocks; CPU with deferred
        work: only once it was waited for)."""
        if fence.event is not None:
            return bool(fence.event.query())  # type: ignore[no-untyped-call]
        return self._queued - len(self._deferred) >= fence.upto

    def wait(self, fence: Fence) -> None:
        """Block until the work before ``fence`` is done (the GIL is released while
        waiting); its markers are recycled."""
        if fence.event is not None:
            fence.event.synchronize()
            self._free_fences.append(fence.event)
            fence.event = None
        else:
            while self._queued - len(self._deferred) < fence.upto:
                self._deferred.popleft()()
        self._free_events.extend(fence.markers)
        fence.markers = []

    def wide(self, buffer: torch.Tensor) -> dict[int, torch.Tensor]:
        """Views of a byte buffer as 8-, 4-, 2- and 1-byte elements (for raw copies)."""
        return {size: buffer.view(dtype) for size, dtype in WIDE_DTYPES.items()}


def widest(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and a strided ``src`` of the same dtype and row width, seen as the widest
    elements (8 or 4 bytes) both layouts allow, for a copy between them (a plain or an
    indexed one); as they are when ``src`` is contiguous (a plain copy is one memcpy
    then) or no wider view fits. A strided copy (q, k and v are column slices of
    SGLang's qkv) runs as an element-wise kernel whose work goes with the element
    count: 8-byte elements are 4 bf16 values a thread."""
    if (src.is_contiguous() or not dst.dim() or not src.dim() or dst.dtype != src.dtype
            or dst.shape[-1] != src.shape[-1]):
        return dst, src
    size = src.element_size()
    for wide in (8, 4):
        if wide > size and _widens(dst, wide // size) and _widens(src, wide // size):
            try:
                return dst.view(WIDE_DTYPES[wide]), src.view(WIDE_DTYPES[wide])
            except RuntimeError:  # a layout torch does not view so
                continue
    return dst, src


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> int:
    """``dst.copy_(src)`` (same shape and dtype) as :func:`widest` elements; returns the
    bytes an element was copied as."""
    if dst.shape != src.shape:
        dst.copy_(src)
        return dst.element_size()
    wide_dst, wide_src = widest(dst, src)
    wide_dst.copy_(wide_src)
    return wide_dst.element_size()


def _widens(t: torch.Tensor, ratio: int) -> bool:
    """True when ``t`` can be seen with elements ``ratio`` times as wide (its data
    aligned to them too)."""
    return bool(t.stride(-1) == 1 and t.shape[-1] % ratio == 0
                and t.storage_offset() % ratio == 0
                and t.data_ptr() % (ratio * t.element_size()) == 0
                and all(s % ratio == 0 for s in t.stride()[:-1]))


class _Done:
    """A CPU stand-in for a piece's CUDA event: CPU copies are done when queued."""

    def record(self) -> None:
        """Nothing to record: the copy ran."""

    def query(self) -> bool:
        """Done."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


def _pieces(dst: torch.Tensor, src: torch.Tensor,
            piece_bytes: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` views covering the pair once, each of at most ``piece_bytes``
    (0: the pair whole; so is a pair of different shapes, which ``copy_`` broadcasts):
    runs of whole rows of the first dimension, a row larger than a piece split along the
    next."""
    nbytes = dst.numel() * dst.element_size()
    if not piece_bytes or nbytes <= piece_bytes or dst.dim() == 0 or dst.shape != src.shape:
        yield dst, src
        return
    rows = dst.shape[0]
    per_piece = piece_bytes // (nbytes // rows)
    if per_piece == 0:
        for i in range(rows):
            yield from _pieces(dst[i], src[i], piece_bytes)
        return
    for lo in range(0, rows, per_piece):
        yield dst[lo : lo + per_piece], src[lo : lo + per_piece]
