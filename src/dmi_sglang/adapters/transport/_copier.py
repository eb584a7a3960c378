"""Host copies spread over a few threads: the decode window's strided writes.

Appending a decode step to the window copies every row of the step from staging into
its request's place (``_window``); at ``sglang-full`` that is ~98 MB per step at batch 64
on Qwen3-0.6B, and the copy was ~70 % of the drain's own CPU (py-spy, docs/transport.md).
One thread copies strided 2 KiB rows at 5-10 GB/s; numpy releases the GIL while it
copies, so a few threads can share a large step. (Torch's own parallel copy would need
no Python threads, but SGLang sets ``torch.set_num_threads(1)`` in the scheduler process,
and that setting is process-wide.)

The caller copies one share itself and waits for the others: when :meth:`copy` returns,
every byte is in place (the drain then frees the ring region the rows came from).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

__all__ = ["ParallelCopier", "default_copy_threads"]

Pair = tuple[np.ndarray, np.ndarray]
"""``(destination, source)`` views of the same shape."""

MIN_PARALLEL_BYTES = 16 << 20
"""Below this a copy is done by the caller alone. Every hand-over costs GIL switches
(the workers take the GIL to start and to report) and wakes more threads: on the 2-core
development machine, splitting the 3.7 MB steps of ``hidden-states`` at batch 64 made a
scheduler-like thread wait ~4x longer to run (GIL or CPU contention: 2 cores cannot
tell them apart) and gained nothing, because those steps copy in ~0.4 ms and the drain
keeps up anyway. Steps this large are the presets whose copy bounds the drain
(``sglang-full``: 98 MB)."""


def default_copy_threads() -> int:
    """Threads (the caller included) for window copies: a quarter of the cores this
    process may run on, 1 to 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cores or 1) // 4))


def _copy(pairs: list[Pair]) -> float:
    """Copy the pairs; the calling thread's CPU seconds for it."""
    t0 = time.thread_time()
    for dst, src in pairs:
        dst[...] = src
    return time.thread_time() - t0


def _pieces(pairs: list[Pair], piece_bytes: int) -> list[Pair]:
    """The pairs cut along their first axis longer than one into pieces of about
    ``piece_bytes`` (a pair that is one row of both axes stays whole)."""
    out: list[Pair] = []
    for dst, src in pairs:
        axis = next((a for a in (0, 1) if a < src.ndim and src.shape[a] > 1), None)
        if axis is None or src.nbytes <= piece_bytes:
            out.append((dst, src))
            continue
        n = src.shape[axis]
        per = max(1, n * piece_bytes // src.nbytes)
        for a in range(0, n, per):
            cut = (slice(None),) * axis + (slice(a, min(n, a + per)),)
            out.append((dst[cut], src[cut]))
    return out


class ParallelCopier:
    """Copies ``(destination, source)`` pairs with ``threads`` threads, the caller one of
    them; worker threads start on the first large copy and end at :meth:`close`.

    Args:
        threads: threads sharing a copy, the caller included (1: the caller alone).
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            msg = f"copy threads must be at least 1, got {threads}"
            raise ValueError(msg)
        self.threads = threads
        self.worker_cpu_seconds = 0.0
        """CPU seconds of the worker threads' copies (the caller's share is the caller's)."""
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, pairs: list[Pair]) -> None:
        """Copy every pair; returns when all bytes are in place (a worker's error is
        raised here)."""
        total = sum(src.nbytes for _, src in pairs)
        if self.threads == 1 or total < MIN_PARALLEL_BYTES:
            _copy(pairs)
            return
        shares: list[list[Pair]] = [[] for _ in range(self.threads)]
        loads = [0] * self.threads
        pieces = _pieces(pairs, -(-total // (2 * self.threads)))
        for dst, src in sorted(pieces, key=lambda p: -p[1].nbytes):  # largest first
            least = loads.index(min(loads))
            shares[least].append((dst, src))
            loads[least] += src.nbytes
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="dmi-copy")
        futures: list[Future[float]] = []
        try:
            for share in shares[1:]:
                if share:
                    futures.append(self._pool.submit(_copy, share))
            _copy(shares[0])
        finally:
            wait(futures)  # no worker may still write once the caller moves on
        for f in futures:
            self.worker_cpu_seconds += f.result()

    def close(self) -> None:
        """End the worker threads (idempotent; a later large copy starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
