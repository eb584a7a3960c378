"""A failed run's record names every captured request it saw (uncommitted), and a
finished request still in the batch about to run is reported after that forward."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dmi_sglang.app.session import SchedulerMonitor
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.records import RunStatus
from dmi_sglang.errors import CaptureError
from dmi_sglang.testing import MemorySink

from .conftest import TrackedReq as _Req  # type: ignore[import-not-found]
from .conftest import captured_forward as _forward  # type: ignore[import-not-found]
from .conftest import monitor_of as _monitor  # type: ignore[import-not-found]


def _session(make_driver: Any, text: str) -> tuple[MemorySink, Any, SchedulerMonitor]:
    """A sink, a driver capturing ``text`` into it, and the capture session over both."""
    sink = MemorySink()
    d, _ = make_driver(text, sink=sink)
    return sink, d, _monitor(d, sink)


def _fail(mon: SchedulerMonitor) -> None:
    """A server's capture failure, and the wait for the failed run's record."""
    mon.fail(CaptureError("the capture failed"))
    assert mon._failing is not None
    mon._failing.join(10)


def _failed_record(sink: MemorySink) -> set[str]:
    run, manifests = sink.finished[-1]
    assert run.status is RunStatus.FAILED
    assert not any(m.committed for m in manifests)
    return {m.request_id for m in manifests}


def test_a_finish_the_failed_transport_refused_keeps_its_manifest(make_driver: Any) -> None:
    sink, d, mon = _session(make_driver, "resid_pre")
    a = _Req("a", 3)
    _forward(mon, d, BatchLayout.extend(["a"], [0], [3]), [a])
    a.output_ids.append(1)
    a.done = True
    d.t._fail(CaptureError("the drain failed"), "test")
    with pytest.raises(CaptureError):
        mon.idle()  # reports "a": the transport refuses its finish
    with pytest.raises(CaptureError):
        mon.stop()
    assert "a" in _failed_record(sink)


def test_a_manifest_waiting_for_its_last_read_is_in_the_failed_record(
        make_driver: Any) -> None:
    sink, d, mon = _session(make_driver, "resid_pre:last")
    a = _Req("a", 3)
    _forward(mon, d, BatchLayout.extend(["a"], [0], [3]), [a])
    a.output_ids.append(1)
    a.done = True
    b = _Req("b", 2)
    mon.add_requests([b], frozenset())
    mon.begin_forward()  # reports "a": its manifest waits for this step's commit
    mon.abort_forward()  # the forward failed before its commit
    _fail(mon)
    assert "a" in _failed_record(sink)
    assert "a" not in {m.request_id for m in sink.manifests if m.committed}


def test_a_delivered_manifest_is_not_written_again_by_the_failed_record(
        make_driver: Any) -> None:
    sink, d, mon = _session(make_driver, "resid_pre")
    a, b = _Req("a", 3), _Req("b", 2)
    _forward(mon, d, BatchLayout.extend(["a", "b"], [0, 0], [3, 2]), [a, b])
    a.output_ids.append(1)
    a.done = True
    _forward(mon, d, BatchLayout.decode(["b"], [2]), [b])  # reports and commits "a"
    mon.idle()
    deadline = time.monotonic() + 10  # the drain delivers on its own thread
    while d.t.undelivered_manifests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.t.undelivered_manifests() == []
    _fail(mon)
    assert _failed_record(sink) == {"b"}  # "a" stays committed
    assert "a" in {m.request_id for m in sink.manifests if m.committed}


def test_a_reused_id_beside_it_does_not_report_a_finished_request_before_its_last_forward(
        make_driver: Any) -> None:
    sink, d, mon = _session(make_driver, "resid_pre,final_logits")
    old_r, a = _Req("r", 3), _Req("a", 4)
    _forward(mon, d, BatchLayout.extend(["r", "a"], [0, 0], [3, 4]), [old_r, a])
    old_r.output_ids.append(1)
    a.output_ids.append(1)
    old_r.done = True
    _forward(mon, d, BatchLayout.decode(["a"], [5]), [a])  # "r" reported here
    a.output_ids.append(2)
    a.done = True  # its last token came from that forward
    new_r = _Req("r", 2)  # a client sends the id "r" again
    # a batch built before "a"'s result was processed runs it once more, with new_r
    _forward(mon, d, BatchLayout.extend(["a", "r"], [5, 0], [1, 2]), [a, new_r])
    x = _Req("x", 2)
    _forward(mon, d, BatchLayout.extend(["x"], [0], [2]), [x])
    mon.stop()
    logits_a = sorted(p for r in sink.records if r.request_id == "a"
                      and r.act_name == "final_logits"
                      for p in range(r.start_token_idx, r.end_token_idx))
    assert logits_a == [3, 4]  # 4 + 2 - 1 = 5: the row at 5 decided nothing


def test_a_request_the_engine_let_go_unfinished_ends_incomplete_and_frees_its_slot(
        make_driver: Any) -> None:
    """SGLang's abort of a request waiting to run (a retracted one) lets its Req go
    without finishing it: reported, its capture ends incomplete, its ``last`` slot is
    free again and nothing of the tracker keeps the Req alive."""
    import gc
    import weakref

    sink, d, mon = _session(make_driver, "resid_pre:last")
    a, b = _Req("a", 3), _Req("b", 2)
    _forward(mon, d, BatchLayout.extend(["a", "b"], [0, 0], [3, 2]), [a, b])
    a.output_ids.append(1)
    b.output_ids.append(1)
    _forward(mon, d, BatchLayout.decode(["b"], [2]), [b])  # "a" was retracted
    held = d.t._last_slots
    slots_before = len(held._free)
    mon.requests_dropped([a])  # ... then aborted while it waited
    gone = weakref.ref(a)
    del a
    _forward(mon, d, BatchLayout.decode(["b"], [3]), [b])
    gc.collect()
    assert gone() is None
    assert len(held._free) == slots_before + 1
    assert mon.requests.cancelled_requests == 1
    b.done = True
    mon.stop()
    by = {m.request_id: m for m in sink.manifests}
    assert not by["a"].committed
    assert by["a"].completion_tokens == 1
    assert by["b"].committed


def test_a_let_go_request_keeps_only_the_logits_rows_of_the_tokens_it_kept(
        make_driver: Any) -> None:
    """Retracted after a decode forward whose token it did not keep, then aborted while
    waiting: that forward's final_logits row decided nothing the request kept."""
    sink, d, mon = _session(make_driver, "resid_pre,final_logits")
    a, b = _Req("a", 3), _Req("b", 2)
    _forward(mon, d, BatchLayout.extend(["a", "b"], [0, 0], [3, 2]), [a, b])
    a.output_ids.append(1)  # decided by the row at position 2
    b.output_ids.append(1)
    _forward(mon, d, BatchLayout.decode(["a", "b"], [4, 3]), [a, b])  # a's token lost:
    mon.requests_dropped([a])  # retracted, then aborted while it waited
    _forward(mon, d, BatchLayout.decode(["b"], [4]), [b])
    b.done = True
    mon.stop()
    logits_a = sorted(p for r in sink.records if r.request_id == "a"
                      and r.act_name == "final_logits"
                      for p in range(r.start_token_idx, r.end_token_idx))
    assert logits_a == [2]  # 3 + 1 - 1 = 3: the row at 3 decided nothing a kept
