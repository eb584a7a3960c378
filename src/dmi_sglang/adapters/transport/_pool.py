"""Host memory that record payloads are slices of, reused once every slice is gone.

The drain copies the rows of each staged step and compacted decode window into slabs of
host memory with bulk copies (the GIL is released during them), direct items land in
page-locked slabs by DMA, and decode windows hold their own memory in a pool of window-
sized slabs; records are read-only ``memoryview`` slices: no ``bytes`` object per
record, no copy under the GIL. Fresh memory costs page faults on first touch, which
dominate building records (fresh pages: ~0.6 GB/s on the 2-core dev box, a copy into
mapped memory: ~11 GB/s; on the H200 host glibc's defaults cost 70 ms per 121 MB of
payloads, see ``_device``), so slabs come from a pool: all of one size, handed out by a
bump allocator, and returned to the pool when the last slice of a slab is released (a
``weakref.finalize`` on the slab's per-use array, which every payload memoryview keeps
alive).

A request larger than a slab gets memory of its own (the drain's record building splits
its copies into runs of rows that fit a slab, so there only a single row wider than one
does; a window flush's held request rows come in one request).

Slabs come from ``buffer``. The drain's pool for direct copies passes its device's host
buffers (page-locked on CUDA), so device rows land straight in payload memory: no staging
copy, no CPU time. Each chunk carries a torch view of its bytes for that copy. Oversized
requests always get pageable memory (page-locked memory is cached by torch for the
process's life, rounded up to a power of two: big one-off blocks would stay pinned).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["Chunk", "PayloadPool", "readonly"]

Bytes1D = npt.NDArray[np.uint8]

MIB = 1 << 20
_ALIGN = 64


class _Exporter(np.ndarray):  # type: ignore[type-arg,unused-ignore]
    """An array that is hashable (by identity), so memoryviews of it are hashable too
    (a memoryview hashes its bytes only when its exporter is hashable): records keep
    the hashability they had with ``bytes`` payloads."""

    __hash__ = object.__hash__  # type: ignore[assignment]


def _view(exporter: Any) -> memoryview:
    return memoryview(exporter).toreadonly()


def readonly(buffer: Bytes1D) -> memoryview:
    """A read-only, hashable byte view of ``buffer`` (what payloads are sliced from).

    Read-only so nothing downstream can change a payload; the view (and every slice of
    it) keeps the array it was made from alive.
    """
    return _view(buffer.view(_Exporter))


def _host_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class Chunk:
    """Memory for one bulk copy: ``array`` (or ``tensor``, the same bytes) to write,
    ``view[offset:]`` to slice payloads."""

    __slots__ = ("array", "offset", "tensor", "view")

    def __init__(self, array: Bytes1D, view: memoryview, offset: int,
                 tensor: torch.Tensor) -> None:
        self.array = array
        self.view = view
        self.offset = offset
        self.tensor = tensor


class PayloadPool:
    """Slabs of host memory for record payloads (see the module docstring).

    :meth:`alloc` is called from one thread (the drain); slabs come back from whichever
    thread drops the last record referring to them (a sink writer), through a deque.

    Args:
        slab_bytes: size of every slab (and the largest pooled request); default
            :attr:`SLAB_BYTES`.
        max_free_slabs: free slabs kept for reuse, at most (more are released).
        buffer: allocates host memory (a 1-D uint8 tensor); default pageable memory.
    """

    SLAB_BYTES = 32 * MIB
    """The default slab size."""

    def __init__(self, slab_bytes: int | None = None, max_free_slabs: int = 16,
                 buffer: Callable[[int], torch.Tensor] | None = None) -> None:
        self.slab_bytes = slab_bytes if slab_bytes is not None else self.SLAB_BYTES
        self._max_free = max_free_slabs
        self._buffer = buffer or _host_bytes
        self._free: list[torch.Tensor] = []
        self._returned: collections.deque[torch.Tensor] = collections.deque()
        self._slab: Bytes1D | None = None
        self._slab_tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._used = 0
        self.allocated = 0
        """Slabs allocated so far (a reuse does not count)."""
        self.reused = 0
        """Slabs taken from the free list."""
        self.oversized = 0
        """Requests larger than a slab (memory of their own, not pooled)."""

    def room(self) -> int:
        """Bytes the slab being filled still holds (0 when none is being filled)."""
        return self.slab_bytes - self._used if self._slab is not None else 0

    def alloc(self, nbytes: int) -> Chunk:
        """``nbytes`` of payload memory (64-byte aligned)."""
        if nbytes > self.slab_bytes:
            self.oversized += 1
            own = np.empty(nbytes, dtype=np.uint8).view(_Exporter)
            return Chunk(own, _view(own), 0, torch.from_numpy(own))
        if self._slab is None or self._used + nbytes > self.slab_bytes:
            self._next_slab()
        assert self._slab is not None
        assert self._view is not None
        assert self._slab_tensor is not None
        at = self._used
        self._used = -(-(at + nbytes) // _ALIGN) * _ALIGN
        return Chunk(self._slab[at : at + nbytes], self._view, at,
                     self._slab_tensor[at : at + nbytes])

    def release(self) -> None:
        """Let go of the slab being filled (it returns once its payloads are gone)."""
        self._slab = None
        self._slab_tensor = None
        self._view = None

    def reserve(self, slabs: int) -> None:
        """Allocate ``slabs`` slabs now, into the free list (at most ``max_free_slabs``):
        page-locked allocation synchronises the device, so it belongs at startup."""
        while len(self._free) < min(slabs, self._max_free):
            self._free.append(self._buffer(self.slab_bytes))
            self.allocated += 1

    @property
    def free_slabs(self) -> int:
        """Slabs waiting for reuse (returned ones included)."""
        self._collect()
        return len(self._free)

    def _next_slab(self) -> None:
        self._collect()
        if self._free:
            raw = self._free.pop()
            self.reused += 1
        else:
            raw = self._buffer(self.slab_bytes)
            self.allocated += 1
        # A new array object per use: its death (the last payload of this use gone)
        # returns ``raw``. The tensor view used for device copies is dropped with the
        # slab (``release`` / the next slab), so only payloads keep ``use`` alive.
        use = raw.numpy().view(_Exporter)
        weakref.finalize(use, self._returned.append, raw).atexit = False
        self._slab = use
        self._slab_tensor = torch.from_numpy(use)
        self._view = _view(use)
        self._used = 0

    def _collect(self) -> None:
        returned = self._returned
        while returned:
            self._free.append(returned.popleft())
        del self._free[self._max_free :]
