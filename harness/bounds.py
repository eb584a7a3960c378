"""Hardware bounds, measured in the same run as the result they bound.

The bound of a capture mode is the highest fraction of stock throughput the hardware
allows (ARCHITECTURE.md, "Bound"): ``min(1, D2H B/s / needed B/s)`` for capture without
storage and ``min(1, disk B/s x on-disk compression / needed B/s)`` for storage, where
*needed* is the capture rate at stock speed (captured bytes per output token x stock
output tokens/s). D2H is a pinned device-to-host copy measured by an engine child
(:func:`measure_d2h_bps`); the disk rate is a synced write into the store's directory
(:func:`measure_disk_bps`, the sync rule of "durable").
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dmi_sglang.domain.bandwidth import throughput_bound
from harness.constants import D2H_PROBE_BYTES, DISK_PROBE_BYTES

CHUNK = 64 << 20


def measure_disk_bps(directory: Path, nbytes: int = DISK_PROBE_BYTES) -> float:
    """Bytes/s of writing ``nbytes`` into a new file in ``directory`` and syncing it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".disk-probe"
    block = os.urandom(1 << 20) * (CHUNK >> 20)  # incompressible, like activations
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block[: min(CHUNK, nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
        elapsed = time.perf_counter() - started
        path.unlink(missing_ok=True)
    return written / elapsed


def measure_d2h_bps(nbytes: int = D2H_PROBE_BYTES, repeats: int = 3) -> float | None:
    """Best bytes/s of a pinned device-to-host copy of ``nbytes``; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - started))
    del src, dst
    torch.cuda.empty_cache()
    return best


def spread_of(values: Iterable[float]) -> float:
    """The spread of repeated positive measurements (rates, step times, ratios):
    ``max / min - 1``; 0 for one value or none, or where one is not positive."""
    seen = list(values)
    return max(seen) / min(seen) - 1.0 if seen and min(seen) > 0 else 0.0


def directory_bytes(path: Path) -> int:
    """Bytes the files under ``path`` occupy on disk (allocated blocks)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def bound(*, captured_bytes_per_token: float, stock_tok_s: float | None,
          d2h_bps: float | None, disk_bps: float | None = None,
          compression: float | None = None) -> dict[str, Any]:
    """The bound of one capture mode, with what it was computed from.

    ``disk_bps`` given: a stored mode (``compression`` = captured bytes / bytes on disk,
    1.0 when unknown); else capture without storage. ``ratio`` is None when an input is
    missing.
    """
    needed = captured_bytes_per_token * stock_tok_s if stock_tok_s else None
    out: dict[str, Any] = {"needed_bps": needed, "d2h_bps": d2h_bps}
    if disk_bps is not None:
        factor = compression or 1.0
        out.update(kind="disk", disk_bps=disk_bps, compression=compression,
                   limit_bps=disk_bps * factor)
    else:
        out.update(kind="d2h", limit_bps=d2h_bps)
    out["ratio"] = throughput_bound(needed, out["limit_bps"])
    return out
