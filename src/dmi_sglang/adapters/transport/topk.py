"""The largest ``k`` logits of each row, in two stages over chunks of the row.

``torch.topk`` over a decode batch's logits (``[64, 151936]`` float32 for Qwen3) runs a
radix select per row: few rows, each long, which keeps much of a large GPU idle. Cut each
row into chunks and the same selection runs on many short slices at once: the top ``k``
of every chunk first, then the top ``k`` of those candidates. Every value of a row's top
``k`` is among its chunk's top ``k``, so the second stage finds the same values (as a
multiset: where values tie, which of the tied positions is named may differ from
``torch.topk``'s choice, which is unspecified there too). NaN ranks above every number,
as in ``torch.topk``. Shapes depend only on the input's, so the result can be recorded in a
CUDA graph.

``python -m harness topk`` measures it against ``torch.topk`` on the GPU.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_topk"]


def chunked_topk(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k, dim=-1)`` (largest, sorted) of a 2-D tensor, computed over
    chunks of ``chunk`` columns; ``chunk`` 0, or rows of at most two chunks or a chunk
    no longer than ``k``, take ``torch.topk`` directly.

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
    if chunk == 0 or chunk <= k or width <= 2 * chunk:
        return torch.topk(logits, k, dim=-1)
    groups = width // chunk
    body = logits[:, : groups * chunk].reshape(rows, groups, chunk)
    values, ids = torch.topk(body, k, dim=-1, sorted=False)  # [rows, groups, k]
    starts = torch.arange(0, groups * chunk, chunk, device=logits.device).view(1, groups, 1)
    values, ids = values.reshape(rows, groups * k), (ids + starts).reshape(rows, groups * k)
    tail = width - groups * chunk
    if tail:  # the columns after the last whole chunk: candidates of their own
        tail_values, tail_ids = torch.topk(logits[:, groups * chunk:], min(k, tail), dim=-1,
                                           sorted=False)
        values = torch.cat((values, tail_values), dim=1)
        ids = torch.cat((ids, tail_ids + groups * chunk), dim=1)
    top, picked = torch.topk(values, k, dim=-1)
    return top, torch.gather(ids, 1, picked)
