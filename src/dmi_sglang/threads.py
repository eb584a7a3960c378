"""Threads the operating system knows by name.

Python before 3.14 leaves every thread it starts with its process's name, so ``top -H``,
``ps -L``, py-spy and ``/proc/PID/task/TID/comm`` cannot tell the capture's drain from a
sink's writer or the store owner's write channel. :class:`OsNamedThread` gives the thread
its Python name at the OS level too (Linux keeps the first 15 bytes).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["OsNamedThread", "name_os_thread"]

_PR_SET_NAME = 15
"""``prctl``'s option that names the calling thread (``<linux/prctl.h>``)."""
OS_NAME_BYTES = 15
"""The longest thread name Linux keeps (16 bytes with the terminating NUL)."""


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def name_os_thread(name: str) -> bool:
    """Give the calling thread ``name`` at the OS level (its first 15 bytes of UTF-8);
    False where that cannot be done (not Linux, or ``prctl`` refused)."""
    prctl = _prctl()
    if prctl is None:
        return False
    raw = name.encode("utf-8", "replace")[:OS_NAME_BYTES]
    return prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0


class OsNamedThread(threading.Thread):
    """A :class:`threading.Thread` that takes its ``name`` at the OS level as it starts
    (see the module); otherwise the same."""

    def run(self, *args: Any, **kwargs: Any) -> None:
        name_os_thread(self.name)
        super().run(*args, **kwargs)
