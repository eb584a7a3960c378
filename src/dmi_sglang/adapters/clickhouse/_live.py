"""Which runs of an embedded store a sink of THIS process is capturing now.

The embedded engine admits one process per directory, so a reader that can open a store
while a run of it says ``running`` either is that run's own process (the run is live if
a sink here started it) or found the store free: its owner is gone and the run reads as
interrupted.
"""

from __future__ import annotations

import os
import threading

__all__ = ["is_live", "live_runs", "mark_done", "mark_live"]

_LOCK = threading.Lock()
_LIVE: set[tuple[str, str]] = set()


def _key(path: str, run_id: str) -> tuple[str, str]:
    return os.path.realpath(path), run_id


def mark_live(path: str, run_id: str) -> None:
    """A sink of this process started ``run_id`` in the store at ``path``."""
    with _LOCK:
        _LIVE.add(_key(path, run_id))


def mark_done(path: str, run_id: str) -> None:
    """That sink finished the run or closed."""
    with _LOCK:
        _LIVE.discard(_key(path, run_id))


def is_live(path: str, run_id: str) -> bool:
    """Whether a sink of this process is capturing ``run_id`` at ``path``."""
    with _LOCK:
        return _key(path, run_id) in _LIVE


def live_runs(path: str) -> list[str]:
    """The runs a sink of this process is capturing at ``path`` now."""
    where = os.path.realpath(path)
    with _LOCK:
        return sorted(run_id for at, run_id in _LIVE if at == where)
