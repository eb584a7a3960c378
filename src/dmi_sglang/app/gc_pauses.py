"""A process's garbage-collection pauses: the scheduler's while a capture runs (the
benchmark harness times its engine processes' own with it, wave by wave).

A collection holds the GIL for its whole length, so it pauses the scheduler thread
whichever thread of the process set it off (the drain building records, a sink's writer,
SGLang's own code). Objects the capture makes per step and per record feed the young
generation's counter; a full collection walks every tracked object of the process.
"""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["GcPauses"]


class GcPauses:
    """Times every garbage collection of the process (``gc.callbacks``) between
    :meth:`start` and :meth:`stop`, per generation."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        """Collections per generation (0, 1, 2: a full collection)."""
        self.seconds = [0.0, 0.0, 0.0]
        """Their seconds, per generation."""
        self.longest = 0.0
        """The longest single collection, seconds."""
        self._began: float | None = None

    def start(self) -> None:
        """Begin timing (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        """Stop timing (idempotent); the figures stay."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self._began = None

    def counters(self) -> dict[str, float]:
        """``gc_collections``, ``gc_seconds``, ``gc_full_collections``,
        ``gc_full_seconds`` and ``gc_longest_seconds``."""
        return {"gc_collections": float(sum(self.collections)),
                "gc_seconds": sum(self.seconds),
                "gc_full_collections": float(self.collections[2]),
                "gc_full_seconds": self.seconds[2],
                "gc_longest_seconds": self.longest}

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        began, self._began = self._began, None
        if began is None:  # timing started during this collection
            return
        took = time.perf_counter() - began
        generation = min(int(info.get("generation", 2)), 2)
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest = max(self.longest, took)
