"""Creating the transport from the plain ``DMX_*`` setting values."""

from __future__ import annotations

import torch

from dmi_sglang.adapters.transport._options import ENGINE_DEFAULTS, TOPK_CHUNK, TransportOptions
from dmi_sglang.adapters.transport._transport import TorchCaptureTransport
from dmi_sglang.columns import RecordSink
from dmi_sglang.domain.capacity import RingCapacity
from dmi_sglang.domain.hooks import Selection
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import ModelShape

__all__ = ["create_transport", "engine_transport"]


def engine_transport(
    settings: Settings,
    *,
    selection: Selection,
    shape: ModelShape,
    max_graph_batch: int,
    sink: RecordSink,
    run_id: str,
    device: str | torch.device,
    max_prefill_tokens: int,
    max_requests: int,
) -> TorchCaptureTransport:
    """The transport of one engine's scheduler, before the model's weights load: its
    ring from ``DMX_RING_*`` and its tuning from every other transport setting
    (:meth:`TransportOptions.for_engine`).

    Raises:
        CapacityError: the ring is smaller than one capture tensor can be.
    """
    return TorchCaptureTransport(
        capacity=RingCapacity.from_mb(settings.ring_payload_mb, settings.ring_pinned_mb,
                                      settings.ring_task_entries),
        selection=selection,
        shape=shape,
        max_graph_batch=max_graph_batch,
        sink=sink,
        run_id=run_id,
        device=device,
        options=TransportOptions.for_engine(settings, max_prefill_tokens=max_prefill_tokens,
                                            max_requests=max_requests),
    )


def create_transport(
    *,
    payload_mb: int,
    pinned_mb: int,
    task_entries: int,
    padding_strip: bool,
    flush_timeout_us: int,
    selection: Selection,
    shape: ModelShape,
    max_graph_batch: int,
    sink: RecordSink,
    run_id: str,
    device: str | torch.device = "cuda",
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
) -> TorchCaptureTransport:
    """The transport for one scheduler, before the model's weights load.

    Args:
        payload_mb / pinned_mb / task_entries: ``DMX_RING_PAYLOAD_MB``,
            ``DMX_RING_PINNED_MB``, ``DMX_RING_TASK_ENTRIES``.
        padding_strip: ``DMX_GPU_PADDING_STRIP``.
        flush_timeout_us: ``DMX_DRAIN_FLUSH_TIMEOUT_US``.
        selection / shape: the resolved selection and the model's row shapes.
        max_graph_batch: the largest decode CUDA-graph batch (SGLang's ``max_bs``).
        sink / run_id: where records go, and their ``model_id``.
        device: the scheduler's device (``"cuda:N"``).
        max_prefill_tokens: SGLang's ``chunked_prefill_size`` (startup check).
        max_requests: most requests in one forward (startup check).
        linger_us: ``DMX_DRAIN_LINGER_US``.
        gil_slice_us: ``DMX_DRAIN_GIL_SLICE_US``.
        window_mb: ``DMX_DRAIN_WINDOW_MB``.
        arena_slots_mb: ``DMX_ARENA_SLOTS_MB``.
        copy_piece_mb: ``DMX_DRAIN_COPY_PIECE_MB``.
        copy_ahead: ``DMX_DRAIN_COPY_AHEAD``.
        copy_kernel: ``DMX_DRAIN_COPY_KERNEL``.
        copy_gaps: ``DMX_DRAIN_COPY_GAPS``.
        topk_chunk: ``DMX_TOPK_CHUNK``.
        topk_kernel: ``DMX_TOPK_KERNEL``.
        side_stream: ``DMX_GRAPH_SIDE_STREAM`` (an engine's default is 1): True only for a
            model that calls the capturer's ``join`` where it changes a captured residual
            in place and at its forward's end (see ``TransportOptions.side_stream``).

    Raises:
        CapacityError: the ring is smaller than one capture tensor can be.
    """
    return TorchCaptureTransport(
        capacity=RingCapacity.from_mb(payload_mb, pinned_mb, task_entries),
        selection=selection,
        shape=shape,
        max_graph_batch=max_graph_batch,
        sink=sink,
        run_id=run_id,
        device=device,
        options=TransportOptions.from_settings(
            strip=padding_strip,
            flush_timeout_us=flush_timeout_us,
            max_prefill_tokens=max_prefill_tokens,
            max_requests=max_requests,
            linger_us=linger_us,
            gil_slice_us=gil_slice_us,
            window_mb=window_mb,
            arena_slots_mb=arena_slots_mb,
            copy_piece_mb=copy_piece_mb,
            copy_ahead=copy_ahead,
            copy_kernel=copy_kernel,
            copy_gaps=copy_gaps,
            topk_chunk=topk_chunk,
            topk_kernel=topk_kernel,
            side_stream=side_stream,
        ),
    )
