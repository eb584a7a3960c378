"""The profiler trace summary: nested and overlapping events counted once."""

from __future__ import annotations

from typing import Any

import pytest

from harness.trace import summarize_events

OURS = "/s/dmi_sglang/app/session.py({}): {}"


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "python_function") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def _compared(stock: list[dict[str, Any]], ours: list[dict[str, Any]],
              ) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Stock's and a monitored mode's (``last``) trace summaries, and
    ``harness.profile``'s text comparing them."""
    from harness.profile import render

    s0, s1 = summarize_events(stock), summarize_events(ours)
    return s0, s1, render([{"mode": "stock", "summary": s0}, {"mode": "last", "summary": s1}])


def _first_grown(text: str, table: str = "") -> list[str]:
    """The fields of the first row of the growth table headed ``table`` (the first
    table when empty) in ``harness.profile``'s text."""
    after = text.split(table, 1)[1] if table else text
    return after.split("(stock's)\n", 1)[1].splitlines()[0].split()


def test_own_time_counts_library_calls_and_never_sglangs_code() -> None:
    events = [
        _x(OURS.format(9, "around_forward"), 0, 100, tid=3),
        _x("/p/sglang/srt/model_executor/model_runner.py(5): forward", 10, 80, tid=3),
        _x("/p/torch/nn/modules/module.py(1): _call_impl", 20, 60, tid=3),  # SGLang's
        _x("aten::mm", 30, 10, tid=3, cat="cpu_op"),                         # the model's op
        _x("/p/torch/cuda/streams.py(2): record", 92, 4, tid=3),             # the hook's
        _x("aten::copy_", 96, 2, tid=3, cat="cpu_op"),                       # the hook's op
        _x("/l/python3.12/threading.py(7): wait", 200, 500, tid=4),
        _x(OURS.format(3, "_run"), 150, 600, tid=4),
    ]
    s = summarize_events(events)
    threads = {t["tid"]: t for t in s["threads"]}
    assert threads[3]["dmi_s"] == pytest.approx(20e-6)  # 100 - the forward's 80
    assert threads[3]["entry"] == "app/session.py: around_forward"
    assert threads[4]["dmi_s"] == pytest.approx(100e-6)  # 600 - the 500 waited
    assert threads[4]["dmi_wait_s"] == pytest.approx(500e-6)
    assert s["dmi_ops"] == [{"op": "aten::copy_", "seconds": pytest.approx(2e-6)}]
    assert s["forwards"] == 1


def test_each_threads_cuda_calls_are_counted_apart() -> None:
    events = [
        {"ph": "M", "name": "thread_name", "tid": 4, "args": {"name": "dmi-capture-drain"}},
        _x(OURS.format(1, "_run"), 0, 100, tid=4),
        _x("cudaMemcpyAsync", 10, 20, tid=4, cat="cuda_runtime"),
        _x("cuMemcpyDtoHAsync", 15, 10, tid=4, cat="cuda_driver"),  # inside it: once
        _x("cudaEventSynchronize", 50, 5, tid=4, cat="cuda_runtime"),
        _x("cudaEventSynchronize", 60, 4, tid=4, cat="cuda_runtime"),
        _x(OURS.format(2, "around_forward"), 0, 90, tid=3),
        _x("cudaGraphLaunch", 40, 7, tid=3, cat="cuda_runtime"),
        _x("cudaLaunchKernel", 70, 2, tid=9, cat="cuda_runtime"),  # no Python recorded
    ]
    s = summarize_events(events)
    threads = {t["tid"]: t for t in s["threads"]}
    assert threads[4]["cuda_s"] == pytest.approx(29e-6)
    assert threads[3]["cuda_s"] == pytest.approx(7e-6)
    assert threads[4]["cuda_calls"] == [  # by name, the most time first; nested: both
        {"call": "cudaMemcpyAsync", "seconds": pytest.approx(20e-6), "count": 1},
        {"call": "cuMemcpyDtoHAsync", "seconds": pytest.approx(10e-6), "count": 1},
        {"call": "cudaEventSynchronize", "seconds": pytest.approx(9e-6), "count": 2}]
    assert threads[3]["cuda_calls"] == [
        {"call": "cudaGraphLaunch", "seconds": pytest.approx(7e-6), "count": 1}]
    assert threads[9]["python_s"] == 0.0
    assert threads[9]["cuda_calls"] == [
        {"call": "cudaLaunchKernel", "seconds": pytest.approx(2e-6), "count": 1}]
    # the whole trace's table: in the trace's order at equal times, the threads mixed
    assert [c["call"] for c in s["runtime"]] == [
        "cudaMemcpyAsync", "cuMemcpyDtoHAsync", "cudaEventSynchronize", "cudaGraphLaunch",
        "cudaLaunchKernel"]
    from harness.profile import render

    text = render([{"mode": "last", "summary": s}])
    assert "CUDA calls" in text.splitlines()[0]
    assert text.splitlines()[2].split()[-1] == "0.029"  # ms a forward, one forward at least
    by_thread = text.split("last: CUDA calls by thread, µs and count per forward\n", 1)[1]
    drain, scheduler, other = by_thread.splitlines()[:3]  # the table's order: Python first
    assert drain.split(maxsplit=1) == [
        "dmi-capture-drain", "cudaMemcpyAsync 20.0 x1.0; cuMemcpyDtoHAsync 10.0 x1.0; "
        "cudaEventSynchronize 9.0 x2.0"]
    assert scheduler.split() == ["app/session.py:", "around_forward", "cudaGraphLaunch",
                                 "7.0", "x1.0"]
    assert other.split() == ["thread", "9", "cudaLaunchKernel", "2.0", "x1.0"]


def test_a_thread_keeps_only_its_longest_cuda_calls() -> None:
    calls = [_x(f"cudaCall{i}", 10 * i, i + 1, cat="cuda_runtime") for i in range(8)]
    (thread,) = summarize_events([_x(OURS.format(1, "_run"), 0, 100), *calls])["threads"]
    assert [c["call"] for c in thread["cuda_calls"]] == [f"cudaCall{i}" for i in (7, 6, 5, 4,
                                                                                  3, 2)]
    assert thread["cuda_s"] == pytest.approx(sum(range(1, 9)) * 1e-6)  # every call


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
    assert threads[1]["dmi_s"] == pytest.approx(100e-6)  # own times: 50 + 40 + 6 + 4
    assert threads[2]["dmi_s"] == pytest.approx(30e-6)
    by = {f["function"]: f for f in s["dmi"]}
    assert by["app/session.py: outer"]["seconds"] == pytest.approx(120e-6)  # 50 + 40 + 30
    assert by["app/session.py: outer"]["calls"] == 3
    assert by["app/session.py: inner"]["seconds"] == pytest.approx(10e-6)  # with its call
    assert s["dmi_ops"] == [{"op": "aten::copy_", "seconds": pytest.approx(5e-6)}]


def test_an_empty_trace_has_no_busy_share() -> None:
    s = summarize_events([])
    assert s["gpu_busy"] is None
    assert s["forwards"] == 0
    assert s["threads"] == []


def test_kernels_are_summed_by_name_and_compared_with_stock() -> None:
    forward = "/p/sglang/srt/model_executor/model_runner.py(5): forward"
    stock = [_x(forward, 0, 100), _x("void at::native::mm<float, 4>(int)", 0, 30, cat="kernel")]
    ours = [*stock, _x(forward, 200, 100),
            _x("void at::native::mm<float, 4>(int)", 200, 30, cat="kernel"),
            _x("void at::native::index_copy_kernel<bf16>(int)", 240, 8, cat="kernel"),
            _x("void at::native::index_copy_kernel<bf16>(int)", 250, 6, cat="kernel")]
    _, s1, text = _compared(stock, ours)
    assert s1["kernels"] == [
        {"kernel": "at::native::mm", "seconds": pytest.approx(60e-6), "count": 2},
        {"kernel": "at::native::index_copy_kernel", "seconds": pytest.approx(14e-6),
         "count": 2}]
    assert s1["gpu_s"] == pytest.approx(74e-6)
    # per forward: mm 30 us either way; index_copy 7 us over stock's 0
    assert "last: GPU µs per forward 37 (stock 30)" in text
    assert _first_grown(text) == ["+7.0", "7.0", "x", "1.0", "(", "0.0", "x", "0.0)",
                                  "at::native::index_copy_kernel"]


def test_kernel_growth_is_against_stocks_own_time_even_outside_its_top_20() -> None:
    """A kernel stock runs at rank 21 by time that a monitored mode runs longer grew by
    the difference: the summary kept stock's top 20 alone, so it grew by its whole time."""
    from harness.profile import _grown_over_stock
    from harness.trace import summarize_events

    forward = "/p/sglang/srt/model_executor/model_runner.py(5): forward"

    def k(name: str, ts: float, dur: float) -> dict[str, Any]:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 9}

    def fwd() -> dict[str, Any]:
        return {"ph": "X", "cat": "python_function", "name": forward, "ts": 0, "dur": 1000,
                "tid": 1}

    common = [k(f"model_kernel_{i:02d}", 10 * i, 5 + i) for i in range(20)]
    stock = [fwd(), *common, k("copy_kernel", 900, 1)]
    ours = [fwd(), *common, k("copy_kernel", 900, 41)]
    text = "\n".join(_grown_over_stock([
        {"mode": "stock", "summary": summarize_events(stock)},
        {"mode": "last", "summary": summarize_events(ours)}], "kernels", "kernel"))
    first = _first_grown(text)
    assert first[-1] == "copy_kernel"
    assert first[0] == "+40.0"


def test_cuda_calls_are_summed_by_name_and_their_growth_over_stock_shown() -> None:
    """The host's time in CUDA runtime and driver calls (a graph's launch among them):
    what the capture's nodes add to a decode graph's launch shows against stock's."""
    forward = "/p/sglang/srt/model_executor/model_runner.py(5): forward"
    stock = [_x(forward, 0, 100), _x("cudaGraphLaunch", 10, 20, cat="cuda_runtime")]
    ours = [_x(forward, 0, 100), _x("cudaGraphLaunch", 10, 45, cat="cuda_runtime"),
            _x("cuGraphLaunch", 20, 10, cat="cuda_driver"),  # inside it: counted once
            _x("cuLaunchKernel", 60, 4, cat="cuda_driver"),
            _x("cudaMemcpyAsync", 70, 3, cat="cuda_runtime"), _x("aten::copy_", 70, 5,
                                                                 cat="cpu_op")]
    _, s1, text = _compared(stock, ours)
    assert s1["runtime"] == [
        {"call": "cudaGraphLaunch", "seconds": pytest.approx(45e-6), "count": 1},
        {"call": "cuGraphLaunch", "seconds": pytest.approx(10e-6), "count": 1},
        {"call": "cuLaunchKernel", "seconds": pytest.approx(4e-6), "count": 1},
        {"call": "cudaMemcpyAsync", "seconds": pytest.approx(3e-6), "count": 1}]
    assert s1["runtime_s"] == pytest.approx(52e-6)
    assert "last: host µs in CUDA calls per forward 52 (stock 20)" in text
    first = _first_grown(text, "CUDA calls that grew most")
    assert first[0] == "+25.0"
    assert first[-1] == "cudaGraphLaunch"


def test_a_decode_graph_replays_gpu_work_is_compared_per_replay() -> None:
    """Kernels that carry a graph launch's correlation id are that replay's: per replay,
    against stock's, with the eager work (a prefill's kernels) left out."""
    def launch(ts: float, correlation: int) -> dict[str, Any]:
        return {**_x("cudaGraphLaunch", ts, 5, cat="cuda_runtime"),
                "args": {"correlation": correlation}}

    def kernel(name: str, ts: float, dur: float, correlation: int) -> dict[str, Any]:
        return {**_x(name, ts, dur, tid=9, cat="kernel"), "args": {"correlation": correlation}}

    forward = "/p/sglang/srt/model_executor/model_runner.py(5): forward"
    prefill = kernel("void prefill_gemm<4>(int)", 0, 500, 7)  # eager: not a replay's
    stock = [_x(forward, 0, 600), prefill, _x(forward, 600, 100), launch(600, 1),
             kernel("void decode_gemm<4>(int)", 610, 30, 1)]
    ours = [*stock, _x(forward, 700, 100), launch(700, 2),
            kernel("void decode_gemm<4>(int)", 710, 30, 2),
            kernel("void at::native::elementwise_kernel<4>(int)", 745, 4, 2),
            kernel("void at::native::elementwise_kernel<4>(int)", 600 + 45, 4, 1)]
    s0, s1, text = _compared(stock, ours)
    assert (s0["graph_launches"], s1["graph_launches"]) == (1, 2)
    assert s1["graph_kernels"] == [
        {"kernel": "decode_gemm", "seconds": pytest.approx(60e-6), "count": 2},
        {"kernel": "at::native::elementwise_kernel", "seconds": pytest.approx(8e-6),
         "count": 2}]
    assert s1["graph_gpu_s"] == pytest.approx(68e-6)
    assert "last: GPU µs per decode graph replay 34 (stock 30)" in text
    assert _first_grown(text, "last: GPU µs per decode graph replay") == [
        "+4.0", "4.0", "x", "1.0", "(", "0.0", "x", "0.0)", "at::native::elementwise_kernel"]


def test_copies_beside_kernels_are_told_apart_from_copies_between_them() -> None:
    forward = "/p/sglang/srt/model_executor/model_runner.py(5): forward"
    events = [
        _x(forward, 0, 400),
        _x("void at::native::mm<float, 4>(int)", 0, 100, cat="kernel"),
        _x("void at::native::mm<float, 4>(int)", 80, 40, cat="kernel", tid=2),  # 2 streams
        _x("Memcpy DtoH (Device -> Pinned)", 50, 100, cat="gpu_memcpy"),  # half beside
        _x("Memcpy DtoH (Device -> Pinned)", 300, 50, cat="gpu_memcpy"),  # alone
        _x("Memset (Device)", 360, 10, cat="gpu_memset"),
    ]
    s = summarize_events(events)
    assert s["kernel_s"] == pytest.approx(120e-6)  # [0, 120)
    assert s["copy_s"] == pytest.approx(150e-6)
    assert s["copy_kernel_overlap_s"] == pytest.approx(70e-6)  # [50, 120)
    assert s["gpu_s"] == pytest.approx(210e-6)  # [0, 150), [300, 350), [360, 370)
    from harness.profile import render

    text = render([{"mode": "stock", "summary": s}])
    assert "stock: GPU ms per forward: kernels 0.120, copies 0.150, both at once 0.070" in text
