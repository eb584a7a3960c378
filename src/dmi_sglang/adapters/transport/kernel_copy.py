"""Device-to-host copies by the GPU's cores instead of its copy engine.

A copy engine runs the device-to-host copies of all streams in turn, and another stream's
copy queued while the drain's copies keep it busy waits until they run out (measured on
the H200 with ``python -m harness copies``): SGLang's scheduler waits each step for such
a small copy (the sampled tokens). :func:`kernel_copy` moves the bytes with a Triton
kernel that loads device memory and stores into page-locked host memory, which kernels
reach through unified addressing, leaving the copy engine to everyone else
(``DMX_DRAIN_COPY_KERNEL``).

Triton is imported on first use (it comes with SGLang and torch's GPU builds); with
``TRITON_INTERPRET=1`` set before that, the kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dmi_sglang.errors import UnsupportedConfigurationError

BLOCK = 1024
"""Elements one program moves per iteration of its loop."""


@functools.cache
def _compiled() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])  # type: ignore[untyped-decorator]
    def copy_kernel(src: Any, dst: Any, n: Any, block: tl.constexpr) -> None:
        first = tl.program_id(0) * block
        stride = tl.num_programs(0) * block
        for lo in range(first, n, stride):
            offs = lo + tl.arange(0, block)
            inside = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=inside), mask=inside)

    return copy_kernel


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the widest elements (8, 4, 2 or 1 bytes) that divide its size."""
    flat = t.view(-1).view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if flat.numel() % dtype.itemsize == 0 and flat.data_ptr() % dtype.itemsize == 0:
            return flat.view(dtype)
    return flat


def kernel_copy(dst: torch.Tensor, src: torch.Tensor, programs: int) -> None:
    """Queue ``dst.copy_(src)`` as ``programs`` kernel programs on the current stream.

    ``src`` and ``dst`` are contiguous with equal byte sizes; ``dst`` may be page-locked
    host memory (a kernel cannot reach pageable memory). The copy is stream-ordered as
    ``copy_(non_blocking=True)`` is: wait for an event recorded after it before reading
    ``dst``. Raises ``ValueError`` naming what is wrong otherwise.
    """
    if programs < 1:
        raise ValueError(f"programs={programs}: expected an integer >= 1")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("kernel_copy: src and dst must be contiguous")
    nbytes = src.numel() * src.element_size()
    if nbytes != dst.numel() * dst.element_size():
        raise ValueError(f"kernel_copy: {nbytes} bytes of src, "
                         f"{dst.numel() * dst.element_size()} of dst: expected equal sizes")
    if nbytes == 0:
        return
    s, d = _words(src), _words(dst)
    if s.dtype != d.dtype:  # different alignments: move bytes
        s, d = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    _compiled()[(programs,)](s, d, s.numel(), block=BLOCK)


def warm_up(device: torch.device, programs: int) -> None:
    """Compile the kernel for the drain's usual copies (8-byte words, at 16-byte-aligned
    and at 8-byte-offset addresses) and check what it copies, before the first flush
    needs it: a Triton missing, or one that cannot reach page-locked memory here, fails
    now with :class:`~dmi_sglang.errors.UnsupportedConfigurationError` naming the setting,
    not in the drain's thread mid-run. On CPU (Triton's interpreter) host memory stands in
    for page-locked memory."""
    try:
        src = torch.arange(1, 66, dtype=torch.int64, device=device)
        host = torch.zeros(65, dtype=torch.int64, pin_memory=device.type == "cuda")
        for lo in (0, 1):
            kernel_copy(host[lo:lo + 64], src[lo:lo + 64], programs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if not torch.equal(host[lo:lo + 64], src[lo:lo + 64].cpu()):
                raise RuntimeError("the bytes copied differ from the source")
            host.zero_()
    except Exception as exc:  # an ImportError, Triton's own, or the check above
        reason = (f"DMX_DRAIN_COPY_KERNEL={programs}: the drain's copy kernel does not work "
                  f"on {device} ({type(exc).__name__}: {exc}); set DMX_DRAIN_COPY_KERNEL=0 "
                  "to copy with the copy engine")
        raise UnsupportedConfigurationError((reason,)) from exc
