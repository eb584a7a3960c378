"""The second half of :func:`~dmi_sglang.adapters.transport.topk.chunked_topk` in one
Triton kernel: from the chunk maxima to each row's ``k`` largest logits and their columns.

``chunked_topk`` takes each chunk's maximum in one pass (``amax``, as fast as the memory
reads), then runs about ten more kernels: ``torch.topk`` over the maxima, a gather of the
chosen chunks, ``torch.topk`` over those candidates and the arithmetic that turns a
candidate's place back into a column. Each is a launch of a few microseconds, and
``torch.topk``'s radix select makes several passes. :func:`fused_topk` makes the same
selection after ``amax`` in one launch, one program a row, in registers: every value
becomes a 64-bit key, its order-preserving 32-bit image above its column (the lower
column wins a tie, as one must), and a bitonic top-k (``tl.topk``) picks the ``K`` chunks
with the largest maxima (``K``: ``k`` rounded up to a power of two, at least 2; more chunks than
``k`` still hold every value of the top ``k``), then the ``K`` largest of their columns.
The values are read back from the logits at the columns found, so they are the logits'
own, NaN included (NaN ranks above every number, as in ``torch.topk``; zeros of either
sign are equal, as in :func:`~dmi_sglang.adapters.transport.topk.chunked_topk`).

It applies where :func:`fits` says so: a power-of-two chunk width, the rows holding at
least ``K`` whole chunks, and at most :data:`MAX_CANDIDATES` candidate columns and
:data:`MAX_MAXIMA` maxima a row (what one program holds in registers). Triton is imported
on first use; with ``TRITON_INTERPRET=1`` set before that, the kernel runs on CPU tensors
(the tests). ``python -m harness topk`` measures it on the GPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from dmi_sglang.adapters.transport.topk import CheckTimeoutError, selection_differs, widest_chunk

__all__ = ["MAX_CANDIDATES", "MAX_MAXIMA", "NEEDS", "compile_for", "fits", "fused_topk", "kernel",
           "launch_constants", "warm_up"]

MAX_CANDIDATES = 8192
"""Most candidate columns (``K`` chunks x the chunk width) one program sorts: 64 x 128 for
``topk(64)`` at the default width."""

MAX_MAXIMA = 8192
"""Most chunk maxima (plus one for the columns after the last whole chunk), rounded up
to a power of two, one program sorts: Qwen3's 151,936 columns make 1,187 chunks of 128
(2,048 once rounded)."""

NEEDS = (f"a power-of-two chunk width, more than k whole chunks a row and at least K (k "
         f"rounded up to a power of two, at least 2), k chunks at most half the row, at most "
         f"{MAX_CANDIDATES} candidate columns (K chunks) and at most {MAX_MAXIMA} chunk maxima "
         f"(rounded up to a power of two)")
"""What :func:`fits` asks of a shape, in words."""

_LOW = 0x7FFFFFFF  # a key's low word: _LOW - column, so that the lower column ranks higher


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rounded(k: int) -> int:
    # K: k rounded up to a power of two, at least 2 (Triton's top-k of one is not one)
    return max(2, _pow2(k))


def _warps(keys: int) -> int:
    # 16 keys a thread (the larger of the two sorts), from 4 to 16 warps: topk(64) over
    # Qwen3's logits takes 128 registers a thread at 16 warps with 128-column chunks, at
    # 8 with 64 (no spill; 226 registers at 8 warps with 128 columns)
    return max(4, min(16, keys // 512))


def fits(width: int, k: int, chunk: int) -> bool:
    """Whether :func:`fused_topk` selects the ``k`` largest of rows of ``width`` columns
    over chunks of ``chunk`` columns (see the module docstring)."""
    if chunk <= 0 or chunk & (chunk - 1) or not 1 <= k <= width or width > _LOW:
        return False
    rounded = _rounded(k)
    groups = width // chunk
    return (chunk <= widest_chunk(width, k) and groups >= rounded
            and rounded * chunk <= MAX_CANDIDATES and _pow2(groups + 1) <= MAX_MAXIMA)


@functools.cache
def kernel() -> Any:
    """The Triton kernel (a JIT function; importing Triton on the first call), for a
    compiler's view of it (``triton.compile``) with :func:`launch_constants`."""
    from dmi_sglang.adapters.transport import _topk_triton  # imports Triton

    return _topk_triton.topk_kernel


def launch_constants(width: int, k: int, chunk: int) -> dict[str, int]:
    """The kernel's compile-time constants for rows of ``width`` columns (``chunk``, the
    ``rounded`` K and the maxima's ``slots``) and the warps it is launched with
    (``num_warps``)."""
    rounded, slots = _rounded(k), _pow2(width // chunk + 1)
    return {"chunk": chunk, "rounded": rounded, "slots": slots,
            "num_warps": _warps(max(rounded * chunk, slots))}


def compile_for(width: int, k: int, chunk: int, dtype: torch.dtype = torch.float32,
                arch: int = 90) -> Any:
    """The kernel for rows of ``width`` ``dtype`` logits compiled for CUDA ``sm_<arch>``
    (90: the H100 and H200) as :func:`fused_topk` launches it, without a GPU: Triton's
    ``CompiledKernel``, whose ``asm`` holds the PTX and the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = launch_constants(width, k, chunk)
    warps = constants.pop("num_warps")
    word = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    ints = dict.fromkeys(("width", "row_stride", "groups", "k"), "i32")
    source = ASTSource(fn=kernel(), constexprs=constants, signature={
        "logits": f"*{word}", "maxima": f"*{word}", "values": f"*{word}", "ids": "*i64",
        **ints, **dict.fromkeys(constants, "constexpr")})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps})


def fused_topk(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_topk(logits, k, chunk)``: the same values, largest first, and the int64
    columns holding them, with the selection after the chunk maxima in one launch (a
    tie may name another of the tied columns, as ``torch.topk`` may). Shapes depend only
    on the input's, so the call can be recorded in a CUDA graph.

    Raises:
        ValueError: ``logits`` is not 2-D with contiguous rows, or the shape does not
            :func:`fit <fits>`.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        msg = (f"fused_topk: logits of shape {tuple(logits.shape)} and strides "
               f"{tuple(logits.stride())}; expected [rows, columns] with contiguous rows")
        raise ValueError(msg)
    rows, width = logits.shape
    if not fits(width, k, chunk):
        msg = f"fused_topk: k={k}, chunk={chunk} over {width} columns; expected {NEEDS}"
        raise ValueError(msg)
    groups = width // chunk
    maxima = logits[:, : groups * chunk].reshape(rows, groups, chunk).amax(dim=-1)
    values = torch.empty((rows, k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=logits.device)
    if rows:
        # launched on the logits' device, whichever is current
        with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
            kernel()[(rows,)](logits, maxima.contiguous(), values, ids, width,
                              logits.stride(0), groups, k, **launch_constants(width, k, chunk))
    return values, ids


def warm_up(device: torch.device, width: int, k: int, chunk: int, *,
            dtype: torch.dtype = torch.float32, batches: tuple[int, ...] = (3,)) -> str | None:
    """Compile the kernel for rows of ``width`` ``dtype`` logits, ``k`` and ``chunk``, and
    check it against ``torch.topk`` (over the rows in float32) on batches of ``batches``
    rows with ties, NaN and infinities
    (:func:`~dmi_sglang.adapters.transport.topk.selection_differs`), before a capture
    records it; None when it works, else why not (Triton missing, a compiler's error, or
    a selection that differs).

    Raises:
        CheckTimeoutError: its kernels did not finish on the device (it is not usable after).
    """
    try:
        return selection_differs(fused_topk, device, width, k, chunk=chunk, dtype=dtype,
                                 batches=batches)
    except CheckTimeoutError:
        raise
    except Exception as exc:  # an ImportError, or Triton's own
        return f"{type(exc).__name__}: {exc}"
