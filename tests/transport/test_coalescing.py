"""Decode-row coalescing: bounded, timely, ordered, lossless."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.testing import MemorySink

from .conftest import stored_rows


def test_flush_timeout_bounds_how_long_rows_wait(make_driver):
    d, sink = make_driver("resid_pre", flush_timeout_s=0.05)
    for n in range(3):
        d.forward(BatchLayout.decode(["a"], [5 + n]))
    deadline = time.monotonic() + 5
    while not sink.records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {(r.layer_no, r.start_token_idx, r.end_token_idx) for r in sink.records} == {
        (layer, 4, 7) for layer in range(3)
    }
    d.t.stop()
    d.verify(sink.records)


def test_window_is_bounded_by_bytes(make_driver):
    # resid_pre + final_logits for one request: 3 x 16 + 40 = 88 bytes per step.
    d, sink = make_driver("resid_pre,final_logits", coalesce_max_bytes=88 * 4)
    for n in range(10):
        d.forward(BatchLayout.decode(["a"], [5 + n]))
    d.t.stop()
    d.verify(sink.records)
    assert max(r.rows for r in sink.records) == 4
    assert len([r for r in sink.records if r.layer_no == 0]) == 3


def test_a_step_larger_than_the_window_is_counted_outside_it(make_driver):
    # 88 bytes a step (as above) against a window of 80: every step goes around it
    d, sink = make_driver("resid_pre,final_logits", coalesce_max_bytes=80)
    for n in range(3):
        d.forward(BatchLayout.decode(["a"], [5 + n]))
    d.t.stop()
    d.verify(sink.records)
    counters = d.t.drain_counters()
    assert counters["outside_window_too_large"] == 3
    assert counters["window_appends"] == 0


def test_position_restart_starts_a_new_record(make_driver):
    d, sink = make_driver("resid_pre")
    for seq_len in (6, 7, 8, 4, 5):  # retracted after position 7, recomputed from 3
        d.forward(BatchLayout.decode(["a"], [seq_len]))
    d.t.stop()
    d.verify(sink.records)
    layer0 = [(r.start_token_idx, r.end_token_idx, r.seq) for r in sink.records if r.layer_no == 0]
    assert layer0 == [(5, 8, 1), (3, 5, 4)]


def test_extend_between_decodes_keeps_position_order(make_driver):
    d, sink = make_driver("resid_pre,final_logits")
    d.forward(BatchLayout.extend(["a"], [0], [4]))
    d.forward(BatchLayout.decode(["a"], [5]))
    d.forward(BatchLayout.extend(["b", "a"], [0, 5], [3, 1]))  # mixed-like: a as an extend row
    d.forward(BatchLayout.decode(["a", "b"], [7, 4]))
    d.forward(BatchLayout.decode(["b", "a"], [5, 8]))  # batch order changes
    d.t.stop()
    d.verify(sink.records)


def test_requests_joining_and_leaving_the_batch(make_driver):
    d, sink = make_driver("resid_pre,token_ids,final_logits")
    d.forward(BatchLayout.decode(["a", "b"], [3, 3]))
    d.forward(BatchLayout.decode(["a", "b", "c"], [4, 4, 9]))
    d.forward(BatchLayout.decode(["c", "a"], [10, 5]))
    d.t.stop()
    d.verify(sink.records)
    # c joins without a prefill (never so in SGLang: a prefill flushes the window first),
    # so the window is flushed and reopened: a's rows come in two records, c's leave in one
    assert [(r.start_token_idx, r.end_token_idx) for r in sink.records
            if r.request_id == "a" and r.layer_no == 0] == [(2, 3), (3, 5)]
    assert len([r for r in sink.records if r.request_id == "c" and r.layer_no == 0]) == 1


def test_a_request_leaving_keeps_the_window_and_records_stay_exact(make_driver):
    d, sink = make_driver("resid_pre,final_logits")
    d.forward(BatchLayout.decode(["a", "b", "c"], [3, 3, 3]))
    d.forward(BatchLayout.decode(["a", "c"], [4, 4]))  # b finished
    d.forward(BatchLayout.decode(["c", "a"], [5, 5]))  # order changes
    d.t.stop()
    d.verify(sink.records)
    assert [(r.start_token_idx, r.end_token_idx) for r in sink.records
            if r.request_id == "a" and r.layer_no == 0] == [(2, 5)]


def test_a_window_brings_each_stored_row_to_the_host_once(make_driver):
    # 3 layers x 16 B of resid_pre per row: 2 requests x 4 steps fill a 384 B window
    d, sink = make_driver("resid_pre", coalesce_max_bytes=384)
    for n in range(8):
        d.forward(BatchLayout.decode(["a", "b"], [5 + n, 9 + n]))
    d.t.stop()
    d.verify(sink.records)
    assert len(sink.records) == 2 * 2 * 3  # 2 windows x 2 requests x 3 layers
    assert d.t.drain_counters()["window_bytes"] == 8 * 2 * 3 * 16
    assert d.t.drain_counters()["d2h_bytes"] == 0  # no step went through staging
    d2, sink2 = make_driver("resid_pre", coalesce_max_bytes=384)
    d2.forward(BatchLayout.decode(["a", "b"], [5, 9]))  # 1 of 4 steps used
    d2.forward(BatchLayout.decode(["b"], [10]))  # a left: its slot stays empty
    d2.t.stop()
    d2.verify(sink2.records)
    assert d2.t.drain_counters()["window_bytes"] == 3 * 3 * 16  # only the rows used


def test_a_decode_step_joins_the_window_with_one_copy_call_for_all_its_groups(
        make_driver, monkeypatch: pytest.MonkeyPatch) -> None:
    # each torch call of the drain releases the GIL and takes it back: a step's groups
    # (here resid_pre and final_logits) move into the window with one call
    real = torch._foreach_copy_
    from_window: list[int] = []

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], **kw: bool) -> None:
        caller = sys._getframe(1).f_code
        if caller.co_filename.endswith("_window.py") and caller.co_name == "copy":
            from_window.append(len(dsts))
        real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    d, sink = make_driver("resid_pre,final_logits", coalesce_max_bytes=88 * 8)
    for n in range(6):
        d.forward(BatchLayout.decode(["a"], [5 + n]))
    d.t.stop()
    d.verify(sink.records)
    appends = d.t.drain_counters()["window_appends"]
    assert appends > 0
    assert from_window == [2] * appends


def test_windows_after_a_timeout_are_sized_to_fill_before_the_next_one(make_driver):
    d, sink = make_driver("resid_pre", flush_timeout_s=0.05)  # 1 row: 48 B; window 1 GiB
    d.forward(BatchLayout.decode(["a"], [5]))
    d.forward(BatchLayout.decode(["a"], [6]))
    deadline = time.monotonic() + 5
    while not sink.records and time.monotonic() < deadline:  # flushed by the timeout
        time.sleep(0.01)
    window = d.t._drain._window
    assert window._steps_hint == 3  # 2 steps arrived in time: x 1.25, rounded up
    for n in range(3):
        d.forward(BatchLayout.decode(["a"], [7 + n]))
    deadline = time.monotonic() + 5
    while len(sink.records) < 6 and time.monotonic() < deadline:  # full: flushed at once
        time.sleep(0.01)
    assert window._steps_hint == 6  # a full window lets the next one grow
    d.t.stop()
    d.verify(sink.records)
    assert [(r.start_token_idx, r.end_token_idx) for r in sink.records if r.layer_no == 0] == [
        (4, 6), (6, 9)]


def test_behind_a_backlog_the_window_keeps_coalescing_past_its_timeout(make_driver):
    """Timed-out windows are flushed only when the drain has nothing queued: flushing each
    step while steps pile up would multiply the records when the drain is slowest."""
    gate, in_put = threading.Event(), threading.Event()

    class GatedSink(MemorySink):
        def put(self, records):
            in_put.set()
            gate.wait(10)
            super().put(records)

    d, sink = make_driver("resid_pre", sink=GatedSink(), flush_timeout_s=1e-6)
    d.forward(BatchLayout.decode(["a"], [5]))  # flushed at once, then blocks in put
    assert in_put.wait(5)  # the backlog must not reach the drain before this flush
    for n in range(12):  # a backlog: the drain is stuck in the sink
        d.forward(BatchLayout.decode(["a"], [6 + n]))
    gate.set()
    d.t.stop()
    d.verify(sink.records)
    spans = [(r.start_token_idx, r.end_token_idx) for r in sink.records if r.layer_no == 0]
    assert spans[0] == (4, 5)
    # the backlog drained in windows of 2, 4 and 6 steps (a timed-out window sizes the
    # next to what arrived in time; full ones double), not 12 one-step records
    assert spans[1:] == [(5, 7), (7, 11), (11, 17)]


def _burst(make_driver, linger_s: float, pause_s: float = 0.0,
           **options: object) -> tuple[list[tuple], dict]:
    """Decode steps (``pause_s`` apart): a steady run, a batch order change, a request
    leaving, a position restart. Returns the stored rows and the drain's counters."""
    d, sink = make_driver("resid_pre,final_logits", linger_s=linger_s, **options)
    steps = [(["a", "b", "c"], [5 + n, 9 + n, 3 + n]) for n in range(6)]
    steps += [(["c", "a", "b"], [9, 11, 15]), (["a", "b"], [12, 16])]
    steps += [(["a", "b"], [4, 17]), (["a", "b"], [5, 18])]  # a retracted, recomputed
    for rids, seq_lens in steps:
        d.forward(BatchLayout.decode(rids, seq_lens))
        time.sleep(pause_s)
    d.t.stop()
    d.verify(sink.records)
    return sorted(stored_rows(sink.records).elements()), d.t.drain_counters()


def test_a_lingering_drain_moves_several_steps_per_copy_with_the_same_rows(make_driver):
    one_by_one, counters = _burst(make_driver, 0.0, pause_s=0.02)
    assert counters["lingers"] == 0
    together, counters = _burst(make_driver, 0.5, pause_s=0.02)
    assert counters["window_appends"] < 10  # (whether a linger ran its whole time
    # depends on the machine's load: a busy drain finds the next step already queued)
    assert together == one_by_one


def test_steps_joining_together_respect_the_window_size(make_driver):
    # resid_pre (3 layers x 16 B) + final_logits (40 B) for 3 requests: 264 B per step.
    one_by_one, _ = _burst(make_driver, 0.0, coalesce_max_bytes=264 * 4)
    together, counters = _burst(make_driver, 0.5, coalesce_max_bytes=264 * 4)
    assert counters["window_flushes"] >= 3
    assert together == one_by_one


def test_a_step_waiting_for_ring_space_ends_the_drains_linger(make_driver):
    # 3 requests x 3 layers x 16 B = 144 B per step: 3 steps fill the 512 B ring, so
    # the steps after them wait for the drain, which would otherwise linger 30 s.
    d, sink = make_driver("resid_pre", payload_bytes=512, linger_s=30.0, flush_timeout_s=60.0)
    d.graph_capture(4)
    started = time.monotonic()
    for n in range(10):
        layout = BatchLayout.decode(["a", "b", "c"], [5 + n, 9 + n, 3 + n], padded_batch_size=4)
        d.forward(layout, padded=True)
        if n == 0:
            time.sleep(0.1)  # the drain takes step 1 alone, then lingers from step 2 on
    stats = d.t.stop()
    assert time.monotonic() - started < 20.0
    assert stats.stalls >= 1
    d.verify(sink.records)
    assert sum(r.rows for r in sink.records) == 10 * 3 * 3


def test_the_window_setting_sizes_the_decode_window_on_the_device() -> None:
    from dmi_sglang.adapters.transport import create_transport
    from dmi_sglang.domain.settings import Settings

    from .conftest import SHAPE, select

    assert Settings.from_env({}).drain_window_mb == 512

    def device_bytes(window_mb: int) -> int:
        settings = Settings.from_env({"DMX_DRAIN_WINDOW_MB": str(window_mb)})
        transport = create_transport(
            payload_mb=1, pinned_mb=1, task_entries=64, padding_strip=True,
            flush_timeout_us=1000, selection=select("resid_pre"), shape=SHAPE,
            max_graph_batch=2, sink=MemorySink(), run_id="run", device="cpu",
            window_mb=settings.drain_window_mb)
        try:
            assert transport.options.coalesce_max_bytes == window_mb << 20
            return transport.device_bytes
        finally:
            transport.stop()

    # the window and its gather buffer: twice the setting
    assert device_bytes(48) - device_bytes(16) == 2 * (32 << 20)


def test_the_linger_and_gil_slice_settings_reach_the_drain() -> None:
    from dmi_sglang.adapters.transport import create_transport
    from dmi_sglang.domain.settings import Settings

    from .conftest import SHAPE, select

    settings = Settings.from_env({"DMX_DRAIN_LINGER_US": "0", "DMX_DRAIN_GIL_SLICE_US": "50"})
    assert (settings.drain_linger_us, settings.drain_gil_slice_us) == (0, 50)
    defaults = Settings.from_env({})
    assert (defaults.drain_linger_us, defaults.drain_gil_slice_us) == (30_000, 200)
    transport = create_transport(
        payload_mb=1, pinned_mb=1, task_entries=64, padding_strip=True, flush_timeout_us=1000,
        selection=select("resid_pre"), shape=SHAPE, max_graph_batch=2, sink=MemorySink(),
        run_id="run", device="cpu", linger_us=settings.drain_linger_us,
        gil_slice_us=settings.drain_gil_slice_us)
    try:
        assert transport.options.linger_s == 0.0
        assert transport.options.gil_slice_s == pytest.approx(50e-6)
        assert transport.drain_counters()["gil_yields"] == 0
    finally:
        transport.stop()


def test_held_logits_rows_reach_their_memory_by_device_copy_and_leave_without_a_copy(
        make_driver):
    # resid_pre (3 x 16 B) + final_logits (40 B) for 3 requests: 264 B a step, 4 steps a
    # window. Each flush holds the newest logits row of a, b and c (copied by the device
    # into the held rows' memory, not by the host); the next flush (and the stop)
    # releases them together, in the order they were held.
    d, sink = make_driver("resid_pre,final_logits", coalesce_max_bytes=264 * 4)
    for n in range(8):
        d.forward(BatchLayout.decode(["a", "b", "c"], [5 + n, 9 + n, 3 + n]))
    d.t.stop()
    d.verify(sink.records)
    counters = d.t.drain_counters()
    assert counters["window_flushes"] == 2
    assert counters["host_copied_bytes"] == 0  # held by device copy; released as is
    released = [r for r in sink.records if r.act_name == "final_logits" and r.rows == 1]
    assert len(released) == 6


def test_back_to_back_payloads_are_found_and_anything_else_is_refused() -> None:
    from dmi_sglang.adapters.transport._pool import PayloadPool
    from dmi_sglang.adapters.transport._records import back_to_back, copy_row
    from dmi_sglang.domain.records import CaptureRecord

    pool = PayloadPool(slab_bytes=1 << 16)
    chunk = pool.alloc(30)
    chunk.array[:] = range(30)
    own = chunk.view[chunk.offset : chunk.offset + 30]

    def rec(payload: memoryview | bytes) -> CaptureRecord:
        return CaptureRecord("run", "a", "final_logits", 0, 0, 1, 2, "torch.uint8",
                             (1, len(payload)), payload, 1)

    span = back_to_back([rec(own[0:10]), rec(own[10:20]), rec(own[20:30])])
    assert span is not None
    assert bytes(span) == bytes(range(30))
    assert back_to_back([rec(own[10:20]), rec(own[0:10])]) is None  # out of order
    assert back_to_back([rec(own[0:10]), rec(own[20:30])]) is None  # a gap
    assert back_to_back([rec(own[0:10]), rec(copy_row(chunk.array[10:20]))]) is None
    assert back_to_back([rec(bytes(10))]) is None


def test_a_held_row_that_waits_past_the_next_flush_gets_memory_of_its_own(make_driver):
    # resid_pre + final_logits (40 B) for 3 requests: 264 B a step, 2 steps a window.
    d, sink = make_driver("resid_pre,final_logits", coalesce_max_bytes=264 * 2)
    d.forward(BatchLayout.decode(["a", "b", "c"], [5, 9, 3]))
    d.forward(BatchLayout.decode(["a", "b", "c"], [6, 10, 4]))  # a flush holds 3 rows
    for n in range(6):  # b was retracted: its held row is never confirmed by a flush
        d.forward(BatchLayout.decode(["a", "c"], [7 + n, 5 + n]))
    deadline = time.monotonic() + 5
    while d.t.drain_counters()["window_flushes"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    (row,) = d.t._drain.held._rows["b"]
    assert len(row.payload.obj) == 40  # its own 40 bytes, not the flush's pooled slab
    d.t.finish_request("b", None)
    d.t.stop()
    d.verify(sink.records)


def test_held_rows_of_staged_steps_count_their_host_copies(make_driver) -> None:
    # coalescing off: every decode step is staged (its resid_pre rows go to payload
    # memory by device copy); each step holds a, b and c's 40-byte logits row, copied out
    # of staging to be held, and copied again when released (rows of separate memory)
    d, sink = make_driver("resid_pre,final_logits", coalesce_decode=False)
    for n in range(4):
        d.forward(BatchLayout.decode(["a", "b", "c"], [5 + n, 9 + n, 3 + n]))
    d.t.stop()
    d.verify(sink.records)
    assert d.t.drain_counters()["host_copied_bytes"] == 2 * 4 * 3 * 40


def test_the_held_rows_page_locked_slabs_are_made_once_not_at_every_window(make_driver):
    """final_logits rows are held back at each flush in page-locked slabs reserved when
    the first window with request rows opens; a later window reserving them again made
    a third slab mid-run (on the drain thread: page-locked allocation synchronises the
    device) though the first was nowhere near full."""
    d, sink = make_driver("resid_pre,final_logits", coalesce_max_bytes=400,
                          sink=MemorySink())
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    for n in range(40):
        d.forward(BatchLayout.decode(["a", "b"], [6 + n, 4 + n]))
    d.t.stop()
    d.verify(sink.records)
    window = d.t._drain._window
    assert window.flushes >= 10
    assert window._held_pool.allocated == 2


TRANSPORT_SETTINGS = ("gpu_padding_strip", "drain_flush_timeout_us", "drain_linger_us",
                      "drain_gil_slice_us", "drain_window_mb", "arena_slots_mb",
                      "drain_copy_piece_mb", "drain_copy_ahead", "drain_copy_kernel",
                      "drain_copy_gaps", "topk_chunk", "topk_kernel", "graph_side_stream")
"""The settings that tune an engine's transport (its ring aside)."""


@pytest.mark.parametrize("field", TRANSPORT_SETTINGS)
def test_every_transport_setting_reaches_the_engine_options(field: str) -> None:
    import attrs

    from dmi_sglang.adapters.transport import TransportOptions
    from dmi_sglang.domain.settings import Settings

    base = Settings()
    default = getattr(base, field)
    if isinstance(default, str):
        changed: object = "triton" if default == "none" else "none"
    else:
        changed = (not default) if isinstance(default, bool) else default + 7
    assert (TransportOptions.for_engine(attrs.evolve(base, **{field: changed}))
            != TransportOptions.for_engine(base))


def test_an_engine_records_decode_graph_copies_on_the_side_stream_by_default() -> None:
    """``DMX_GRAPH_SIDE_STREAM`` is on for an engine (whose capture points join), off for
    a transport made from plain options (whose model may not)."""
    from dmi_sglang.adapters.transport import TransportOptions
    from dmi_sglang.domain.settings import Settings

    assert TransportOptions.for_engine(Settings()).side_stream
    assert not TransportOptions.for_engine(Settings.from_env(
        {"DMX_GRAPH_SIDE_STREAM": "0"})).side_stream
    assert not TransportOptions().side_stream


@pytest.mark.parametrize("side_stream", [False, True])
def test_create_transport_takes_the_side_stream_setting(side_stream: bool) -> None:
    """A direct user of the transport opts in (its model must then join)."""
    from dmi_sglang.adapters.transport import create_transport
    from dmi_sglang.testing import MemorySink

    from .conftest import SHAPE, select

    kwargs = {"side_stream": True} if side_stream else {}
    t = create_transport(payload_mb=1, pinned_mb=1, task_entries=64, padding_strip=True,
                         flush_timeout_us=1000, selection=select("resid_pre"), shape=SHAPE,
                         max_graph_batch=2, sink=MemorySink(), run_id="run", device="cpu",
                         **kwargs)
    try:
        assert (t.options.side_stream, t.capturer.joins) == (side_stream, side_stream)
    finally:
        t.stop()


def test_the_transport_settings_are_all_of_them() -> None:
    """A new drain, arena, GPU, graph or top-k setting joins TRANSPORT_SETTINGS (and so the test
    above)."""
    import attrs

    from dmi_sglang.domain.settings import Settings

    names = {f.name for f in attrs.fields(Settings)}
    assert {n for n in names
            if n.startswith(("drain_", "arena_", "topk_", "gpu_", "graph_"))} == set(
        TRANSPORT_SETTINGS)


def test_an_engine_transport_takes_every_transport_setting() -> None:
    """What the composition root builds for an engine: the ring and each tuning value
    from the settings (DMX_TOPK_CHUNK, DMX_TOPK_KERNEL and DMX_GRAPH_SIDE_STREAM
    included), none left at its default."""
    from dmi_sglang.adapters.transport import engine_transport
    from dmi_sglang.domain.capacity import RingCapacity
    from dmi_sglang.domain.settings import Settings
    from dmi_sglang.testing import MemorySink

    from .conftest import SHAPE, select

    settings = Settings.from_env({
        "DMX_RING_PAYLOAD_MB": "2", "DMX_RING_PINNED_MB": "3", "DMX_RING_TASK_ENTRIES": "99",
        "DMX_GPU_PADDING_STRIP": "0", "DMX_DRAIN_FLUSH_TIMEOUT_US": "7000",
        "DMX_DRAIN_LINGER_US": "11", "DMX_DRAIN_GIL_SLICE_US": "13", "DMX_DRAIN_WINDOW_MB": "17",
        "DMX_ARENA_SLOTS_MB": "19", "DMX_DRAIN_COPY_PIECE_MB": "23",
        "DMX_DRAIN_COPY_AHEAD": "29", "DMX_DRAIN_COPY_GAPS": "1", "DMX_TOPK_CHUNK": "4096",
        "DMX_TOPK_KERNEL": "flashinfer", "DMX_GRAPH_SIDE_STREAM": "0"})
    t = engine_transport(settings, selection=select("resid_pre"), shape=SHAPE,
                         max_graph_batch=2, sink=MemorySink(), run_id="run", device="cpu",
                         max_prefill_tokens=16, max_requests=3)
    try:
        o = t.options
        assert t.capacity == RingCapacity.from_mb(2, 3, 99)
        assert (o.strip, o.flush_timeout_s, o.linger_s, o.gil_slice_s) == (
            False, 0.007, 11e-6, 13e-6)
        assert (o.coalesce_max_bytes, o.arena_slots_bytes, o.copy_piece_bytes) == (
            17 << 20, 19 << 20, 23 << 20)
        assert (o.copies_ahead, o.copy_gaps, o.topk_chunk, o.topk_kernel) == (
            29, True, 4096, "flashinfer")
        assert not o.side_stream
        assert (o.max_prefill_tokens, o.max_requests) == (16, 3)
    finally:
        t.stop()


def test_an_engine_transport_logs_the_copies_it_runs_with_the_defaults() -> None:
    """Unset, the drain's copy settings are the documented defaults (16 MiB pieces with a
    gap kernel after each), and the transport's start-up line says what it runs with."""
    import structlog.testing

    from dmi_sglang.adapters.transport import engine_transport
    from dmi_sglang.domain.settings import Settings

    from .conftest import SHAPE, select

    settings = Settings.from_env({"DMX_GRAPH_SIDE_STREAM": "0"})
    with structlog.testing.capture_logs() as logs:
        t = engine_transport(settings, selection=select("resid_pre"), shape=SHAPE,
                             max_graph_batch=2, sink=MemorySink(), run_id="run",
                             device="cpu", max_prefill_tokens=16, max_requests=3)
    try:
        ready = [e for e in logs if e["event"] == "capture transport ready"]
        assert len(ready) == 1
        assert (ready[0]["copy_piece_bytes"], ready[0]["copy_gaps"]) == (16 << 20, True)
        assert ready[0]["side_stream"] is False
        assert (t.options.copy_piece_bytes, t.options.copy_gaps) == (16 << 20, True)
    finally:
        t.stop()


def test_the_library_defaults_are_an_engines_but_the_side_stream() -> None:
    """``TransportOptions()``, ``TransportOptions.from_settings()`` and
    ``create_transport``'s tuning arguments default to what an engine runs with when no
    variable is set; only the side stream is off there (it needs a model that calls the
    capturer's ``join``)."""
    import inspect

    import attrs

    from dmi_sglang.adapters.transport import TransportOptions, create_transport
    from dmi_sglang.domain.settings import Settings

    engine = TransportOptions.for_engine(Settings())
    assert engine.side_stream
    library = attrs.evolve(engine, side_stream=False)
    assert TransportOptions() == library
    assert TransportOptions.from_settings() == library
    engine_args = {
        "linger_us": "drain_linger_us", "gil_slice_us": "drain_gil_slice_us",
        "window_mb": "drain_window_mb", "arena_slots_mb": "arena_slots_mb",
        "copy_piece_mb": "drain_copy_piece_mb", "copy_ahead": "drain_copy_ahead",
        "copy_kernel": "drain_copy_kernel", "copy_gaps": "drain_copy_gaps",
        "topk_chunk": "topk_chunk", "topk_kernel": "topk_kernel"}
    parameters = inspect.signature(create_transport).parameters
    assert {arg: parameters[arg].default for arg in engine_args} == {
        arg: getattr(Settings(), field) for arg, field in engine_args.items()}
    assert parameters["side_stream"].default is False


def test_the_windows_share_of_the_drains_cpu_is_counted(make_driver) -> None:
    # the drain's build CPU, and of it the window's appends and flushes (what a decode
    # step costs the drain thread's Python, on a GPU beside the scheduler thread)
    d, sink = make_driver("resid_pre,final_logits", coalesce_max_bytes=88 * 4)
    for n in range(12):
        d.forward(BatchLayout.decode(["a"], [5 + n]))
    d.t.stop()
    d.verify(sink.records)
    c = d.t.drain_counters()
    assert c["window_appends"] > 0
    assert c["window_flushes"] > 0
    assert c["window_append_cpu_seconds"] > 0
    assert c["window_flush_cpu_seconds"] > 0
    assert c["window_append_cpu_seconds"] + c["window_flush_cpu_seconds"] <= c[
        "build_cpu_seconds"]


def _flushed_logits_run(make_driver, steps: int,
                        monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict[str, float]]:
    """``steps`` decode steps of a, b and c through windows of 4 steps (final_logits and
    its top 2: two groups of request rows), stopped; the records the drain built one by
    one (:class:`CaptureRecord` objects), and its counters."""
    from dmi_sglang.adapters.transport import _records

    made = [0]
    real = _records.CaptureRecord

    class Counted(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            made[0] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_records, "CaptureRecord", Counted)
    d, sink = make_driver("final_logits,final_logits:topk(2)",
                          coalesce_max_bytes=(40 + 16) * 3 * 4)
    for n in range(steps):
        d.forward(BatchLayout.decode(["a", "b", "c"], [5 + n, 9 + n, 3 + n]))
    d.t.stop()
    d.verify(sink.records)
    return made[0], d.t.drain_counters()


def test_held_request_rows_of_a_window_are_columns_not_records(
        make_driver, monkeypatch: pytest.MonkeyPatch) -> None:
    # each flush holds the newest row of each request-row capture of a, b and c: as one
    # block of columns per group over the memory the device filled, released at the
    # next flush as batches over it (no object per record, no host copy), however many
    # flushes there are
    made_short, short = _flushed_logits_run(make_driver, 8, monkeypatch)
    made_long, long = _flushed_logits_run(make_driver, 24, monkeypatch)
    assert (short["window_flushes"], long["window_flushes"]) == (2, 6)
    assert made_short == made_long == 0
    assert short["host_copied_bytes"] == long["host_copied_bytes"] == 0


def test_released_block_rows_keep_each_request_and_captures_order() -> None:
    import numpy as np

    from dmi_sglang.adapters.transport._records import Emitted, HeldBlock, HeldRows
    from dmi_sglang.columns import CaptureKey

    def block(keys: tuple[CaptureKey, ...], first: int) -> HeldBlock:
        n = 2
        memory = np.arange(n * len(keys) * 4, dtype=np.uint8) + first
        return HeldBlock("run", keys, row_nbytes=4, request_ids=["a", "b"],
                         positions=np.array([first, first + 10], dtype=np.int64),
                         seqs=np.array([1, 1], dtype=np.int64), memory=memory)

    ids, values = CaptureKey("ids", -1, "int32", (1,)), CaptureKey("values", -1, "float32", (1,))
    # blocks of other captures: one batch each, whatever the order the rows came in
    held, out = HeldRows(), Emitted()
    one, two = block((ids,), 0), block((values,), 50)
    held.hold_block(one)
    held.hold_block(two)
    held.confirm("a", out)
    held.confirm("b", out)
    batches = out.batches_out()
    assert [b.captures for b in batches] == [(ids,), (values,)]
    assert [b.request_ids for b in batches] == [("a", "b"), ("a", "b")]
    assert (out.records, out.rows, out.bytes) == (4, 4, 16)
    assert bytes(batches[0].payload) == bytes(one.memory)  # a view of the block's memory
    # two blocks of the same captures: arrival order, so a request's rows stay in order
    held, out = HeldRows(), Emitted()
    early, late = block((ids,), 0), block((ids,), 1)
    held.hold_block(early)
    held.hold_block(late)  # a's and b's two rows each (piecewise steps hold so)
    held.confirm("a", out)
    held.confirm("b", out)
    starts = [(rid, int(s)) for b in out.batches_out()
              for rid, s in zip([b.request_ids[i] for i in b.request], b.start, strict=True)]
    assert starts == [("a", 0), ("a", 1), ("b", 10), ("b", 11)]
