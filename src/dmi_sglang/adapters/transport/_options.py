"""Tuning of the capture transport, from plain settings."""

from __future__ import annotations

import attrs

from dmi_sglang.adapters.transport._copier import default_copy_threads

__all__ = ["TransportOptions"]

MIB = 1 << 20


@attrs.frozen
class TransportOptions:
    """Knobs of :class:`~dmi_sglang.adapters.transport.TorchCaptureTransport`.

    Attributes:
        strip: ``DMX_GPU_PADDING_STRIP``: plans are made with this flag (the transport
            follows each plan's own ``strip``; this value sizes the startup check).
        flush_timeout_s: ``DMX_DRAIN_FLUSH_TIMEOUT_US`` / 1e6: longest time a decode row
            waits in the coalescing window before it goes to the sink.
        stall_timeout_s: longest single wait for the drain; past it the transport fails
            (sticky) instead of hanging the scheduler forever.
        coalesce_decode: coalesce consecutive decode rows into one record per request,
            capture and run of positions (see ``_window``).
        coalesce_max_bytes: host bytes the coalescing window may hold (pageable memory,
            touched as rows arrive; up to two spare windows are kept for reuse). 1 GiB
            holds ~10 decode steps of ``sglang-full`` at batch 64 on Qwen3-0.6B (98 MB
            each): at 256 MiB it held 2, and the drain built ~11,000 records per step.
        max_prefill_tokens: most token rows one eager forward can hold (SGLang's
            ``chunked_prefill_size``); 0 means the largest decode batch. Startup check.
        max_requests: most requests one forward can hold (0: the largest decode batch).
        tune_host_malloc: raise glibc's trim/mmap thresholds so freed payload memory is
            reused instead of faulted in again (process-wide; see ``tune_host_malloc``).
        direct_copies: copy steps whose rows lie contiguous in the ring straight into
            payload memory (no staging copy on the host; see ``_drain``). Off only to
            compare.
        copy_threads: threads (the drain included) that copy a large decode step into
            the coalescing window; the default is a quarter of the cores, 1 to 4
            (``_copier``).
    """

    strip: bool = True
    flush_timeout_s: float = attrs.field(default=0.1, validator=attrs.validators.gt(0.0))
    stall_timeout_s: float = attrs.field(default=300.0, validator=attrs.validators.gt(0.0))
    coalesce_decode: bool = True
    coalesce_max_bytes: int = attrs.field(default=1024 * MIB, validator=attrs.validators.gt(0))
    max_prefill_tokens: int = 0
    max_requests: int = 0
    tune_host_malloc: bool = True
    direct_copies: bool = True
    copy_threads: int = attrs.field(factory=default_copy_threads,
                                    validator=attrs.validators.ge(1))

    @classmethod
    def from_settings(
        cls,
        *,
        strip: bool = True,
        flush_timeout_us: int = 100_000,
        copy_threads: int = 0,
        max_prefill_tokens: int = 0,
        max_requests: int = 0,
    ) -> TransportOptions:
        """From the ``DMX_GPU_PADDING_STRIP`` / ``DMX_DRAIN_FLUSH_TIMEOUT_US`` /
        ``DMX_DRAIN_COPY_THREADS`` (0: automatic) values."""
        return cls(
            strip=strip,
            flush_timeout_s=max(flush_timeout_us, 1) / 1e6,
            copy_threads=copy_threads or default_copy_threads(),
            max_prefill_tokens=max_prefill_tokens,
            max_requests=max_requests,
        )
