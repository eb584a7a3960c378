"""Host memory that record payloads are slices of, reused once every slice is gone.

The drain copies the rows of each flushed window (and of each directly stored step) into
slabs of host memory with bulk copies (the GIL is released during them) and hands the
records read-only ``memoryview`` slices: no ``bytes`` object per record, no copy under
the GIL. Fresh memory costs page faults on first touch, which dominate building records
(fresh pages: ~0.6 GB/s on the 2-core dev box, a copy into mapped memory: ~11 GB/s; on
the H200 host glibc's defaults cost 70 ms per 121 MB of payloads, see ``_device``), so
slabs come from a pool: all of one size, handed out by a bump allocator, and returned to
the pool when the last slice of a slab is released (a ``weakref.finalize`` on the slab's
per-use array, which every payload memoryview keeps alive).

A request larger than a slab gets memory of its own (callers split their copies so that
this only happens for one oversized tensor slice, e.g. a long prefill of a wide hook).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

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


class Chunk:
    """Memory for one bulk copy: ``array`` to write, ``view[offset:]`` to slice payloads."""

    __slots__ = ("array", "offset", "view")

    def __init__(self, array: Bytes1D, view: memoryview, offset: int) -> None:
        self.array = array
        self.view = view
        self.offset = offset


class PayloadPool:
    """Slabs of host memory for record payloads (see the module docstring).

    :meth:`alloc` is called from one thread (the drain); slabs come back from whichever
    thread drops the last record referring to them (a sink writer), through a deque.

    Args:
        slab_bytes: size of every slab (and the largest pooled request).
        max_free_slabs: free slabs kept for reuse, at most (more are released).
    """

    def __init__(self, slab_bytes: int = 32 * MIB, max_free_slabs: int = 16) -> None:
        self.slab_bytes = slab_bytes
        self._max_free = max_free_slabs
        self._free: list[Bytes1D] = []
        self._returned: collections.deque[Bytes1D] = collections.deque()
        self._slab: Bytes1D | None = None
        self._view: memoryview | None = None
        self._used = 0
        self.allocated = 0
        """Slabs allocated so far (a reuse does not count)."""
        self.reused = 0
        """Slabs taken from the free list."""
        self.oversized = 0
        """Requests larger than a slab (memory of their own, not pooled)."""

    def alloc(self, nbytes: int) -> Chunk:
        """``nbytes`` of payload memory (64-byte aligned)."""
        if nbytes > self.slab_bytes:
            self.oversized += 1
            own = np.empty(nbytes, dtype=np.uint8).view(_Exporter)
            return Chunk(own, _view(own), 0)
        if self._slab is None or self._used + nbytes > self.slab_bytes:
            self._next_slab()
        assert self._slab is not None
        assert self._view is not None
        at = self._used
        self._used = -(-(at + nbytes) // _ALIGN) * _ALIGN
        return Chunk(self._slab[at : at + nbytes], self._view, at)

    def release(self) -> None:
        """Let go of the slab being filled (it returns once its payloads are gone)."""
        self._slab = None
        self._view = None

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
            raw = np.empty(self.slab_bytes, dtype=np.uint8)
            self.allocated += 1
        use = raw.view(_Exporter)  # a new array object per use: its death returns ``raw``
        weakref.finalize(use, self._returned.append, raw).atexit = False
        self._slab = use
        self._view = _view(use)
        self._used = 0

    def _collect(self) -> None:
        returned = self._returned
        while returned:
            self._free.append(returned.popleft())
        del self._free[self._max_free :]
