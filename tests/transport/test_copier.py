"""The window's parallel copier: every byte lands where one plain copy would put it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.transport import TransportOptions, _copier
from dmi_sglang.adapters.transport._copier import ParallelCopier
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.errors import CaptureError
from dmi_sglang.testing import MemorySink


def _window_pairs(rng: np.random.Generator, groups: list[tuple[int, int, int]], steps: int,
                  t: int) -> tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Window cells ``[segments, slots, steps, row]`` per group and the step-``t`` pairs
    a decode step writes (the shapes ``DecodeWindow.append`` copies)."""
    cells = [np.zeros((count, slots, steps, row), np.uint8) for count, slots, row in groups]
    # sources strided like staging's rows of a padded step (every other row kept)
    pairs = [(c[:, :, t, :], rng.integers(0, 255, (c.shape[0], 2 * c.shape[1], c.shape[3]),
                                          dtype=np.uint8)[:, ::2, :]) for c in cells]
    return cells, pairs


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    groups=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 7), st.integers(1, 300)),
                    min_size=1, max_size=5),
    threads=st.integers(1, 5),
    steps=st.integers(1, 4),
    data=st.data(),
)
def test_parallel_copy_equals_a_plain_copy(monkeypatch, groups, threads, steps, data):
    monkeypatch.setattr(_copier, "MIN_PARALLEL_BYTES", 0)  # cut even tiny steps into pieces
    t = data.draw(st.integers(0, steps - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    cells, pairs = _window_pairs(rng, groups, steps, t)
    expected = [c.copy() for c in cells]
    for e, (_, src) in zip(expected, pairs, strict=True):
        e[:, :, t, :] = src
    copier = ParallelCopier(threads)
    try:
        copier.copy(pairs)
    finally:
        copier.close()
    for got, want in zip(cells, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_large_copies_use_the_workers_and_small_ones_stay_on_the_caller(monkeypatch):
    rng = np.random.default_rng(1)
    seen: set[str] = set()
    real = _copier._copy

    def spy(pairs):
        seen.add(threading.current_thread().name)
        return real(pairs)

    monkeypatch.setattr(_copier, "_copy", spy)
    monkeypatch.setattr(_copier, "MIN_PARALLEL_BYTES", 1 << 20)
    copier = ParallelCopier(3)
    try:
        _, small = _window_pairs(rng, [(4, 8, 64)], 2, 0)  # 2 KiB
        copier.copy(small)
        assert seen == {threading.current_thread().name}
        cells, large = _window_pairs(rng, [(28, 64, 2048)], 2, 1)  # 3.7 MB
        copier.copy(large)
        workers = seen - {threading.current_thread().name}
        assert workers
        assert all(n.startswith("dmi-copy") for n in workers)
        np.testing.assert_array_equal(cells[0][:, :, 1, :], large[0][1])
        assert copier.worker_cpu_seconds > 0
    finally:
        copier.close()
    copier.close()  # idempotent


def _copy_raises(monkeypatch, copy_share, match: str) -> None:
    """A 3.7 MB copy with 3 threads, each share copied by ``copy_share``, raises ``match``."""
    monkeypatch.setattr(_copier, "_copy", copy_share)
    monkeypatch.setattr(_copier, "MIN_PARALLEL_BYTES", 1 << 20)
    copier = ParallelCopier(3)
    try:
        _, pairs = _window_pairs(np.random.default_rng(2), [(28, 64, 2048)], 2, 0)
        with pytest.raises(RuntimeError, match=match):
            copier.copy(pairs)
    finally:
        copier.close()


def test_a_worker_error_is_raised_after_every_share_finished(monkeypatch):
    done: list[str] = []
    real = _copier._copy
    caller = threading.current_thread().name

    def failing(pairs):
        real(pairs)
        if threading.current_thread().name != caller:
            done.append("worker")
            raise RuntimeError("disk on fire")
        done.append("caller")

    _copy_raises(monkeypatch, failing, "disk on fire")
    assert sorted(done) == ["caller", "worker", "worker"]


def test_a_caller_error_still_waits_for_every_worker(monkeypatch):
    finished: list[str] = []
    real = _copier._copy
    caller = threading.current_thread().name

    def slow_workers(pairs):
        if threading.current_thread().name == caller:
            raise RuntimeError("caller share failed")
        time.sleep(0.2)
        seconds = real(pairs)
        finished.append("worker")
        return seconds

    _copy_raises(monkeypatch, slow_workers, "caller share failed")
    assert finished == ["worker", "worker"]  # nobody writes once copy() is left


def _copy_threads() -> set[int | None]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("dmi-copy")}


@pytest.mark.parametrize("fail", [False, True])
def test_copy_threads_end_with_the_drain(make_driver, monkeypatch, fail):
    monkeypatch.setattr(_copier, "MIN_PARALLEL_BYTES", 0)
    before = _copy_threads()  # another test's unreferenced copier may still be collected
    sink = MemorySink(fail_on_put=1) if fail else MemorySink()
    d, _ = make_driver("resid_pre,final_logits", sink=sink, copy_threads=3,
                       flush_timeout_s=1e-6)
    for n in range(4):
        d.forward(BatchLayout.decode(["a", "b", "c"], [5 + n] * 3))
    if fail:
        with pytest.raises(CaptureError, match="injected failure"):
            d.t.stop()
    else:
        d.t.stop()
        d.verify(sink.records)
        assert d.t.drain_counters()["copy_worker_cpu_seconds"] > 0
    assert _copy_threads() <= before  # every thread this transport started has ended


def test_thread_count_is_checked():
    with pytest.raises(ValueError, match="copy threads must be at least 1, got 0"):
        ParallelCopier(0)
    assert 1 <= _copier.default_copy_threads() <= 4


def test_the_setting_reaches_the_window(make_driver):
    assert TransportOptions.from_settings(copy_threads=3).copy_threads == 3
    assert TransportOptions.from_settings().copy_threads == _copier.default_copy_threads()
    d, _ = make_driver("resid_pre", copy_threads=3)
    assert d.t._drain._window._copier.threads == 3
    d.t.stop()
