"""The decode-graph arena: one device buffer with a fixed slot per selected capture.

A decode CUDA graph replays fixed addresses with new values. During graph capture each
capture point records a copy of its tensor into its slot; every captured graph (one per
batch bucket) writes the same slots, so one arena sized for the largest decode batch
serves them all. After a replay, :mod:`._program` copies the real rows out to the ring.

Slots are laid out the way :func:`~dmi_sglang.domain.plan.make_plan` lays out ring
segments (grouped by row size, then in firing order), so a group of equal-width slots
and the matching group of ring segments are both equally spaced: one strided copy moves
the whole group.
"""

from __future__ import annotations

import math

import torch

from dmi_sglang.adapters.transport._device import TORCH_DTYPES, DeviceOps
from dmi_sglang.domain.hooks import Selection
from dmi_sglang.domain.plan import align_up
from dmi_sglang.domain.shapes import ModelShape, RowSpec
from dmi_sglang.errors import CaptureError

__all__ = ["Arena", "CaptureKey", "as_rows", "check_dtype"]

CaptureKey = tuple[str, int]
"""``(hook short name, layer_no)``; ``layer_no = -1`` for global hooks."""


def as_rows(tensor: torch.Tensor, key: CaptureKey, row: RowSpec) -> torch.Tensor:
    """``tensor`` viewed as ``[rows, elements per row]``, checked against the row spec.

    Raises:
        CaptureError: the dtype or the row width differs from what the plan stores.
    """
    check_dtype(key, tensor, TORCH_DTYPES[row.dtype])
    rows = tensor.shape[0] if tensor.dim() else 1
    width = math.prod(row.dims)
    if tensor.numel() != rows * width:
        msg = (
            f"capture {key}: tensor shape {tuple(tensor.shape)} does not hold rows of "
            f"{row.dims} elements"
        )
        raise CaptureError(msg)
    return tensor.reshape(rows, width)


def check_dtype(key: CaptureKey, tensor: torch.Tensor, expected: torch.dtype) -> None:
    """Raise unless ``tensor`` is in the planned dtype (before a payload cast, the dtype
    the capture is computed in).

    Raises:
        CaptureError: another dtype.
    """
    if tensor.dtype != expected:
        msg = f"capture {key}: tensor dtype {tensor.dtype} differs from the planned {expected}"
        raise CaptureError(msg)


class Arena:
    """One device buffer holding a slot of ``max_rows`` rows per selected capture.

    Args:
        selection: the resolved selection (every ``(hook, layer)`` gets a slot).
        shape: the model's row shapes.
        max_rows: rows per slot: the largest decode-graph batch.
        ops: the device primitives.
        alignment: slot alignment in bytes.
    """

    def __init__(
        self,
        selection: Selection,
        shape: ModelShape,
        max_rows: int,
        ops: DeviceOps,
        alignment: int = 16,
    ) -> None:
        captures = selection.captures()
        rows = [shape.capture_row(selection, hook, layer_no) for hook, layer_no in captures]
        order = sorted(range(len(captures)), key=lambda i: rows[i].nbytes)
        self.max_rows = max_rows
        self.rows_spec: dict[CaptureKey, RowSpec] = {}
        self.offsets: dict[CaptureKey, int] = {}
        offset = 0
        for i in order:
            hook, layer_no = captures[i]
            key = (hook.name, layer_no)
            row = rows[i]
            self.rows_spec[key] = row
            self.offsets[key] = offset
            offset += align_up(max_rows * row.nbytes, alignment)
        self.nbytes = offset
        self.buffer = ops.device_buffer(align_up(max(offset, 16), 16))
        self._views: dict[CaptureKey, torch.Tensor] = {}
        for key, row in self.rows_spec.items():
            start = self.offsets[key]
            raw = self.buffer[start : start + max_rows * row.nbytes]
            self._views[key] = raw.view(TORCH_DTYPES[row.dtype]).view(
                max_rows, math.prod(row.dims)
            )
        self.written: dict[CaptureKey, int] = {}
        """Most rows each slot has been written with (checked before a replay is sealed)."""

    def __contains__(self, key: object) -> bool:
        return key in self._views

    def view(self, key: CaptureKey) -> torch.Tensor:
        """The slot of ``key`` as ``[max_rows, elements per row]`` in its dtype."""
        return self._views[key]

    def write(self, key: CaptureKey, tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s rows into the slot (recorded into the graph when capturing).

        Raises:
            CaptureError: more rows than the largest decode batch, or a wrong dtype/width.
        """
        src = as_rows(tensor, key, self.rows_spec[key])
        rows = src.shape[0]
        if rows > self.max_rows:
            msg = (
                f"capture {key}: {rows} rows exceed the arena's {self.max_rows} "
                f"(the largest decode-graph batch the transport was created for)"
            )
            raise CaptureError(msg)
        if rows:
            self._views[key][:rows].copy_(src)
        if rows > self.written.get(key, 0):
            self.written[key] = rows
