"""Shared memory between a remote sink and the store owner: a batch's bytes cross once.

Through the write channel alone every byte of a batch crosses a Unix socket: libzmq's I/O
thread of the writing process copies it into the kernel, and the owner's copies it out
into freshly allocated messages whose pages are touched for the first time. On the dev box
the owner spent 0.2-0.5 CPU-s per GB receiving (batches of 4 to 72 MB); on an H100 host
one thread of the owner, most likely that one, spent 0.72 s per GB, 77 % busy, while a
stored hidden-states capture reached 1.1 GB/s and the inserts had time to spare.

With a :class:`SharedRing` the writer copies a batch's columns and payload into a memory
mapped file under ``/dev/shm`` that both processes map (one bulk copy, the GIL released),
and its put names the region; the owner's batch is a read-only view of that memory
(:class:`SharedRegions`), and the region is the writer's again once the owner's last view
of it is gone (after its insert: a ``weakref.finalize`` on the region's array, which every
view keeps alive, clears the region's flag).

Layout: :data:`SLOTS` flag bytes, one per region in flight (1 while the owner may read
it, 0 once released), then the regions, each at a 64-byte boundary, handed out in order
(wrapping at the end) and reclaimed oldest first as their flags clear. The file is
removed once the owner has mapped it, so nothing is left behind whoever ends first; its
memory is reserved when it is made (``posix_fallocate``), so a full ``/dev/shm`` refuses
the ring at once instead of failing a later write.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import secrets
import stat
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from dmi_sglang.errors import StoreError

__all__ = ["MIN_BYTES", "SHARED_DIRECTORY", "SLOTS", "Region", "SharedRegions", "SharedRing"]

SHARED_DIRECTORY = "/dev/shm"
"""Where rings are made: memory, never written back to a disk the store writes to."""
SLOTS = 4096
"""Regions in flight at most (one flag byte each, ahead of the regions)."""
_ALIGN = 64
MIN_BYTES = SLOTS + _ALIGN
"""The smallest ring: its flags and one region of 64 bytes."""
_PREFIX = "dmi-ring-"
_WAIT_S = (0.0001, 0.004)
"""A writer's first and longest sleep between looks at the flags while the ring is full
(each sleep twice the one before): a release is seen soon after it, and a long wait for
the owner's inserts costs the writer's process little CPU."""

Region = tuple[int, int, tuple[int, ...]]
"""Where a put's pieces lie: ``(slot, offset, piece lengths)``, the pieces one after
another from ``offset``, each starting at a 64-byte boundary."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _span(lengths: Sequence[int]) -> int:
    """Bytes a region of pieces of these lengths takes."""
    return sum(_aligned(n) for n in lengths) or _ALIGN


class SharedRing:
    """The writer's side: a ring of ``size`` bytes in a new file under ``directory``.

    Raises:
        StoreError: the file cannot be made, or ``directory`` has not ``size`` bytes
            free (the memory is reserved here).
    """

    def __init__(self, size: int, directory: str = SHARED_DIRECTORY) -> None:
        if size < MIN_BYTES:
            msg = f"a shared ring of {size} bytes; accepted: at least {MIN_BYTES}"
            raise ValueError(msg)
        self.size = size
        _sweep(directory)
        self.path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            msg = f"cannot make a shared ring in {directory}: {exc}"
            raise StoreError(msg) from exc
        try:
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            self.unlink()
            msg = f"cannot reserve a shared ring of {size} bytes in {directory}: {exc}"
            raise StoreError(msg) from exc
        os.close(fd)
        self._bytes: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)
        self._flags = self._bytes[:SLOTS]
        self._start = _aligned(SLOTS)
        self._held: collections.deque[tuple[int, int, int]] = collections.deque()
        """Regions the owner may still read, oldest first: ``(slot, start, end)``."""
        self._next_slot = 0
        self.waits = 0
        """Puts that found the ring full and waited for the owner to release."""

    def unlink(self) -> None:
        """Remove the file (both sides keep their mappings)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def place(self, pieces: Sequence[npt.NDArray[Any]], timeout_s: float) -> Region:
        """Copy ``pieces`` (contiguous arrays) into a free region, waiting up to
        ``timeout_s`` for the owner to release older ones; the region is marked held.

        Raises:
            ValueError: the pieces cannot fit the ring even when it is empty.
            StoreError: no region came free within ``timeout_s``.
        """
        lengths = tuple(int(p.nbytes) for p in pieces)
        need = _span(lengths)
        if need > self.size - self._start:
            msg = f"a put of {need} bytes; the shared ring holds {self.size - self._start}"
            raise ValueError(msg)
        deadline = time.monotonic() + timeout_s
        offset = self._free(need)
        if offset is None:
            self.waits += 1
        sleep = _WAIT_S[0]
        while offset is None:
            left = deadline - time.monotonic()
            if left <= 0:
                msg = (f"the store owner released none of the shared ring's "
                       f"{len(self._held)} regions in {timeout_s:g} s")
                raise StoreError(msg)
            time.sleep(min(sleep, left))
            sleep = min(2 * sleep, _WAIT_S[1])
            offset = self._free(need)
        at = offset
        for piece, n in zip(pieces, lengths, strict=True):
            np.copyto(self._bytes[at:at + n],
                      np.ascontiguousarray(piece).reshape(-1).view(np.uint8))
            at += _aligned(n)
        slot = self._next_slot  # taken once the copy succeeded: held slots stay consecutive
        self._next_slot = (slot + 1) % SLOTS
        self._flags[slot] = 1
        self._held.append((slot, offset, offset + need))
        return slot, offset, lengths

    def _free(self, need: int) -> int | None:
        """The offset of ``need`` free bytes, reclaiming released regions first; None
        while there are none (or every slot is held)."""
        held = self._held
        while held and self._flags[held[0][0]] == 0:
            held.popleft()
        if not held:
            return self._start
        if len(held) == SLOTS:
            return None
        oldest, newest = held[0][1], held[-1]
        if newest[1] < oldest:  # wrapped: the gap between the newest and the oldest
            return newest[2] if newest[2] + need <= oldest else None
        if newest[2] + need <= self.size:
            return newest[2]
        return self._start if self._start + need <= oldest else None

    def close(self) -> None:
        """Unmap (the owner's mapping and its views stay) and remove the file."""
        self.unlink()
        self._flags = self._bytes = np.empty(0, np.uint8)
        self._map.close()


class _Lease(np.ndarray):  # type: ignore[type-arg,unused-ignore]
    """A region's bytes in the owner; its finalizer releases the region."""


class _Piece:
    """One piece of a region as a frame (``buffer``), for ``batch_from_frames``."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer


class SharedRegions:
    """The owner's side: the rings writers shared (:meth:`attach`), and their regions
    as frames (:meth:`pieces`)."""

    def __init__(self) -> None:
        self._rings: dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]] = {}

    def attach(self, path: str, size: int) -> str:
        """Map the ring a writer made at ``path`` (a file of ``size`` bytes in
        :data:`SHARED_DIRECTORY`, this user's alone); its id for :meth:`pieces`.

        Raises:
            ValueError: another path, size or file (named, with what is accepted).
        """
        if (not isinstance(path, str) or not isinstance(size, int)
                or os.path.dirname(path) != SHARED_DIRECTORY
                or not os.path.basename(path).startswith(_PREFIX)):
            msg = f"a shared ring at {path!r}; accepted: a dmi-ring-* file in {SHARED_DIRECTORY}"
            raise ValueError(msg)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or st.st_mode & 0o077 or st.st_size != size or size < MIN_BYTES):
                msg = (f"a shared ring at {path} of {st.st_size} bytes, mode "
                       f"{stat.S_IMODE(st.st_mode):o}, owner {st.st_uid}; accepted: a file "
                       f"of {size} bytes only this user ({os.getuid()}) can open")
                raise ValueError(msg)
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        data = np.frombuffer(mapped, dtype=np.uint8)
        self._rings[path] = (data, data[:SLOTS])
        return path

    def detach(self, ring: str) -> None:
        """Forget ``ring`` (its memory goes once no batch views it)."""
        self._rings.pop(ring, None)

    def pieces(self, ring: str, region: Any) -> list[_Piece]:
        """The pieces of ``region`` (:data:`Region`, as JSON) of ``ring``, read-only;
        the region is released when the last view of any of them is gone.

        Raises:
            ValueError: an unknown ring, or a region outside it.
        """
        try:
            data, flags = self._rings[ring]
            slot, offset, lengths = int(region[0]), int(region[1]), [int(n) for n in region[2]]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            msg = f"a shared region {region!r} of ring {ring!r}: {exc!r}"
            raise ValueError(msg) from exc
        end = offset + _span(lengths)
        if not (0 <= slot < SLOTS and _aligned(SLOTS) <= offset and end <= len(data)
                and all(n >= 0 for n in lengths)):
            msg = f"a shared region {region!r} outside ring {ring!r} of {len(data)} bytes"
            raise ValueError(msg)
        lease: Any = data[offset:end].view(_Lease)
        weakref.finalize(lease, _release, flags, slot)
        whole = memoryview(lease).toreadonly()
        out, at = [], 0
        for n in lengths:
            out.append(_Piece(whole[at:at + n]))
            at += _aligned(n)
        return out


def _release(flags: npt.NDArray[np.uint8], slot: int) -> None:
    flags[slot] = 0


def _sweep(directory: str) -> None:
    """Remove this user's ring files in ``directory`` whose writer is gone: a writer
    killed between making its ring and the owner's answer to sharing it (the file is
    removed after that answer) leaves one, its memory reserved until reboot otherwise."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        pid = name.removeprefix(_PREFIX).partition("-")[0]
        if not name.startswith(_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's process: not ours to judge)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
