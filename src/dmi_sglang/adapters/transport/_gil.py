"""Keeping a background thread's Python work out of the scheduler thread's way.

The scheduler thread releases the GIL in every torch call and retakes it at once. A
background thread that took the GIL meanwhile keeps it until it releases it itself or
until the interpreter forces a switch (``sys.getswitchinterval()``, 5 ms): a
milliseconds-long stretch of the drain's Python (a window flush) can hold the scheduler
that long. Releasing the GIL in a short torch call does not help, because the releasing
thread retakes it before the waiting thread has woken up. ``time.sleep(0)`` does hand
it over: the sleep lasts long enough (tens of µs) for a waiting thread to take it.
"""

from __future__ import annotations

import time

__all__ = ["GilSlice"]


class GilSlice:
    """Gives the GIL away once the calling thread ran ``slice_s`` without blocking.

    The owner calls :meth:`restart` when it comes back from a blocking wait (it has just
    retaken the GIL) and :meth:`check` between pieces of work; ``check`` sleeps for zero
    seconds once ``slice_s`` passed since the last restart or yield. ``slice_s == 0``:
    never yields.
    """

    __slots__ = ("_since", "_slice", "yield_seconds", "yields")

    def __init__(self, slice_s: float) -> None:
        self._slice = slice_s
        self._since = time.perf_counter()
        self.yields = 0
        """Times the GIL was given away."""
        self.yield_seconds = 0.0
        """Seconds the thread spent giving it away (waiting to get it back included)."""

    def restart(self) -> None:
        """The thread just came back from a wait that released the GIL."""
        self._since = time.perf_counter()

    def check(self) -> None:
        """Between two pieces of work: give the GIL away if this slice is used up."""
        if not self._slice:
            return
        now = time.perf_counter()
        if now - self._since < self._slice:
            return
        time.sleep(0)
        self._since = time.perf_counter()
        self.yields += 1
        self.yield_seconds += self._since - now
