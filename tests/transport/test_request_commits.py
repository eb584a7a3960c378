"""Per-request commits through the transport: a finished request's manifest reaches the
sink while the run goes on, after every row of that request, through the decode window
and the ``last`` rule alike; a cancelled request is never committed."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from dmi_sglang.app.session import SchedulerMonitor
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.records import RequestManifest
from dmi_sglang.testing import MemorySink

from .conftest import TrackedReq as _Req  # type: ignore[import-not-found]
from .conftest import captured_forward as _forward  # type: ignore[import-not-found]
from .conftest import monitor_of as _monitor  # type: ignore[import-not-found]


class _RecordingSink(MemorySink):
    """Notes, at each commit, how many records of the request the sink holds."""

    def __init__(self) -> None:
        super().__init__()
        self.at_commit: dict[str, int] = {}

    def commit_requests(self, manifests: Sequence[RequestManifest]) -> None:
        for m in manifests:
            self.at_commit[m.request_id] = sum(
                1 for r in self.records if r.request_id == m.request_id)
        super().commit_requests(manifests)


def _prefilled_and_done(mon: SchedulerMonitor, d) -> _Req:
    """Request "a" (a 3-token prompt) prefilled by one captured forward, which decided
    its one generated token and finished it."""
    a = _Req("a", 3)
    _forward(mon, d, BatchLayout.extend(["a"], [0], [3]), [a])
    a.output_ids.append(1)
    a.done = True
    return a


@pytest.mark.parametrize("selection", ["resid_pre,final_logits", "resid_pre:last"])
@pytest.mark.parametrize("window", [True, False])
def test_a_finished_request_is_committed_after_its_rows_while_the_run_goes_on(
        make_driver, selection, window):
    sink = _RecordingSink()
    d, _ = make_driver(selection, sink=sink, coalesce_decode=window)
    mon = _monitor(d, sink, cancelled=lambda req: req.rid == "c")
    a, b, c = _Req("a", 3), _Req("b", 2), _Req("c", 2)

    def forward(layout: BatchLayout, reqs) -> None:
        _forward(mon, d, layout, reqs)

    forward(BatchLayout.extend(["a", "b", "c"], [0, 0, 0], [3, 2, 2]), [a, b, c])
    for r in (a, b, c):
        r.output_ids.append(1)
    # decode layouts take sequence lengths: the new token's position + 1
    forward(BatchLayout.decode(["a", "b", "c"], [4, 3, 3]), [a, b, c])
    forward(BatchLayout.decode(["a", "b", "c"], [5, 4, 4]), [a, b, c])  # a's extra forward
    a.output_ids.append(2)
    a.done = True
    c.done = True  # c ends by an abort (its client went away)
    for r in (b, c):
        r.output_ids.append(2)
    for n in range(6):  # b decodes on; a's commit must come while the run still runs
        forward(BatchLayout.decode(["b"], [5 + n]), [b])
    deadline = time.monotonic() + 10
    while "a" not in sink.at_commit and time.monotonic() < deadline:
        time.sleep(0.01)  # a decode window flushes on its timeout
    assert "a" in sink.at_commit, "a finished request must be committed before the stop"
    assert mon.active
    mon.stop()
    a_rows = sum(1 for r in sink.records if r.request_id == "a")
    assert a_rows > 0
    assert sink.at_commit["a"] == a_rows
    committed = {m.request_id: m for m in sink.manifests if m.committed}
    assert set(committed) == {"a"}  # b never finished, c was cancelled
    assert committed["a"].overlap_extra_forward
    assert (committed["a"].prompt_tokens, committed["a"].completion_tokens) == (3, 2)
    assert {m.request_id for m in sink.manifests if not m.committed} == {"b", "c"}


@pytest.mark.parametrize("selection", ["resid_pre,final_logits", "resid_pre:last"])
def test_a_request_that_finished_while_the_engine_idles_is_committed_without_a_forward(
        make_driver, selection):
    sink = _RecordingSink()
    d, _ = make_driver(selection, sink=sink)
    mon = _monitor(d, sink)
    a = _Req("a", 3)
    for layout in (BatchLayout.extend(["a"], [0], [3]), BatchLayout.decode(["a"], [4])):
        _forward(mon, d, layout, [a])
        a.output_ids.append(1)
    a.done = True  # the last batch's result: no forward follows, the engine idles
    time.sleep(0.3)
    assert "a" not in sink.at_commit  # nothing reported it yet
    mon.idle()
    deadline = time.monotonic() + 10
    while "a" not in sink.at_commit and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "a" in sink.at_commit
    assert mon.active
    mon.stop()
    assert sink.at_commit["a"] == sum(1 for r in sink.records if r.request_id == "a")


def test_a_reused_request_id_is_not_captured_and_the_first_capture_stays(make_driver):
    sink = _RecordingSink()
    d, _ = make_driver("resid_pre", sink=sink)
    mon = _monitor(d, sink)
    _first = _prefilled_and_done(mon, d)  # alive, as the scheduler holds its Req
    second = _Req("a", 5)  # a client sends the id again once the first finished
    _forward(mon, d, BatchLayout.extend(["a"], [0], [5]), [second])
    _forward(mon, d, BatchLayout.decode(["a"], [6]), [second])
    mon.stop()
    rows = [r for r in sink.records if r.request_id == "a"]
    assert {(r.start_token_idx, r.end_token_idx) for r in rows} == {(0, 3)}  # the first's
    assert sink.at_commit["a"] == len(rows)
    (committed,) = [m for m in sink.manifests if m.request_id == "a"]
    assert (committed.prompt_tokens, committed.completion_tokens) == (3, 1)
    assert mon.requests.reused_requests == 1


def test_idle_raises_a_transport_failure_once_and_the_stop_reports_it(make_driver):
    from dmi_sglang.errors import CaptureError

    sink = _RecordingSink()
    d, _ = make_driver("resid_pre:last", sink=sink)
    mon = _monitor(d, sink)
    _prefilled_and_done(mon, d)
    d.t._fail(CaptureError("the drain failed"), "test")
    with pytest.raises(CaptureError, match="the drain failed"):  # a server ends the
        mon.idle()  # capture at once (an engine logs it); not again while it idles on
    mon.idle()
    with pytest.raises(CaptureError, match="the drain failed"):
        mon.stop()
    assert "a" not in sink.at_commit


@pytest.mark.parametrize("after", ["prefill", "decode into the window"])
def test_a_commit_waits_for_the_rows_its_finish_released_while_they_are_in_flight(
        make_driver, monkeypatch, after):
    """The finish notice releases the request's held last logits row into batches that go
    in flight with the items after it (their copies still running when the wake-up ends
    with more queued behind); the manifest reaches the sink only after that row."""
    from dmi_sglang.adapters.transport import _drain

    monkeypatch.setattr(_drain, "_BATCH", 2)  # [notice, next item] a wake-up, more behind
    monkeypatch.setattr(_drain.Drain, "start", lambda self: None)  # every item queued first
    sink = _RecordingSink()
    d, _ = make_driver("resid_pre,final_logits", sink=sink, payload_bytes=1 << 20)
    # "a": a 5-token prompt and one generated token, no extra forward: its logits row at
    # position 4 is held until the notice
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    d.forward(BatchLayout.extend(["x"], [0], [2]))  # pairs with the notice in a wake-up
    d.t.finish_request("a", 5, RequestManifest("run-1", "a", 5, 1, committed=True))
    if after == "prefill":
        d.forward(BatchLayout.extend(["c"], [0], [4]))
    else:
        d.forward(BatchLayout.decode(["b"], [4]))
    for n in range(3):
        d.forward(BatchLayout.decode(["b"], [5 + n]))
    d.t._drain._thread.start()
    d.t.stop()
    rows_of_a = sum(1 for r in sink.records if r.request_id == "a")
    assert sink.at_commit["a"] == rows_of_a


def test_a_commit_does_not_wait_for_the_backlog_behind_its_finish(make_driver, monkeypatch):
    """A finished request's manifest waits for the flight that carries its last rows,
    not for the drain to run out of work: with many prefills queued behind the notice,
    it is committed long before they are all stored."""
    from dmi_sglang.adapters.transport import _drain

    monkeypatch.setattr(_drain, "_BATCH", 2)
    monkeypatch.setattr(_drain.Drain, "start", lambda self: None)  # every item queued first
    sink = _RecordingSink()
    at_commit: dict[str, int] = {}
    real_commit = sink.commit_requests

    def commit_requests(manifests: Sequence[RequestManifest]) -> None:
        for m in manifests:
            at_commit[m.request_id] = len(sink.records)
        real_commit(manifests)

    monkeypatch.setattr(sink, "commit_requests", commit_requests)
    d, _ = make_driver("resid_pre,final_logits", sink=sink, payload_bytes=1 << 20,
                       coalesce_decode=False)
    d.forward(BatchLayout.extend(["a"], [0], [5]))
    d.forward(BatchLayout.extend(["x"], [0], [2]))  # pairs with "a": the notice, with p0
    d.t.finish_request("a", 5, RequestManifest("run-1", "a", 5, 1, committed=True))
    for n in range(40):  # p0's copies are in flight with a's released row
        d.forward(BatchLayout.extend([f"p{n}"], [0], [4]))
    d.t._drain._thread.start()
    d.t.stop()
    assert sink.at_commit["a"] == sum(1 for r in sink.records if r.request_id == "a")
    assert at_commit["a"] < len(sink.records) // 4, (at_commit["a"], len(sink.records))


def test_idle_raises_a_failure_the_sinks_own_thread_found(make_driver):
    """Found in review: the ClickHouse sink's put only queues (its insert fails later on
    a writer thread, which sets the sink's failure): an idle server learns it too."""
    import time

    from dmi_sglang.errors import CaptureError, StoreError
    from dmi_sglang.testing import MemorySink

    sink = MemorySink()
    d, _ = make_driver("resid_pre", sink=sink)
    mon = _monitor(d, sink)
    _prefilled_and_done(mon, d)
    mon.idle()
    deadline = time.monotonic() + 10
    while not sink.manifests and time.monotonic() < deadline:  # a committed, all handed over
        mon.idle()
        time.sleep(0.02)
    assert [m.request_id for m in sink.manifests] == ["a"]
    assert d.t.failure is None
    sink.failure = StoreError("insert failed on the writer thread (disk full)")
    with pytest.raises(CaptureError, match="the capture's store failed: insert failed"):
        mon.idle()


@pytest.mark.parametrize("rule", ["positions(0-4)", "every(2)"])
def test_a_finish_into_a_window_without_request_rows_stores_the_held_row_first(
        make_driver, rule):
    """Request "a"'s prefill holds its final_logits row (position 4, kept by the rule);
    its next decode (position 5, the overlap scheduler's extra forward) keeps no logits
    row under the rule, so it joins a decode window without request rows, and the finish
    notice goes to that window. The held row decided a real token: it reaches the sink
    before "a" is committed (it waited for the stop before)."""
    sink = _RecordingSink()
    d, _ = make_driver(f"resid_pre,final_logits:{rule}", sink=sink, payload_bytes=1 << 20)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 5]))
    d.forward(BatchLayout.decode(["a", "b"], [6, 6]))  # both at 5: no logits row kept
    d.t.finish_request("a", 5, RequestManifest("run-1", "a", 5, 1, committed=True))
    for n in range(3):
        d.forward(BatchLayout.decode(["b"], [7 + n]))
    d.t.stop()
    logits = [(r.start_token_idx, r.end_token_idx) for r in sink.records
              if r.request_id == "a" and r.act_name == "final_logits"]
    assert logits == [(4, 5)]
    assert sink.at_commit["a"] == sum(1 for r in sink.records if r.request_id == "a")
