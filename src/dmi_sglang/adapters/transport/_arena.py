"""The decode-graph arena: one device buffer with a fixed place per selected capture, in
one or more copies (*slots*).

A decode CUDA graph replays fixed addresses with new values. During graph capture each
capture point records a copy of its tensor into its place; every captured graph (one per
batch bucket) writes the same places, so one arena sized for the largest decode batch
serves them all. After a replay, :mod:`._program` copies the real rows out to the ring.

With several slots the capture points write one more copy of the places, the *landing*
slot (plain copies), and after the last of them one copy moves the whole landing slot
into the slot that a one-element device index names when the graph replays
(:meth:`Arena.select` sets it before each replay, one device copy): one indexed copy a
step instead of one per capture point. So the rows of a replayed step stay in their
slot while later steps replay into the others: the drain thread moves them to the
ring, not the scheduler thread (see the transport). One more slot, the *spare*, takes
replays that no step committed, and a step whose own slot still waits for the drain
(``seal`` copies that step out at once). An eager step writing the arena (its plan
padded) lands its rows the same way, and its seal moves them (:meth:`Arena.settle`):
such a step may fire only the capture points its plan stores. With one slot the index
is not used and the capture points write the slot directly.

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
        elsewhere: captures that never write the arena (the ``last`` rule's slots hold
            them): the landing slot moves once every other place was written.
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
        elsewhere: frozenset[CaptureKey] = frozenset(),
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
        self._landing = ops.device_buffer(self.slot_bytes) if slots > 1 else self.buffer
        """The slot the capture points write (the only slot when there is one)."""
        self._whole = self.buffer.view(torch.int64).view(allocated, self.slot_bytes // 8)
        """The slots as rows of 8-byte words (the landing slot moves as one row)."""
        self.device_bytes = self.buffer.numel() + (self._landing.numel() if slots > 1 else 0)
        """Device memory of the slots and the landing slot."""
        self._places: dict[CaptureKey, torch.Tensor] = {}
        """Each capture's place in the landing slot: ``[max_rows, row elements]``."""
        for key, row in self.rows_spec.items():
            item = TORCH_DTYPES[row.dtype].itemsize
            width = math.prod(row.dims)
            self._places[key] = self._landing.view(TORCH_DTYPES[row.dtype]).as_strided(
                (max_rows, width), (width, 1), self.offsets[key] // item)
        self._index: torch.Tensor | None = None
        """The slot the recorded copies write (several slots only)."""
        self._numbers: list[torch.Tensor] = []
        """One-element device tensors 0 .. spare, copied into :attr:`_index`."""
        if slots > 1:
            self._index = torch.full((1,), self.spare, dtype=torch.int64, device=ops.device)
            numbers = torch.arange(slots + 1, dtype=torch.int64, device=ops.device)
            self._numbers = [numbers[k : k + 1] for k in range(slots + 1)]
        self.written: dict[CaptureKey, int] = {}
        """Most rows each place has been written with (checked before a replay is sealed)."""
        self._landed: set[CaptureKey] = set()
        """Places written to the landing slot since its last move (several slots only)."""
        self._landing_keys = frozenset(self._places) - elsewhere
        """The places a complete landing writes."""

    def __contains__(self, key: object) -> bool:
        return key in self._places

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
        if self._index is not None:
            if key in self._landed:
                missing = sorted(self._landing_keys - self._landed)
                self._landed.clear()
                msg = (f"capture {key} written twice before the arena's landing slot moved: "
                       f"a decode graph recorded without the capture points {missing[:4]}, "
                       f"or a step that fired {key} twice")
                raise CaptureError(msg)
            self._landed.add(key)
        if rows:
            self._places[key][:rows].copy_(src)
        if rows > self.written.get(key, 0):
            self.written[key] = rows
        if self._index is not None and self._landed >= self._landing_keys:
            self._move()

    def check_landing(self) -> None:
        """Before a step: raise when the landing slot holds rows no move took (a decode
        graph was recorded without some capture points: its replays would move nothing).

        Raises:
            CaptureError: rows wait in the landing slot.
        """
        if self._landed:
            missing = sorted(self._landing_keys - self._landed)
            self._landed.clear()
            msg = f"a decode graph was recorded without the capture points {missing[:4]}"
            raise CaptureError(msg)

    def settle(self) -> None:
        """An eager step wrote the arena: move what its capture points landed into the
        selected slot (nothing when none landed, or with one slot)."""
        if self._landed:
            self._move()

    def forget(self) -> None:
        """A step's forward raised: what it landed is not moved."""
        self._landed.clear()

    def _move(self) -> None:
        """One device copy of the landing slot into the slot the index names (recorded
        into the graph while capturing)."""
        assert self._index is not None
        landing = self._landing.view(torch.int64).view(1, self.slot_bytes // 8)
        self._whole.index_copy_(0, self._index, landing)
        self._landed.clear()
