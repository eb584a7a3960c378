"""Device-to-host copies by the GPU's cores instead of its copy engine.

A copy engine runs the device-to-host copies of all streams in turn, and another stream's
copy queued while the drain's copies keep it busy waits until they run out (measured on
the H200 with ``python -m harness copies``): SGLang's scheduler waits each step for such
a small copy (the sampled tokens). :func:`kernel_copy` moves the bytes with a Triton
kernel that loads device memory and stores into page-locked host memory, which kernels
reach through unified addressing, leaving the copy engine to everyone else
(``DMX_DRAIN_COPY_KERNEL``). Its programs hold a few of the GPU's cores while it runs.

Triton is imported on first use (it comes with SGLang and torch's GPU builds); with
``TRITON_INTERPRET=1`` set before that, the kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from dmi_sglang.errors import UnsupportedConfigurationError

BLOCK_BYTES = 8192
"""Bytes one program moves per iteration of its loop (whatever the word size)."""

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
"""The element types the kernel moves bytes as, widest first."""

LAUNCH_ELEMENTS = 1 << 30
"""The most words one launch moves: a larger copy goes as several launches, so the size
argument is always a 32-bit integer (one compiled kernel per word type and alignment)."""


@functools.cache
def _compiled() -> Any:
    import triton
    import triton.language as tl

    # n is not specialised (one compiled kernel whatever the size); the pointers are, on
    # 16-byte alignment, where the full blocks become vector loads and stores
    @triton.jit(do_not_specialize=["n"])  # type: ignore[untyped-decorator]
    def copy_kernel(src, dst, n, block: tl.constexpr):  # type: ignore[no-untyped-def]
        # unannotated pointers: what every Triton version reads the same way
        # 64-bit offsets: nothing wraps, whatever the grid
        pid = tl.program_id(0).to(tl.int64)
        stride = tl.num_programs(0).to(tl.int64) * block
        full = (n.to(tl.int64) // block) * block
        for lo in range(pid * block, full, stride):  # whole blocks: no mask
            offs = lo + tl.arange(0, block)
            tl.store(dst + offs, tl.load(src + offs))
        offs = full + tl.arange(0, block)  # the tail, by the first program
        inside = (offs < n) & (pid == 0)
        tl.store(dst + offs, tl.load(src + offs, mask=inside), mask=inside)

    return copy_kernel


def word(nbytes: int, *addresses: int) -> torch.dtype:
    """The widest of :data:`WORDS` whose size divides ``nbytes`` and every address."""
    return next(w for w in WORDS
                if all(v % w.itemsize == 0 for v in (nbytes, *addresses)))


def kernel_copy(dst: torch.Tensor, src: torch.Tensor, programs: int) -> None:
    """Queue ``dst.copy_(src)`` as ``programs`` kernel programs on the current stream.

    ``src`` and ``dst`` are contiguous, of one dtype and size; ``dst`` may be page-locked
    host memory (a kernel cannot reach pageable memory). The copy is stream-ordered as
    ``copy_(non_blocking=True)`` is: wait for an event recorded after it before reading
    ``dst``. Raises ``ValueError`` naming what is wrong otherwise.
    """
    if programs < 1:
        raise ValueError(f"programs={programs}: expected an integer >= 1")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("kernel_copy: src and dst must be contiguous")
    if src.dtype != dst.dtype or src.numel() != dst.numel():
        raise ValueError(f"kernel_copy: {src.numel()} {src.dtype} from src, {dst.numel()} "
                         f"{dst.dtype} into dst: expected one dtype and size")
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        return
    w = word(nbytes, src.data_ptr(), dst.data_ptr())
    s, d = src.view(-1).view(torch.uint8).view(w), dst.view(-1).view(torch.uint8).view(w)
    kernel, block = _compiled(), BLOCK_BYTES // w.itemsize
    for lo in range(0, s.numel(), LAUNCH_ELEMENTS):  # offsets keep the 16-byte alignment
        hi = min(lo + LAUNCH_ELEMENTS, s.numel())
        kernel[(programs,)](s[lo:hi], d[lo:hi], hi - lo, block=block)


def warm_up(device: torch.device, programs: int) -> None:
    """Compile the kernel for every word type and pointer alignment and check what it
    copies (nothing outside the destination either), before the first
    flush needs it: a Triton missing, or one that cannot reach page-locked memory here,
    fails now with :class:`~dmi_sglang.errors.UnsupportedConfigurationError` naming the
    setting, not in the drain's thread mid-run (where compiling would also hold the GIL
    beside the scheduler). On CPU (Triton's interpreter) host memory stands in for
    page-locked memory."""
    cuda = device.type == "cuda"
    try:
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            src = torch.arange(1, 97, dtype=torch.uint8, device=device)
            host = torch.zeros(96, dtype=torch.uint8, pin_memory=cuda)
            for w in WORDS:  # 8-, 4-, 2- and 1-byte words, each pointer aligned or not
                size = w.itemsize
                nbytes = 64 if size == 8 else 64 - size  # no wider word divides it
                for at_src, at_dst in ((0, 0), (0, size), (size, 0), (size, size)):
                    if word(nbytes, at_src, at_dst) != w:  # the buffers are aligned
                        raise RuntimeError(f"the warm-up meant {w}, got another word")
                    kernel_copy(host[at_dst:at_dst + nbytes], src[at_src:at_src + nbytes],
                                programs)
                    if cuda:
                        torch.cuda.synchronize(device)
                    expected = torch.zeros(96, dtype=torch.uint8)
                    expected[at_dst:at_dst + nbytes] = src[at_src:at_src + nbytes].cpu()
                    if not torch.equal(host, expected):  # nothing before or after either
                        raise RuntimeError(f"the bytes copied as {w} differ from the source")
                    host.zero_()
    except Exception as exc:  # an ImportError, Triton's own, or the check above
        reason = (f"DMX_DRAIN_COPY_KERNEL={programs}: the drain's copy kernel does not work "
                  f"on {device} ({type(exc).__name__}: {exc}); set DMX_DRAIN_COPY_KERNEL=0 "
                  "to copy with the copy engine")
        raise UnsupportedConfigurationError((reason,)) from exc
