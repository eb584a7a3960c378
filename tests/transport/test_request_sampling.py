"""Requests left out of a capture (request sampling, a caller's ``dmi_capture=False``):
their rows are dropped on the device like padding, every other request's rows are
stored exactly as a full capture stores them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog.testing

from dmi_sglang.domain.layout import BatchLayout

from .conftest import stored_rows


def _forwards(d, *, padded: bool) -> None:
    d.forward(BatchLayout.extend(["a", "b", "c"], [0, 0, 0], [5, 3, 4]))
    if padded:
        d.graph_capture(4)
    for n in range(5):
        d.forward(BatchLayout.decode(["a", "b", "c"], [6 + n, 4 + n, 5 + n],
                                     padded_batch_size=4 if padded else None), padded=padded)
    d.forward(BatchLayout.decode(["a", "c"], [11, 10]))  # b finished


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("coalesce", [True, False], ids=["window", "per-step"])
def test_a_left_out_request_stores_nothing_and_the_others_all_they_would(
        make_driver, padded: bool, coalesce: bool) -> None:
    selection = "resid_pre,final_ln:positions(4-8),final_logits"
    full, full_sink = make_driver(selection, coalesce_decode=coalesce)
    some, some_sink = make_driver(selection, coalesce_decode=coalesce)
    some.skip = frozenset({"b"})
    for d in (full, some):
        _forwards(d, padded=padded)
    full_stats, some_stats = full.t.stop(), some.t.stop()
    some.verify(some_sink.records)  # every planned row once, with its position's bytes
    everything = set(stored_rows(full_sink.records))
    of_b = {row for row in everything if row[0] == "b"}
    assert of_b
    assert set(stored_rows(some_sink.records)) == everything - of_b
    assert full_stats.bytes - some_stats.bytes == sum(len(row[4]) for row in of_b)


def test_a_window_coalesces_the_captured_requests_of_decode_steps(make_driver) -> None:
    d, sink = make_driver("resid_pre")
    d.skip = frozenset({"b"})
    for n in range(4):
        d.forward(BatchLayout.decode(["a", "b", "c"], [6 + n, 4 + n, 5 + n]))
    d.t.stop()
    d.verify(sink.records)
    counters = d.t.drain_counters()
    assert counters["window_flushes"] == 1
    assert {(r.request_id, r.start_token_idx, r.end_token_idx) for r in sink.records} == {
        ("a", 5, 9), ("c", 4, 8)}


class _Req:
    """What the monitor reads of SGLang's Req, with the sampling parameters' custom
    params the caller sent."""

    def __init__(self, rid: str, prompt: int, asked: object = None) -> None:
        self.rid = rid
        self.origin_input_ids = list(range(prompt))
        self.output_ids: list[int] = [7]
        self.sampling_params = SimpleNamespace(
            custom_params=None if asked is None else {"dmi_capture": asked})

    def finished(self) -> bool:
        return False


def test_the_monitor_captures_the_requests_that_ask_or_are_sampled(make_driver) -> None:
    from dmi_sglang.adapters.sglang_v0519.batch import capture_param
    from dmi_sglang.app.session import SchedulerMonitor
    from dmi_sglang.domain.records import RunInfo
    from dmi_sglang.domain.sampling import RequestSample

    from .conftest import SHAPE

    d, sink = make_driver("resid_pre,final_logits")
    mon = SchedulerMonitor(run=RunInfo("run-1", "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True,
                           sample=RequestSample(0.0), asked=capture_param)
    # "c" and "d" ask with a string and a number (an HTTP client's "true", 1): no choice;
    # said once a run
    reqs = [_Req("a", 3, asked=True), _Req("b", 2, asked=False), _Req("c", 4, asked="true"),
            _Req("d", 2, asked=1)]
    layouts = [BatchLayout.extend(["a", "b", "c", "d"], [0, 0, 0, 0], [3, 2, 4, 2]),
               BatchLayout.decode(["a", "b", "c", "d"], [4, 3, 5, 3]),
               BatchLayout.decode(["a", "b", "c", "d"], [5, 4, 6, 4])]
    with structlog.testing.capture_logs() as logs:
        for layout in layouts:
            mon.requests.add_reqs(reqs)
            mon.begin_forward()
            mon.commit_eager(layout)
            d.fire(layout)
            mon.end_forward()
    told = [e for e in logs if e["event"] == "dmi.capture_choice_ignored"]
    assert [(e["request_id"], e["value"]) for e in told] == [("c", "'true'")]
    assert mon.requests.skipped == {"b", "c", "d"}
    timing = mon.timing(d.t.stats())
    assert (timing["requests_seen"], timing["requests_captured"]) == (4, 1)
    manifests = mon.requests.manifests("run-1", committed=False)
    assert [m.request_id for m in manifests] == ["a"]
    d.t.stop()
    assert {r.request_id for r in sink.records} == {"a"}
    resid = sorted((r.layer_no, p) for r in sink.records if "resid_pre" in r.act_name
                   for p in range(r.start_token_idx, r.end_token_idx))
    assert resid == [(layer, p) for layer in range(3) for p in range(5)]


def test_a_left_out_request_forwarded_after_it_finished_stays_left_out(make_driver) -> None:
    from dmi_sglang.adapters.sglang_v0519.batch import capture_param
    from dmi_sglang.app.session import SchedulerMonitor
    from dmi_sglang.domain.records import RunInfo

    from .conftest import SHAPE

    d, sink = make_driver("resid_pre,final_logits")
    mon = SchedulerMonitor(run=RunInfo("run-1", "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True,
                           asked=capture_param)
    a, b = _Req("a", 3, asked=False), _Req("b", 2)
    a.done = False
    a.finished = lambda: a.done  # type: ignore[method-assign]

    def forward(layout: BatchLayout) -> None:
        mon.add_requests([r for r in (a, b) if r.rid in layout.request_ids], frozenset())
        mon.begin_forward()
        mon.commit_eager(layout)
        d.fire(layout)
        mon.end_forward()

    forward(BatchLayout.extend(["a", "b"], [0, 0], [3, 2]))
    forward(BatchLayout.decode(["a", "b"], [4, 3]))
    a.done = True  # the overlap scheduler's extra forward still names it
    forward(BatchLayout.decode(["a", "b"], [5, 4]))
    forward(BatchLayout.decode(["b"], [5]))  # the engine dropped it: reported finished
    forward(BatchLayout.decode(["b"], [6]))
    assert mon.requests.skipped == frozenset({"a"})  # a batch built before may name it
    forward(BatchLayout.decode(["b"], [7]))
    assert mon.requests.skipped == frozenset()  # let go once it can no longer come back
    d.t.stop()
    assert {r.request_id for r in sink.records} == {"b"}
