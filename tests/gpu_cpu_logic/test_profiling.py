"""tests/gpu/profiling.py: the digest of a py-spy raw profile (no py-spy needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import GPU, load  # type: ignore[import-not-found]


@pytest.fixture(scope="module")
def profiling() -> Any:
    return load("profiling", GPU / "profiling.py")


RAW = (
    'process 10:"python run_engine.py spec.json";thread (10): MainThread;'
    "main (run_engine.py:5);generate (engine.py:9) 30\n"
    'process 10:"python run_engine.py spec.json";process 11:"python -c from x import y; y()";'
    "thread (11): MainThread;event_loop (scheduler.py:1);forward (model_runner.py:2) 50\n"
    'process 10:"python run_engine.py spec.json";process 11:"python -c from x import y; y()";'
    "thread (11): MainThread;event_loop (scheduler.py:1);seal (_transport.py:3) 10\n"
    'process 10:"python run_engine.py spec.json";process 11:"python -c from x import y; y()";'
    "thread (12): dmi-capture-drain;_run (_drain.py:1);flush (_window.py:2) 10\n"
    "garbage line without a count\n"
)


def test_summarize_raw_groups_by_process_and_thread(profiling: Any, tmp_path: Path) -> None:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    digest = profiling.summarize_raw(path, top=2)
    assert digest["samples"] == 100
    threads = {t["thread"]: t for t in digest["threads"]}
    sched = threads["11 python -c from x import y | (11): MainThread"]
    assert sched["samples"] == 60
    assert sched["share"] == pytest.approx(0.6)
    assert sched["self"] == [["forward (model_runner.py:2)", pytest.approx(50 / 60)],
                             ["seal (_transport.py:3)", pytest.approx(10 / 60)]]
    assert sched["inclusive"][0] == ["event_loop (scheduler.py:1)", 1.0]
    drain = threads["11 python -c from x import y | (12): dmi-capture-drain"]
    assert drain["self"] == [["flush (_window.py:2)", 1.0]]
    assert [t["samples"] for t in digest["threads"]] == [60, 30, 10]


def test_record_without_py_spy_says_so(profiling: Any, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiling, "py_spy", lambda: None)
    assert "py-spy not found" in profiling.record(1, 1, tmp_path / "x", gil=False)["error"]
