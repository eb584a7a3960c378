"""The largest ``k`` logits of each row, found in the ``k`` chunks with the largest maxima.

``torch.topk`` over a decode batch's logits (``[64, 151936]`` float32 for Qwen3) runs a
radix select per row, several passes over every value: about 170 µs of an H100 a decode
step, against a stock step of about 3 ms. Cut each row into chunks of ``chunk`` columns
and take each chunk's maximum (one pass, as fast as the memory reads); the ``k`` chunks
with the largest maxima, plus the columns after the last whole chunk, hold every value of
the row's top ``k``, so ``torch.topk`` needs to run only over the chunk maxima and then
over those ``k`` chunks.

Why those chunks suffice: let ``m`` be the ``k``-th largest chunk maximum and ``v`` any of
the row's top ``k`` values. If ``v <= m``, the ``k`` chosen chunks' maxima are ``k``
candidates no smaller than ``v``. If ``v > m``, no chunk left out holds a value as large as
``v``, so every value at least ``v`` is a candidate. Either way the candidates' ``j``-th
largest equals the row's, for every ``j <= k``: the same values, largest first (where
values tie, which of the tied positions is named may differ from ``torch.topk``'s choice,
which is unspecified there too). NaN ranks above every number, in the maxima as in
``torch.topk``. Zeros of either sign are equal as numbers: where a top value is zero, the
sign stored may differ from ``torch.topk``'s (a chunk's ``amax`` may return either).
Shapes depend only on the input's, so the result can be recorded in a CUDA graph. Where
those chunks would be half the row or more (a large ``k``), the maxima save no pass and
``torch.topk`` runs over the whole row.

``python -m harness topk`` measures it against ``torch.topk`` on the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["CHECK_TIMEOUT_S", "CheckTimeoutError", "Select", "chunked_topk", "selection_differs",
           "wait_until", "widest_chunk"]

CHECK_TIMEOUT_S = 60.0
"""How long a selection checked on a GPU may take to finish, once it was queued (its
compile comes before: a first use may compile for minutes). Its kernels take
microseconds; one that has not finished by then waits for something that will not
come (a kernel whose thread blocks wait for each other)."""


class CheckTimeoutError(TimeoutError):
    """A checked selection did not finish on the device in time: the device is not
    usable after it (the kernel may still be running)."""

Select = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
"""A top-k selection: ``(logits, k, chunk)`` to the values, largest first, and their
int64 columns, ``[rows, k]`` each."""


def widest_chunk(width: int, k: int) -> int:
    """The widest chunk :func:`chunked_topk` searches a row of ``width`` columns in for
    its ``k`` largest: the row must hold more than ``k`` whole chunks, and ``k`` chunks
    must be less than half of it; a wider chunk takes ``torch.topk`` (0: every width)."""
    return min(width // (k + 1), width // (2 * k))


def chunked_topk(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k, dim=-1)`` (largest, sorted) of a 2-D tensor, searched in
    the ``k`` chunks of ``chunk`` columns with the largest maxima (and the columns after
    the last whole chunk); ``chunk`` 0, rows of no more than ``k`` whole chunks, and
    ``k`` chunks of half the row or more take ``torch.topk`` directly.

    Returns:
        The values (sorted, largest first) and their int64 column indices,
        ``[rows, k]`` each.

    Raises:
        ValueError: ``logits`` is not 2-D, ``k`` is not in ``1..columns`` or ``chunk``
            is negative.
    """
    if logits.dim() != 2:
        msg = f"chunked_topk: logits of shape {tuple(logits.shape)}; expected [rows, columns]"
        raise ValueError(msg)
    rows, width = logits.shape
    if not 1 <= k <= width:
        msg = f"chunked_topk: k={k}; expected 1 to the {width} columns"
        raise ValueError(msg)
    if chunk < 0:
        msg = f"chunked_topk: chunk={chunk}; expected 0 (no chunks) or a positive width"
        raise ValueError(msg)
    if not chunk or chunk > widest_chunk(width, k):
        return torch.topk(logits, k, dim=-1)
    groups = width // chunk
    body = logits[:, : groups * chunk].reshape(rows, groups, chunk)
    _, best = torch.topk(body.amax(dim=-1), k, dim=-1, sorted=False)  # [rows, k] chunks
    candidates = torch.gather(body, 1, best.unsqueeze(-1).expand(rows, k, chunk))
    candidates = candidates.reshape(rows, k * chunk)
    tail = width - groups * chunk
    if tail:  # the columns after the last whole chunk are candidates of their own
        candidates = torch.cat((candidates, logits[:, groups * chunk:]), dim=1)
    top, picked = torch.topk(candidates, k, dim=-1)
    in_chunks = picked < k * chunk
    slot = torch.where(in_chunks, picked, 0)
    columns = torch.gather(best, 1, slot // chunk) * chunk + slot % chunk
    return top, torch.where(in_chunks, columns, picked - k * chunk + groups * chunk)


def selection_differs(select: Select, device: torch.device, width: int, k: int, *,
                      chunk: int = 0, dtype: torch.dtype = torch.float32,
                      batches: tuple[int, ...] = (3,)) -> str | None:
    """Run ``select`` over batches of ``batches`` rows (each at least 3) of ``width``
    ``dtype`` logits on ``device``, and compare it with ``torch.topk`` over the rows'
    float32 image (CUDA's bfloat16 top-k can drop a NaN: seen on an H100): None when the
    values are the same and the columns hold them, else what differs. Every batch
    begins with three rows of ties (values rounded), of a NaN and an infinity among
    them, and of minus infinities but one zero; its other rows are random. A kernel may
    choose its method by the number of rows: check each number it will see. Exceptions
    of ``select`` propagate.

    Raises:
        CheckTimeoutError: on a GPU, a batch's selection did not finish within
            :data:`CHECK_TIMEOUT_S` of being queued.
    """
    for batch in batches:
        failed = _batch_differs(select, device, width, k, chunk=chunk, dtype=dtype,
                                batch=max(3, batch))
        if failed is not None:
            return f"{failed} (over {max(3, batch)} rows)"
    return None


def _batch_differs(select: Select, device: torch.device, width: int, k: int, *, chunk: int,
                   dtype: torch.dtype, batch: int) -> str | None:
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn((batch, width), generator=gen)
    rows[:3] = rows[:3].round(decimals=1)  # ties
    rows[1, width // 3] = float("nan")
    rows[1, min(5, width - 1)] = float("inf")
    rows[2, :] = float("-inf")
    rows[2, -1] = 0.0
    rows = rows.to(device=device, dtype=dtype)
    values, ids = select(rows, k, chunk)
    if device.type == "cuda":
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(device))  # where select queued its work
        if not wait_until(done.query, CHECK_TIMEOUT_S):
            msg = (f"its selection over {batch} rows of {width} did not finish on {device} "
                   f"within {CHECK_TIMEOUT_S:.0f} s")
            raise CheckTimeoutError(msg)
    expected = torch.topk(rows.float(), k, dim=-1).values.to(dtype)
    if not torch.equal(values.nan_to_num(), expected.nan_to_num()):
        return "its selection differs from torch.topk's"
    if not torch.equal(torch.gather(rows, 1, ids).nan_to_num(), values.nan_to_num()):
        return "its columns do not hold the values it returned"
    return None


def wait_until(done: Callable[[], bool], timeout_s: float, *, poll_s: float = 0.01,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> bool:
    """Ask ``done`` every ``poll_s`` until it says True (True) or ``timeout_s`` passed
    (False): a wait for the device that cannot hang with it.

    Raises:
        ValueError: ``poll_s`` is not above 0 (a wait that would spin).
    """
    if not poll_s > 0:
        msg = f"wait_until: poll_s={poll_s}; expected seconds above 0"
        raise ValueError(msg)
    deadline = clock() + timeout_s
    while not done():
        if clock() >= deadline:
            return False
        sleep(poll_s)
    return True
