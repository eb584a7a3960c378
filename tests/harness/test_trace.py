"""The profiler trace summary: nested and overlapping events counted once."""

from __future__ import annotations

import pytest

from harness.trace import summarize_events

OURS = "/s/dmi_sglang/app/session.py({}): {}"


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "python_function") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_recursion_and_nesting_are_counted_once() -> None:
    events = [
        _x(OURS.format(1, "outer"), 0, 100),
        _x(OURS.format(1, "outer"), 10, 50),            # recursion: inside itself
        _x(OURS.format(2, "inner"), 20, 10),
        _x("/t/torch/cuda/__init__.py(3): current_stream", 25, 4),
        _x("aten::copy_", 40, 5, cat="cpu_op"),         # inside ours
        _x("aten::copy_", 150, 5, cat="cpu_op"),        # outside: not ours
        _x(OURS.format(1, "outer"), 90, 30, tid=2),     # another thread overlapping in time
        _x("k", 0, 60, tid=9, cat="kernel"),
        _x("k", 50, 30, tid=9, cat="kernel"),           # overlapping kernels: 0-80 busy
    ]
    s = summarize_events(events)
    assert s["window_s"] == pytest.approx(155e-6)
    assert s["gpu_busy"] == pytest.approx(80 / 155)
    threads = {t["tid"]: t for t in s["threads"]}
    assert threads[1]["python_s"] == pytest.approx(100e-6)
    assert threads[1]["dmi_s"] == pytest.approx(100e-6)
    assert threads[2]["dmi_s"] == pytest.approx(30e-6)
    by = {f["function"]: f for f in s["dmi"]}
    assert by["app/session.py: outer"]["seconds"] == pytest.approx(130e-6)  # union: 100 + 30
    assert by["app/session.py: outer"]["calls"] == 3
    assert by["app/session.py: inner"]["seconds"] == pytest.approx(10e-6)
    assert s["dmi_ops"] == [{"op": "aten::copy_", "seconds": pytest.approx(5e-6)}]


def test_an_empty_trace_has_no_busy_share() -> None:
    s = summarize_events([])
    assert s["gpu_busy"] is None
    assert s["forwards"] == 0
    assert s["threads"] == []
