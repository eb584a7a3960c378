"""Startup checks, the step protocol, stop semantics and sticky failures."""

from __future__ import annotations

import math

import pytest
import torch

from dmi_sglang.adapters.transport import TorchCaptureTransport, TransportOptions
from dmi_sglang.domain.capacity import RingCapacity
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.errors import CapacityError, CaptureError, CommitError, StoreError
from dmi_sglang.testing import MemorySink

from .conftest import SHAPE, select  # type: ignore[import-not-found]


def _make(payload: int, **kw):
    return TorchCaptureTransport(
        capacity=RingCapacity(payload, payload, 64), selection=select("resid_pre,final_logits"),
        shape=SHAPE, max_graph_batch=8, sink=MemorySink(), run_id="r", device="cpu", **kw,
    )


def test_ring_smaller_than_one_capture_tensor_is_refused_at_startup():
    from dmi_sglang.adapters.transport import TransportOptions

    with pytest.raises(CapacityError, match=r"'resid_pre' tensor\s+can be 16000 bytes"):
        _make(8192, options=TransportOptions(max_prefill_tokens=1000))


def test_a_prefill_chunk_larger_than_the_ring_is_warned_with_the_ring_to_set():
    import structlog

    from dmi_sglang.adapters.transport import TransportOptions

    opts = TransportOptions(max_prefill_tokens=1000)
    with structlog.testing.capture_logs() as logs:
        roomy = _make(65536, options=opts)  # 3 x 1000 rows of 16 B + a logits row: fits
        tight = _make(16384, options=opts)  # one 16,000-byte tensor fits, the chunk not
    warned = [e for e in logs if e["event"] == "dmi.prefill_larger_than_ring"]
    assert len(warned) == 1
    assert warned[0]["prefill_bytes"] == 3 * 16_000 + 48
    assert warned[0]["ring_bytes"] == 16384
    assert warned[0]["advised_ring_mb"] == 1024
    assert "DMX_RING_PAYLOAD_MB=1024 and DMX_RING_PINNED_MB=1024" in warned[0]["hint"]
    assert "only while the copies keep up with the capture" in warned[0]["hint"]
    assert warned[0]["log_level"] == "warning"
    roomy.stop()
    tight.stop()


def test_ring_size_must_be_a_multiple_of_16():
    with pytest.raises(CapacityError, match="multiple of 16"):
        _make(4100)


def test_stop_is_idempotent_and_terminal(make_driver):
    d, sink = make_driver()
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    first = d.t.stop()
    assert d.t.stop() == first
    assert sink.flushes == 1
    layout = BatchLayout.decode(["a"], [4])
    plan = d.plan(layout)
    with pytest.raises(CaptureError, match="stopped"):
        d.t.commit(plan, step=9)
    with pytest.raises(CaptureError, match="stopped"):
        d.t.preflight(plan)
    with pytest.raises(CaptureError, match="stopped"):
        d.t.capturer.capture("resid_pre", 0, torch.zeros(1, 8, dtype=torch.bfloat16))
    with pytest.raises(CaptureError, match="stopped"):
        d.t.seal()
    d.verify(sink.records)


def test_sink_failure_is_sticky(make_driver):
    sink = MemorySink(fail_on_put=1)
    d, _ = make_driver(sink=sink, coalesce_decode=False)
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    with pytest.raises(CaptureError, match="injected failure") as first:
        d.t.stop()
    assert isinstance(first.value.__cause__, StoreError)
    with pytest.raises(CaptureError, match="injected failure"):
        d.t.stop()


def test_a_failed_drain_makes_the_next_commit_raise_instead_of_hanging(make_driver):
    sink = MemorySink(fail_on_put=1)
    d, _ = make_driver(sink=sink, payload_bytes=1024, coalesce_decode=False,
                       max_prefill_tokens=16, stall_timeout_s=30.0)

    def run() -> None:
        for i in range(200):
            d.forward(BatchLayout.extend([f"r{i}"], [0], [16]))

    with pytest.raises(CaptureError, match="injected failure"):
        run()


def test_sink_flush_failure_fails_stop(make_driver):
    d, _ = make_driver(sink=MemorySink(fail_on_flush=True))
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    with pytest.raises(CaptureError, match="sink flush"):
        d.t.stop()


def test_stall_timeout_fails_the_run(make_driver):
    sink = MemorySink(delay_s=0.5)
    d, _ = make_driver(sink=sink, payload_bytes=1024, coalesce_decode=False,
                       max_prefill_tokens=16, stall_timeout_s=0.05)

    def run() -> None:
        for i in range(10):
            d.forward(BatchLayout.extend([f"r{i}"], [0], [16]))

    with pytest.raises(CaptureError, match="waited"):
        run()


def test_step_protocol_errors(make_driver):
    d, _ = make_driver()
    with pytest.raises(CommitError, match="without a committed step"):
        d.t.seal()
    plan = d.plan(BatchLayout.extend(["a"], [0], [2]))
    d.t.commit(plan, step=1)
    with pytest.raises(CommitError, match="not sealed"):
        d.t.commit(plan, step=2)
    d.t.abort()
    d.forward(BatchLayout.extend(["b"], [0], [2]))
    d.t.stop()


def test_unsealed_step_fails_stop(make_driver):
    d, _ = make_driver()
    d.t.commit(d.plan(BatchLayout.extend(["a"], [0], [2])), step=1)
    with pytest.raises(CaptureError, match="never sealed"):
        d.t.stop()


def test_missing_capture_point_fails_the_seal(make_driver):
    d, _ = make_driver()
    layout = BatchLayout.extend(["a"], [0], [2])
    d.t.commit(d.plan(layout), step=1)
    d.fire(layout, skip={("resid_pre", 1)})
    with pytest.raises(CaptureError, match=r"never ran: \[\('resid_pre', 1\)\]"):
        d.t.seal()
    with pytest.raises(CaptureError, match="never ran"):
        d.t.stop()


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.zeros(2, 8, dtype=torch.float32), "dtype"),
        (torch.zeros(2, 7, dtype=torch.bfloat16), "rows of"),
        (torch.zeros(3, 8, dtype=torch.bfloat16), "3 rows, the plan has 2"),
    ],
)
def test_mismatched_tensor_is_refused(make_driver, tensor, match):
    d, _ = make_driver()
    d.t.commit(d.plan(BatchLayout.extend(["a"], [0], [2])), step=1)
    with pytest.raises(CaptureError, match=match):
        d.t.capturer.capture("resid_pre", 0, tensor)


def test_aborted_step_is_not_stored(make_driver):
    d, sink = make_driver()
    layout = BatchLayout.extend(["gone"], [0], [2])
    d.t.commit(d.plan(layout), step=1)
    d.fire(layout)
    d.t.abort()
    d.step = 1
    d.forward(BatchLayout.extend(["kept"], [0], [2]))
    d.t.stop()
    d.verify(sink.records)
    assert {r.request_id for r in sink.records} == {"kept"}


def test_graph_capture_with_too_many_rows_is_refused(make_driver):
    d, _ = make_driver(max_graph_batch=4)
    with pytest.raises(CaptureError, match="exceed the arena"):
        d.graph_capture(8)


def test_capture_point_missing_from_the_graph_fails_the_seal(make_driver):
    d, _ = make_driver("resid_pre")
    layout = BatchLayout.decode(["a"], [3], padded_batch_size=4)
    d.t.commit(d.plan(layout, padded=True), step=1)
    with pytest.raises(CaptureError, match="not recorded in the decode graph"):
        d.t.seal()


def test_wants_names_exactly_the_selection(make_driver):
    d, _ = make_driver("resid_pre@1,final_logits")
    wants = d.t.capturer.wants
    assert wants("resid_pre", 1)
    assert not wants("resid_pre", 0)
    assert wants("final_logits", -1)
    assert not wants("ln1", 1)


def test_create_transport_from_plain_settings():
    from dmi_sglang.adapters.transport import create_transport

    sink = MemorySink()
    t = create_transport(
        payload_mb=1, pinned_mb=2, task_entries=128, padding_strip=False,
        flush_timeout_us=5000, selection=select("hidden-states"), shape=SHAPE,
        max_graph_batch=8, sink=sink, run_id="r", device="cpu", max_prefill_tokens=512,
    )
    assert t.capacity == RingCapacity(1 << 20, 2 << 20, 128)
    assert (t.options.strip, t.options.flush_timeout_s) == (False, 0.005)
    window = 2 * t.options.coalesce_max_bytes  # the window and its gather buffer
    arena = 3 * 8 * 16 * (32 + 2)  # 32 slots of 3 layers x 8 rows x 16 bytes, spare, landing
    assert t.device_bytes == (1 << 20) + arena + window
    assert t.stop().steps == 0


def test_capture_seconds_count_the_time_spent_in_the_capture_points(make_driver):
    import time

    d, sink = make_driver()
    assert d.t.stats().capture_seconds == 0.0
    t0 = time.perf_counter()
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    wall = time.perf_counter() - t0
    first = d.t.stats().capture_seconds
    assert 0.0 < first <= wall
    d.forward(BatchLayout.extend(["b"], [0], [5]))
    assert d.t.stats().capture_seconds > first
    assert d.t.stop().capture_seconds >= d.t.stats().capture_seconds > first
    d.verify(sink.records)


@pytest.mark.parametrize("field", ["flush_timeout_s", "stall_timeout_s", "linger_s"])
@pytest.mark.parametrize("value", [math.inf, 1e10])
def test_a_timeout_no_wait_can_take_is_refused_when_the_options_are_made(field, value):
    """Beyond ``threading.TIMEOUT_MAX`` (about 9.2e9 s) a queue, event or condition wait
    raises OverflowError: the drain thread (flush, linger) or the scheduler thread waiting
    for ring space (stall) failed the run at its first decode step instead."""
    with pytest.raises(ValueError, match=field):
        TransportOptions(**{field: value})
