"""Tuning of the capture transport, from plain settings."""

from __future__ import annotations

import threading

import attrs

from dmi_sglang.domain.settings import TOPK_KERNELS, Settings

__all__ = ["ENGINE_DEFAULTS", "TransportOptions"]

MIB = 1 << 20
_WAIT_AT_MOST = attrs.validators.le(threading.TIMEOUT_MAX)
"""The longest timeout ``threading`` and ``queue`` waits take (a longer one raises
OverflowError in the waiting thread, the drain's or the scheduler's, mid-run)."""

ENGINE_DEFAULTS = Settings()
"""An engine's settings when no variable is set: the defaults here are its values (but
``side_stream``'s, which needs a model that calls the capturer's ``join``)."""

TOPK_CHUNK = ENGINE_DEFAULTS.topk_chunk
"""The chunk width ``DMX_TOPK_CHUNK`` defaults to: the fastest of 16 to 512 at batch 64 on
an H100 (120 µs a call against ``torch.topk``'s 164 over Qwen3's 151,936 float32 logits;
at batch 1 and 8, 70 and 85 µs against 61 and 70: ``python -m harness topk``)."""


@attrs.frozen
class TransportOptions:
    """Knobs of :class:`~dmi_sglang.adapters.transport.TorchCaptureTransport`. Each
    defaults to what an engine runs with when its variable is unset
    (:data:`ENGINE_DEFAULTS`), but ``side_stream``.

    Attributes:
        strip: ``DMX_GPU_PADDING_STRIP``: plans are made with this flag (the transport
            follows each plan's own ``strip``; this value sizes the startup check).
        flush_timeout_s: ``DMX_DRAIN_FLUSH_TIMEOUT_US`` / 1e6: longest time a decode row
            waits in the coalescing window before it goes to the sink.
        stall_timeout_s: longest single wait for the drain; past it the transport fails
            (sticky) instead of hanging the scheduler forever.
        coalesce_decode: coalesce consecutive decode rows into one record per request,
            capture and run of positions (see ``_window``).
        coalesce_max_bytes: ``DMX_DRAIN_WINDOW_MB`` x 2**20: device bytes of the
            coalescing window; as much again holds its gather buffer on the device, and
            each page-locked flush buffer on the host (two reserved at start). 512 MiB
            hold ~5 decode steps of ``sglang-full`` at batch 64 on Qwen3-0.6B (98 MB
            each) and ~140 of ``hidden-states`` (3.7 MB). A flush makes the same
            records whatever the window holds (one per request, capture and run of
            positions): a larger window makes fewer flushes and records.
        max_prefill_tokens: most token rows one eager forward can hold (SGLang's
            ``chunked_prefill_size``); 0 means the largest decode batch. Startup check.
        max_requests: most requests one forward can hold (0: the largest decode batch).
        tune_host_malloc: raise glibc's trim/mmap thresholds so freed payload memory is
            reused instead of faulted in again (process-wide; see ``tune_host_malloc``).
        direct_copies: copy steps whose rows lie contiguous in the ring straight into
            payload memory (no staging copy on the host; see ``_drain``). Off only to
            compare.
        linger_s: ``DMX_DRAIN_LINGER_US`` / 1e6: shortest time between two wake-ups of the
            drain for decode steps that join the coalescing window or wait in arena
            slots: the steps that arrive meanwhile wait there and are moved together
            (into the window: one device copy per group for all of them). Every
            wake-up takes the GIL from the scheduler thread several times (each torch
            call releases and retakes it). A step waiting for ring space, half the arena
            slots or more waiting, or a step finding its slot still waiting, ends a
            linger at once, and the flush timeout still
            bounds how long rows wait. 0: wake for every step.
        arena_slots_bytes: ``DMX_ARENA_SLOTS_MB`` x 2**20: device bytes the
            decode-graph arena's slots may take together
            (:func:`~dmi_sglang.domain.capacity.arena_slots`); an arena of which fewer
            than 4 fit keeps one slot.
        gil_slice_s: ``DMX_DRAIN_GIL_SLICE_US`` / 1e6: longest stretch of the drain's
            Python between two hand-overs of the GIL (``time.sleep(0)``), so a window
            flush does not hold the scheduler thread for milliseconds (see ``_gil``).
            0: the drain gives the GIL away only when it waits.
        copy_piece_bytes: ``DMX_DRAIN_COPY_PIECE_MB`` x 2**20: the largest single
            device-to-host copy the drain queues (a window flush, a staging span, a
            direct item's rows); larger ones go in pieces
            (:meth:`~dmi_sglang.adapters.transport._device.DeviceOps.to_host_all`). 0:
            whole.
        copies_ahead: ``DMX_DRAIN_COPY_AHEAD``: the most of the drain's device-to-host
            pieces queued and not yet done (the drain waits for the oldest before it
            queues one more). 0: no limit.
        copy_kernel_programs: ``DMX_DRAIN_COPY_KERNEL``: above 0, the drain's
            device-to-host copies into page-locked memory are made by a copy kernel of
            this many programs (the GPU's cores) instead of the copy engine
            (:mod:`~dmi_sglang.adapters.transport.kernel_copy`). 0: the copy engine.
        copy_gaps: ``DMX_DRAIN_COPY_GAPS``: a tiny kernel after each of the drain's
            device-to-host pieces on its stream, so that stream has no copy queued while
            it runs and the copy engine serves another stream's copy in between.
        topk_chunk: ``DMX_TOPK_CHUNK``: ``final_logits:topk(K)`` selects each row's K
            largest logits over chunks of this many columns
            (:func:`~dmi_sglang.adapters.transport.topk.chunked_topk`); 0:
            ``torch.topk`` over the whole row.
        topk_kernel: ``DMX_TOPK_KERNEL``: ``none`` (``chunked_topk``; the default),
            ``auto`` (``flashinfer`` where its start-up check passes, else ``none``),
            ``triton`` (the
            selection after the chunk maxima in one Triton kernel,
            :func:`~dmi_sglang.adapters.transport.topk_kernel.fused_topk`) or
            ``flashinfer`` (FlashInfer's radix top-k,
            :func:`~dmi_sglang.adapters.transport.topk_flashinfer.flashinfer_topk`); a
            kernel is compiled and checked when the transport is made, which refuses it
            where it does not work or the shape does not fit.
        side_stream: ``DMX_GRAPH_SIDE_STREAM``: a decode graph records its residual-stream
            copies and its landing moves on a second stream, beside the model's next
            kernels (:mod:`~dmi_sglang.adapters.transport._side`); the model must then call
            the capturer's ``join`` (:class:`~dmi_sglang.tensor_ports.Capturer`), as the
            SGLang adapter's capture points do (an engine's default, from
            ``DMX_GRAPH_SIDE_STREAM=1``). False (the default here): on the forward's
            stream, in line with the model's kernels.
    """

    strip: bool = ENGINE_DEFAULTS.gpu_padding_strip
    flush_timeout_s: float = attrs.field(default=ENGINE_DEFAULTS.drain_flush_timeout_us / 1e6,
                                         validator=[attrs.validators.gt(0.0), _WAIT_AT_MOST])
    stall_timeout_s: float = attrs.field(default=300.0, validator=[attrs.validators.gt(0.0),
                                                                   _WAIT_AT_MOST])
    coalesce_decode: bool = True
    coalesce_max_bytes: int = attrs.field(default=ENGINE_DEFAULTS.drain_window_mb * MIB,
                                          validator=attrs.validators.gt(0))
    max_prefill_tokens: int = 0
    max_requests: int = 0
    tune_host_malloc: bool = True
    direct_copies: bool = True
    linger_s: float = attrs.field(default=ENGINE_DEFAULTS.drain_linger_us / 1e6,
                                  validator=[attrs.validators.ge(0.0), _WAIT_AT_MOST])
    gil_slice_s: float = attrs.field(default=ENGINE_DEFAULTS.drain_gil_slice_us / 1e6,
                                     validator=attrs.validators.ge(0.0))
    arena_slots_bytes: int = attrs.field(default=ENGINE_DEFAULTS.arena_slots_mb * MIB,
                                         validator=attrs.validators.ge(0))
    copy_piece_bytes: int = attrs.field(default=ENGINE_DEFAULTS.drain_copy_piece_mb * MIB,
                                        validator=attrs.validators.ge(0))
    copies_ahead: int = attrs.field(default=ENGINE_DEFAULTS.drain_copy_ahead,
                                    validator=attrs.validators.ge(0))
    copy_kernel_programs: int = attrs.field(default=ENGINE_DEFAULTS.drain_copy_kernel,
                                            validator=attrs.validators.ge(0))
    copy_gaps: bool = ENGINE_DEFAULTS.drain_copy_gaps
    topk_chunk: int = attrs.field(default=TOPK_CHUNK, validator=attrs.validators.ge(0))
    topk_kernel: str = attrs.field(default=ENGINE_DEFAULTS.topk_kernel,
                                   validator=attrs.validators.in_(TOPK_KERNELS))
    side_stream: bool = False

    @classmethod
    def for_engine(cls, settings: Settings, *, max_prefill_tokens: int = 0,
                   max_requests: int = 0) -> TransportOptions:
        """The options an engine runs with: every transport setting of ``settings``
        (``DMX_GPU_PADDING_STRIP``, ``DMX_DRAIN_*``, ``DMX_ARENA_SLOTS_MB``,
        ``DMX_TOPK_CHUNK``, ``DMX_TOPK_KERNEL``, ``DMX_GRAPH_SIDE_STREAM``), and the
        scheduler's limits for the startup checks."""
        return cls.from_settings(
            strip=settings.gpu_padding_strip,
            flush_timeout_us=settings.drain_flush_timeout_us,
            max_prefill_tokens=max_prefill_tokens,
            max_requests=max_requests,
            linger_us=settings.drain_linger_us,
            gil_slice_us=settings.drain_gil_slice_us,
            window_mb=settings.drain_window_mb,
            arena_slots_mb=settings.arena_slots_mb,
            copy_piece_mb=settings.drain_copy_piece_mb,
            copy_ahead=settings.drain_copy_ahead,
            copy_kernel=settings.drain_copy_kernel,
            copy_gaps=settings.drain_copy_gaps,
            topk_chunk=settings.topk_chunk,
            topk_kernel=settings.topk_kernel,
            side_stream=settings.graph_side_stream,
        )

    @classmethod
    def from_settings(
        cls,
        *,
        strip: bool = ENGINE_DEFAULTS.gpu_padding_strip,
        flush_timeout_us: int = ENGINE_DEFAULTS.drain_flush_timeout_us,
        max_prefill_tokens: int = 0,
        max_requests: int = 0,
        linger_us: int = ENGINE_DEFAULTS.drain_linger_us,
        gil_slice_us: int = ENGINE_DEFAULTS.drain_gil_slice_us,
        window_mb: int = ENGINE_DEFAULTS.drain_window_mb,
        arena_slots_mb: int = ENGINE_DEFAULTS.arena_slots_mb,
        copy_piece_mb: int = ENGINE_DEFAULTS.drain_copy_piece_mb,
        copy_ahead: int = ENGINE_DEFAULTS.drain_copy_ahead,
        copy_kernel: int = ENGINE_DEFAULTS.drain_copy_kernel,
        copy_gaps: bool = ENGINE_DEFAULTS.drain_copy_gaps,
        topk_chunk: int = TOPK_CHUNK,
        topk_kernel: str = ENGINE_DEFAULTS.topk_kernel,
        side_stream: bool = False,
    ) -> TransportOptions:
        """From the ``DMX_GPU_PADDING_STRIP`` / ``DMX_DRAIN_FLUSH_TIMEOUT_US`` /
        ``DMX_DRAIN_LINGER_US`` / ``DMX_DRAIN_GIL_SLICE_US`` / ``DMX_DRAIN_WINDOW_MB`` /
        ``DMX_ARENA_SLOTS_MB`` / ``DMX_DRAIN_COPY_PIECE_MB`` / ``DMX_DRAIN_COPY_AHEAD`` /
        ``DMX_DRAIN_COPY_KERNEL`` / ``DMX_DRAIN_COPY_GAPS`` / ``DMX_TOPK_CHUNK`` /
        ``DMX_TOPK_KERNEL`` / ``DMX_GRAPH_SIDE_STREAM`` values."""
        return cls(
            strip=strip,
            flush_timeout_s=max(flush_timeout_us, 1) / 1e6,
            max_prefill_tokens=max_prefill_tokens,
            max_requests=max_requests,
            linger_s=max(linger_us, 0) / 1e6,
            gil_slice_s=max(gil_slice_us, 0) / 1e6,
            coalesce_max_bytes=window_mb * MIB,
            arena_slots_bytes=arena_slots_mb * MIB,
            copy_piece_bytes=copy_piece_mb * MIB,
            copies_ahead=copy_ahead,
            copy_kernel_programs=copy_kernel,
            copy_gaps=copy_gaps,
            topk_chunk=topk_chunk,
            topk_kernel=topk_kernel,
            side_stream=side_stream,
        )
