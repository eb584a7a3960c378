"""``final_logits:topk(K)``'s selection by FlashInfer's radix top-k (``flashinfer.top_k``).

:func:`~dmi_sglang.adapters.transport.topk.chunked_topk` still sorts: ``torch.topk`` over
the chunk maxima, then over the chosen chunks' columns, each a sort a row whose time is
bound by latency, not by the bytes read (about 120 µs of an H100 for a decode batch of 64
rows of Qwen3's 151,936 logits, where reading them takes about 12 µs).
FlashInfer, which SGLang installs with itself, selects by the values' bits instead (a
radix select: a few passes over each row, by one or several thread blocks, the method
chosen by the number of rows), then sorts the ``k`` selected. NaN ranks as its bits do:
one with the sign bit clear (what a GPU's arithmetic makes) above every number, as in
``torch.topk``; one with the sign bit set (a NaN negated) below every number, where
``torch.topk`` ranks every NaN first. :func:`flashinfer_topk` calls it with the values
sorted, largest first, as ``chunked_topk`` returns them. FlashInfer compiles the kernel
on first use (its JIT, cached under ``~/.cache/flashinfer``), so :func:`warm_up` runs it
once, and checks it, before a capture records it in a graph.
``python -m harness topk`` measures it against the other selections on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from dmi_sglang.adapters.transport.topk import CheckTimeoutError, selection_differs

__all__ = ["flashinfer_topk", "warm_up"]


def _module() -> Any:
    import flashinfer  # GPU installs only (with SGLang)

    return flashinfer


def flashinfer_topk(logits: torch.Tensor, k: int, chunk: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k, dim=-1)`` of a 2-D CUDA tensor by ``flashinfer.top_k``: the
    same values, largest first, and the int64 columns holding them (a tie may name
    another of the tied columns, as ``torch.topk`` may). ``chunk`` is accepted and unused,
    so that every selection takes the same arguments.

    Raises:
        ValueError: ``logits`` is not 2-D or ``k`` is not in ``1..columns``.
    """
    del chunk
    if logits.dim() != 2 or not 1 <= k <= logits.shape[1]:
        msg = (f"flashinfer_topk: k={k} over logits of shape {tuple(logits.shape)}; "
               "expected [rows, columns] and k from 1 to the columns")
        raise ValueError(msg)
    values, ids = _module().top_k(logits.contiguous(), k, sorted=True)
    return values, ids


def warm_up(device: torch.device, width: int, k: int, *, dtype: torch.dtype = torch.float32,
            batches: tuple[int, ...] = (3,)) -> str | None:
    """Import FlashInfer, compile its top-k for rows of ``width`` ``dtype`` logits and
    check it on ``device`` over batches of ``batches`` rows (FlashInfer chooses its method
    by the number of rows:
    :func:`~dmi_sglang.adapters.transport.topk.selection_differs`); None when it works,
    else why not.

    Raises:
        CheckTimeoutError: its kernels did not finish on the device (it is not usable after).
    """
    try:
        return selection_differs(flashinfer_topk, device, width, k, dtype=dtype,
                                 batches=batches)
    except CheckTimeoutError:
        raise
    except Exception as exc:  # an ImportError, or FlashInfer's compiler's error
        return f"{type(exc).__name__}: {exc}"
