"""The decode-graph arena: one device buffer with a fixed place per selected capture, in
one or more copies (*slots*).

A decode CUDA graph replays fixed addresses with new values. During graph capture each
capture point records a copy of its tensor into its place; every captured graph (one per
batch bucket) writes the same places, so one arena sized for the largest decode batch
serves them all. After a replay, :mod:`._program` copies the real rows out to the ring.

With several slots the replays write the slot that a one-element device index names
(:meth:`Arena.select` sets it before each replay, one device copy). When capture points
write 3 places or more, they write one more copy of the places, the *landing* slot
(plain copies), and after the last of them one indexed copy per run of adjacent
equal-width places moves the step's rows into that slot: one indexed copy a step
instead of one per capture point (fewer places: one indexed copy each). So the rows
of a replayed step stay in their slot while later steps replay into the others: the
drain thread moves them to the ring, not the scheduler thread (see the transport). One
more slot, the *spare*, takes replays that no step committed, and a step whose own slot
still waits for the drain (``seal`` copies that step out at once). An eager step
writing the arena (its plan padded) lands its rows the same way, and its seal moves
them (:meth:`Arena.settle`); each of its capture points may fire once. With one slot
the index is not used and the capture points write the slot directly.

The places of a slot are laid out the way :func:`~dmi_sglang.domain.plan.make_plan`
lays out ring segments (grouped by row size, then in firing order), so a group of
equal-width places and the matching group of ring segments are both equally spaced: one
strided copy moves the whole group.
"""

from __future__ import annotations

import functools
import math

import torch

from dmi_sglang.adapters.transport._device import (
    TORCH_DTYPES,
    WIDE_DTYPES,
    DeviceOps,
    copy_rows,
    widest,
)
from dmi_sglang.adapters.transport._side import SideStream, on
from dmi_sglang.domain.capacity import LANDING_MIN_PLACES, arena_captures
from dmi_sglang.domain.hooks import RESIDUAL_STREAM, Selection
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


class _Group:
    """Equal-width places that lie equally spaced in a slot: views of them in every
    slot and in the landing slot, ``[slot, place, bytes of max_rows rows]`` in elements
    of ``elem`` bytes, so one ``index_copy_`` moves the group's rows of a step."""

    __slots__ = ("landing", "row_elems", "slots")

    def __init__(self, buffer: torch.Tensor, landing: torch.Tensor, *, allocated: int,
                 slot_bytes: int, first: int, count: int, stride: int, row_bytes: int,
                 max_rows: int) -> None:
        elem = next(e for e in (8, 4, 2, 1)
                    if not (row_bytes % e or stride % e or first % e or slot_bytes % e))
        dtype = WIDE_DTYPES[elem]
        self.row_elems = row_bytes // elem
        width = max_rows * self.row_elems
        self.slots = buffer.view(dtype).as_strided(
            (allocated, count, width), (slot_bytes // elem, stride // elem, 1), first // elem)
        self.landing = landing.view(dtype).as_strided(
            (1, count, width), (0, stride // elem, 1), first // elem)

    def move(self, index: torch.Tensor, rows: int) -> None:
        """Copy the first ``rows`` rows of every place from the landing slot into the
        slot ``index`` names."""
        n = rows * self.row_elems
        self.slots[:, :, :n].index_copy_(0, index, self.landing[:, :, :n])


class Arena:
    """One device buffer holding, per slot, a place of ``max_rows`` rows per selected
    capture (those of the ``last`` rule are never written: their places only serve the
    copy programs of its reads).

    Args:
        selection: the resolved selection.
        shape: the model's row shapes.
        max_rows: rows per place: the largest decode-graph batch.
        ops: the device primitives.
        alignment: place alignment in bytes.
        slots: slots steps are written to (see the module docstring); with more than
            one, a spare slot is added, and a landing slot when capture points write
            :data:`LANDING_MIN_PLACES` places or more.
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
        self.max_rows = max_rows
        self.rows_spec: dict[CaptureKey, RowSpec] = {}
        self.offsets: dict[CaptureKey, int] = {}
        runs, offset = self._lay_out(selection, shape, alignment)
        self.nbytes = offset
        """Bytes of one slot (before its alignment to 16)."""
        self.slots = slots
        self.slot_bytes = align_up(max(offset, 16), 16)
        """Distance between two slots in :attr:`buffer`."""
        self.spare = slots if slots > 1 else 0
        """The slot of replays no step committed (the only slot when there is one)."""
        allocated = slots + 1 if slots > 1 else 1
        self.buffer = ops.device_buffer(self.slot_bytes * allocated)
        self._landing_keys = frozenset(key for run in runs for key in run)
        """The places a complete landing writes."""
        landed = slots > 1 and len(self._landing_keys) >= LANDING_MIN_PLACES
        landing = ops.device_buffer(self.slot_bytes) if landed else self.buffer
        self.device_bytes = self.buffer.numel() + (landing.numel() if landed else 0)
        """Device memory of the slots and the landing slot."""
        self._views: dict[CaptureKey, torch.Tensor] = {}
        """Each capture's places, ``[slot, max_rows, row elements]``; with a landing slot,
        that slot alone (``[1, ...]``)."""
        for key, row in self.rows_spec.items():
            item = TORCH_DTYPES[row.dtype].itemsize
            width = math.prod(row.dims)
            self._views[key] = landing.view(TORCH_DTYPES[row.dtype]).as_strided(
                (1 if landed else allocated, max_rows, width),
                (self.slot_bytes // item, width, 1), self.offsets[key] // item)
        self._groups = [
            _Group(self.buffer, landing, allocated=allocated, slot_bytes=self.slot_bytes,
                   first=self.offsets[run[0]], count=len(run),
                   stride=align_up(max_rows * self.rows_spec[run[0]].nbytes, alignment),
                   row_bytes=self.rows_spec[run[0]].nbytes, max_rows=max_rows)
            for run in runs] if landed else []
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
        self._landed: set[CaptureKey] = set()
        """Places written to the landing slot since its last move."""
        self._landed_rows = 0

    def _lay_out(self, selection: Selection, shape: ModelShape,
                 alignment: int) -> tuple[list[list[CaptureKey]], int]:
        """Fill :attr:`rows_spec` and :attr:`offsets` (grouped by row size, then in
        firing order); the runs of adjacent places of equal row size that capture points
        write (:func:`~dmi_sglang.domain.capacity.arena_captures`), and the bytes of one
        slot."""
        captures = selection.captures()
        written = {(hook.name, layer) for hook, layer in arena_captures(selection)}
        rows = [shape.capture_row(selection, hook, layer_no) for hook, layer_no in captures]
        offset = 0
        runs: list[list[CaptureKey]] = [[]]
        for i in sorted(range(len(captures)), key=lambda i: rows[i].nbytes):
            hook, layer_no = captures[i]
            key = (hook.name, layer_no)
            run = runs[-1]
            if key not in written or (run and self.rows_spec[run[0]].nbytes != rows[i].nbytes):
                runs.append([])  # a place in between, or another size: a run of its own
            if key in written:
                runs[-1].append(key)
            self.rows_spec[key] = rows[i]
            self.offsets[key] = offset
            offset += align_up(self.max_rows * rows[i].nbytes, alignment)
        return [run for run in runs if run], offset

    def __contains__(self, key: object) -> bool:
        return key in self._views

    @property
    def landing(self) -> bool:
        """True when the capture points write a landing slot (see the module docstring)."""
        return bool(self._groups)

    def select(self, slot: int) -> None:
        """Make the following replays (and eager writes) write ``slot``: one device copy
        on the current stream (nothing with one slot)."""
        if self._index is not None:
            self._index.copy_(self._numbers[slot], non_blocking=True)

    def write(self, key: CaptureKey, tensor: torch.Tensor, *,
              side: SideStream | None = None) -> None:
        """Copy ``tensor``'s rows into the selected slot (recorded into the graph while
        capturing); with a landing slot, into that, moved once every place landed.
        With ``side`` (a decode graph being captured), a residual-stream capture's copy
        and the landing move go on that stream (:mod:`._side`).

        Raises:
            CaptureError: more rows than the largest decode batch, a wrong dtype/width, or
                (with a landing slot) a place written twice before the landing moved.
        """
        src = as_rows(tensor, key, self.rows_spec[key])
        rows = src.shape[0]
        if rows > self.max_rows:
            msg = (
                f"capture {key}: {rows} rows exceed the arena's {self.max_rows} "
                f"(the largest decode-graph batch the transport was created for)"
            )
            raise CaptureError(msg)
        if rows > self.written.get(key, 0):
            self.written[key] = rows
        places = self._views[key]
        forked = side if side is not None and key[0] in RESIDUAL_STREAM else None
        if not self._groups:
            if not rows:
                return
            if self._index is None:
                on(forked, functools.partial(copy_rows, places[0, :rows], src))
            else:
                dst, wide_src = widest(places[:, :rows], src.unsqueeze(0))
                on(forked, functools.partial(dst.index_copy_, 0, self._index, wide_src))
            return
        if key in self._landed:
            missed = self._missing()
            self._landed.clear()
            msg = (f"capture {key} written twice before the arena's landing slot moved "
                   f"(a decode graph recorded without the capture points {missed})")
            raise CaptureError(msg)
        self._landed.add(key)
        self._landed_rows = max(self._landed_rows, rows)
        if rows:
            on(forked, functools.partial(copy_rows, places[0, :rows], src))
        if self._landed >= self._landing_keys:
            self._move(side)

    def check_landing(self) -> None:
        """Before a padded step: raise when rows wait in the landing slot, which only a
        decode graph recorded without some capture points leaves (its replays would
        move nothing; an eager step's rows move at its seal or are forgotten at its
        abort).

        Raises:
            CaptureError: a decode graph was recorded without some capture points.
        """
        if self._landed:
            missed = self._missing()
            self.forget()
            msg = f"a decode graph was recorded without the capture points {missed}"
            raise CaptureError(msg)

    def settle(self) -> None:
        """An eager step wrote the arena: move what its capture points landed into the
        selected slot (nothing when none landed)."""
        if self._landed:
            self._move()

    def forget(self) -> None:
        """An eager step's forward raised: what it landed is not moved."""
        self._landed.clear()
        self._landed_rows = 0

    def _missing(self) -> str:
        return str(sorted(self._landing_keys - self._landed)[:4])

    def _move(self, side: SideStream | None = None) -> None:
        """One indexed copy per group of the landed rows into the slot the index names
        (recorded into the graph while capturing; on ``side`` when given)."""
        assert self._index is not None
        if self._landed_rows:
            index, rows, groups = self._index, self._landed_rows, self._groups

            def move() -> None:
                for group in groups:
                    group.move(index, rows)

            on(side, move)
        self._landed.clear()
        self._landed_rows = 0

