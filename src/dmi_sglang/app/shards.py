"""From stored records to one capture's tensor: each part's rows decoded
(:func:`decode_rows`), and under tensor parallelism the parts combined (:func:`combine`).

:mod:`dmi_sglang.domain.tensor_parallel` says, per hook, how many parts a run stored
(``shard_rank`` 0 .. parts-1) and how they combine, so a TP=2 capture reads back in the
shapes a TP=1 capture has (:func:`combined_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dmi_sglang.app.assemble import joined_rows, select_rows
from dmi_sglang.domain.ports import RowLayout
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.domain.shapes import DType
from dmi_sglang.domain.tensor_parallel import ShardPlan, TpRule
from dmi_sglang.errors import IncompleteCaptureError, StoreError

if TYPE_CHECKING:
    import torch

__all__ = ["by_shard", "combine", "combined_rows", "decode_rows"]


def by_shard(records: Sequence[CaptureRecord], plan: ShardPlan,
             what: str) -> list[list[CaptureRecord]]:
    """``records`` of one capture split by ``shard_rank``, one list per stored part.

    Raises:
        StoreError: a record of a shard the run's plan does not store (``what`` names the
            capture in the message).
        IncompleteCaptureError: a part with no record.
    """
    parts: list[list[CaptureRecord]] = [[] for _ in range(plan.parts)]
    for r in records:
        if not 0 <= r.shard_rank < plan.parts:
            msg = (f"{what}: a record of shard_rank {r.shard_rank}, but the run stores "
                   f"{plan.parts} part(s) of it ({plan.rule.value})")
            raise StoreError(msg)
        parts[r.shard_rank].append(r)
    empty = [k for k, p in enumerate(parts) if not p]
    if empty and records:
        msg = (f"{what}: nothing stored of shard_rank {empty} ({plan.rule.value}, "
               f"{plan.parts} parts)")
        raise IncompleteCaptureError(msg)
    return parts


def combine(plan: ShardPlan, parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """The whole tensor from its parts (in ``shard_rank`` order): the one part of a
    replicated hook, the parts concatenated along ``plan.axis`` for a sharded one, their
    sum (in float32, in part order, cast back to the stored dtype) for a partial one.

    Raises:
        StoreError: a part count other than ``plan.parts``, or parts of different dtypes or
            shapes (SGLang splits evenly: equal parts), ``what`` naming the capture.
    """
    import torch

    if len(parts) != plan.parts:
        msg = f"{what}: {len(parts)} part(s) where the run stores {plan.parts}"
        raise StoreError(msg)
    first = parts[0]
    if plan.rule is TpRule.REPLICATED:
        return first
    # equal parts: SGLang splits a sharded axis evenly
    axis_ok = plan.rule is not TpRule.SHARDED or first.dim() > plan.axis
    if not axis_ok or any(p.dtype != first.dtype or p.shape != first.shape for p in parts):
        shapes = ", ".join(f"{p.dtype} {list(p.shape)}" for p in parts)
        msg = f"{what}: {plan.rule.value} parts that do not combine: {shapes}"
        raise StoreError(msg)
    if plan.rule is TpRule.SHARDED:
        return torch.cat(list(parts), dim=plan.axis)
    if not first.is_floating_point():
        msg = f"{what}: a partial sum of {first.dtype} rows; partial hooks are floating point"
        raise StoreError(msg)
    total = first.to(torch.float32, copy=True)
    for p in parts[1:]:
        total += p.to(torch.float32)
    return total.to(first.dtype)


def combined_rows(records: Sequence[CaptureRecord], positions: range, plan: ShardPlan,
              act_name: str, layer_no: int) -> torch.Tensor:
    """The rows of ``positions`` of one capture (every record of it that may hold them):
    each stored part's rows (:func:`decode_rows`), combined as the run's tensor-parallel
    plan says (one part at TP=1).

    Raises:
        IncompleteCaptureError: a position or a part not stored.
        StoreError: records or parts that do not fit together.
    """
    if not positions:
        return decode_rows(records, positions)
    what = f"{act_name} layer {layer_no}"
    parts = by_shard(records, plan, what)
    if plan.parts == 1:
        return decode_rows(parts[0], positions)
    return combine(plan, [decode_rows(p, positions) for p in parts], what)


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a record's ``dtype`` column names."""
    import torch

    dtype: torch.dtype = getattr(torch, DType.parse(name).value.removeprefix("torch."))
    return dtype


def empty_rows(layout: RowLayout | None, plan: ShardPlan, what: str) -> torch.Tensor:
    """No rows of one capture, shaped ``[0, *row shape]`` in its stored dtype as its
    parts (one ``layout``) combine; ``[0]`` when nothing of it was stored (no layout).

    Raises:
        StoreError: a layout whose parts cannot combine as the plan says.
    """
    import torch

    if layout is None:
        return torch.empty((0,))
    part = torch.empty((0, *layout.row_shape), dtype=_torch_dtype(layout.dtype))
    return part if plan.parts == 1 else combine(plan, [part] * plan.parts, what)


def decode_rows(records: Sequence[CaptureRecord], positions: range) -> torch.Tensor:
    """The rows of ``positions`` in ``records`` (one part of one capture; per position the
    latest record's row) as one tensor that owns its memory.

    Raises:
        IncompleteCaptureError: a position no record holds.
        StoreError: records whose dtypes or row shapes differ, or whose payloads do not
            fit their shapes.
    """
    import torch

    if not positions:
        return torch.empty((0,))
    slices = select_rows(records, positions)
    first = records[slices[0].index]
    trailing, dtype_name = first.shape[1:], first.dtype
    itemsize = DType.parse(dtype_name).itemsize
    row_size = itemsize * math.prod(trailing)
    for s in slices:
        r = records[s.index]
        if r.shape[1:] != trailing or DType.parse(r.dtype) is not DType.parse(dtype_name):
            msg = (
                f"{r.act_name} layer {r.layer_no}: rows stored as {r.dtype} "
                f"{list(r.shape)} and {dtype_name} {[r.rows, *trailing]} cannot be joined"
            )
            raise StoreError(msg)
    buf = joined_rows(records, slices, row_size)
    dtype = _torch_dtype(dtype_name)
    flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty((0,), dtype=dtype)
    return flat.reshape(len(positions), *trailing).clone()
