"""The drain's GIL slice: it gives the GIL away after a slice of Python, and a waiting
thread then gets it (instead of waiting for the interpreter's forced switch)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from dmi_sglang.adapters.transport._gil import GilSlice


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_slice_yields_only_once_it_is_used_up() -> None:
    gil = GilSlice(0.002)
    gil.restart()
    gil.check()
    assert gil.yields == 0
    _spin(0.004)
    gil.check()
    assert gil.yields == 1
    assert gil.yield_seconds > 0
    gil.check()  # a new slice started with the yield
    assert gil.yields == 1


def test_a_zero_slice_never_yields() -> None:
    gil = GilSlice(0.0)
    _spin(0.003)
    gil.check()
    assert gil.yields == 0


@pytest.fixture
def slow_forced_switch() -> Iterator[None]:
    """A forced GIL switch only every 100 ms: what a thread holding the GIL costs a
    waiting one shows plainly."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _worst_wait_beside(worker_slice_s: float) -> float:
    """Longest time a thread sleeping 1 ms at a time waits beyond its sleep while another
    thread runs Python for 0.6 s in pieces of 50 µs, checking a slice of
    ``worker_slice_s`` between pieces."""
    stop = threading.Event()
    late: list[float] = []

    def sleeper() -> None:
        while not stop.is_set():
            due = time.perf_counter() + 0.001
            time.sleep(0.001)
            late.append(time.perf_counter() - due)

    gil = GilSlice(worker_slice_s)
    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.01)
    end = time.perf_counter() + 0.6
    gil.restart()
    while time.perf_counter() < end:
        _spin(0.00005)
        gil.check()
    stop.set()
    thread.join()
    return max(late)


@pytest.mark.usefixtures("slow_forced_switch")
def test_a_waiting_thread_gets_the_gil_within_about_a_slice() -> None:
    held = _worst_wait_beside(0.0)
    sliced = _worst_wait_beside(0.0002)
    assert held > 0.05, f"without slices the sleeper waited at most {held * 1e3:.1f} ms"
    assert sliced < 0.03, f"with 200 µs slices the sleeper waited {sliced * 1e3:.1f} ms"
