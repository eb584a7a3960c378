"""A copy by the GPU's cores instead of its copy engine: a Triton kernel that loads device
memory and stores it into page-locked host memory (reachable from kernels through unified
addressing), used by ``python -m harness copies`` to see whether such copies leave the
copy engine free for another stream's small copies.

Triton is imported on first use (it comes with SGLang and torch's GPU builds); with
``TRITON_INTERPRET=1`` set before that, the kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 1024
"""Elements one program moves per iteration of its loop."""


@functools.cache
def _compiled() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
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


def sm_copy(dst: torch.Tensor, src: torch.Tensor, programs: int) -> None:
    """Queue ``dst.copy_(src)`` as ``programs`` kernel programs on the current stream.

    ``src`` and ``dst`` are contiguous with equal byte sizes; ``dst`` may be page-locked
    host memory. Raises ``ValueError`` naming what is wrong otherwise.
    """
    if programs < 1:
        raise ValueError(f"programs={programs}: expected an integer >= 1")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("sm_copy: src and dst must be contiguous")
    nbytes = src.numel() * src.element_size()
    if nbytes != dst.numel() * dst.element_size():
        raise ValueError(f"sm_copy: {nbytes} bytes of src, "
                         f"{dst.numel() * dst.element_size()} of dst: expected equal sizes")
    if nbytes == 0:
        return
    s, d = _words(src), _words(dst)
    if s.dtype != d.dtype:  # different alignments: move bytes
        s, d = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    _compiled()[(programs,)](s, d, s.numel(), block=BLOCK)
