"""The decode-graph arena: one device buffer with a fixed place per selected capture, in
one or more copies (*slots*).

A decode CUDA graph replays fixed addresses with new values. During graph capture each
capture point records a copy of its tensor into its place; every captured graph (one per
batch bucket) writes the same places, so one arena sized for the largest decode batch
serves them all. After a replay, :mod:`._program` copies the real rows out to the ring.

With several slots the recorded copies write the slot that a one-element device index
names when the graph replays (:meth:`Arena.select` sets it before each replay, one
device copy), so the rows of a replayed step stay in their slot while later steps
replay into the others: the drain thread moves them to the ring, not the scheduler
thread (see the transport). One more slot, the *spare*, takes replays that no step
committed, and a step whose own slot still waits for the drain (``seal`` copies that
step out at once). With one slot the index is not used and the copies write the slot
directly.

The places of a slot are laid out the way :func:`~dmi_sglang.domain.plan.make_plan`
lays out ring segments (grouped by row size, then in firing order), so a group of
equal-width places and the matching group of ring segments are both equally spaced: one
strided copy moves the whole group.
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
    """One device buffer holding, per slot, a place of ``max_rows`` rows per selected
    capture.

    Args:
        selection: the resolved selection (every ``(hook, layer)`` gets a place).
        shape: the model's row shapes.
        max_rows: rows per place: the largest decode-graph batch.
        ops: the device primitives.
        alignment: place alignment in bytes.
        slots: slots steps are written to (see the module docstring); with more than
            one, a spare slot is added.
    """

    def __init__(
        self,
        selection: Selection,
        shape: ModelShape,
        max_rows: int,
        ops: DeviceOps,
        *,
        alignment: int = 16,
        slots: int = 1,
    ) -> None:
        if slots < 1:
            msg = f"an arena needs at least one slot, got {slots}"
            raise CaptureError(msg)
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
        """Bytes of one slot (before its alignment to 16)."""
        self.slots = slots
        self.slot_bytes = align_up(max(offset, 16), 16)
        """Distance between two slots in :attr:`buffer`."""
        self.spare = slots if slots > 1 else 0
        """The slot of replays no step committed (the only slot when there is one)."""
        allocated = slots + 1 if slots > 1 else 1
        self.buffer = ops.device_buffer(self.slot_bytes * allocated)
        self._views: dict[CaptureKey, torch.Tensor] = {}
        for key, row in self.rows_spec.items():
            item = TORCH_DTYPES[row.dtype].itemsize
            width = math.prod(row.dims)
            self._views[key] = self.buffer.view(TORCH_DTYPES[row.dtype]).as_strided(
                (allocated, max_rows, width), (self.slot_bytes // item, width, 1),
                self.offsets[key] // item)
        self._index: torch.Tensor | None = None
        """The slot the recorded copies write (several slots only)."""
        self._numbers: list[torch.Tensor] = []
        """One-element device tensors 0 .. spare, copied into :attr:`_index`."""
        if slots > 1:
            self._index = torch.full((1,), self.spare, dtype=torch.int64, device=ops.device)
            numbers = torch.arange(allocated, dtype=torch.int64, device=ops.device)
            self._numbers = [numbers[k : k + 1] for k in range(allocated)]
        self.written: dict[CaptureKey, int] = {}
        """Most rows each place has been written with (checked before a replay is sealed)."""

    def __contains__(self, key: object) -> bool:
        return key in self._views

    def select(self, slot: int) -> None:
        """Make the following replays (and eager writes) write ``slot``: one device copy
        on the current stream (nothing with one slot)."""
        if self._index is not None:
            self._index.copy_(self._numbers[slot], non_blocking=True)

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
            places = self._views[key][:, :rows]
            if self._index is None:
                places[0].copy_(src)
            else:
                places.index_copy_(0, self._index, src.unsqueeze(0))
        if rows > self.written.get(key, 0):
            self.written[key] = rows
