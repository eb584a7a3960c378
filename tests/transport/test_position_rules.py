"""Position rules on the capture path: ``positions(A-B)`` keeps the rows of those
positions on the device, before they reach the ring (fewer bytes moved), and stores
exactly the rows a full capture holds at those positions."""

from __future__ import annotations

import pytest

from dmi_sglang.domain.layout import BatchLayout

from .conftest import stored_rows, two_requests


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("coalesce", [True, False], ids=["window", "per-step"])
def test_a_position_range_stores_those_rows_of_a_full_capture(make_driver, padded: bool,
                                                               coalesce: bool) -> None:
    full, full_sink = make_driver("resid_pre,final_ln,final_logits", coalesce_decode=coalesce)
    ruled, ruled_sink = make_driver("resid_pre:positions(3-6),final_ln,final_logits",
                                    coalesce_decode=coalesce)
    for d in (full, ruled):
        two_requests(d, padded=padded)
    full_stats, ruled_stats = full.t.stop(), ruled.t.stop()
    ruled.verify(ruled_sink.records)  # every row once, with the bytes of its position

    everything = set(stored_rows(full_sink.records))
    resid = {row for row in everything if "resid_pre" in row[1]}
    kept = {row for row in resid if 3 <= row[3] <= 6}
    assert kept  # the full capture holds rows inside the range
    assert resid - kept  # and outside it
    assert set(stored_rows(ruled_sink.records)) == (everything - resid) | kept
    resid_row_bytes = len(next(iter(resid))[4])
    left_out = len(resid - kept)
    assert full_stats.bytes - ruled_stats.bytes == left_out * resid_row_bytes  # never moved


def test_a_range_outside_every_computed_position_captures_nothing_of_that_hook(make_driver):
    d, sink = make_driver("resid_pre:positions(100-200),final_ln")
    two_requests(d, padded=False)
    d.t.stop()
    d.verify(sink.records)
    assert sink.records
    assert not [r for r in sink.records if "resid_pre" in r.act_name]


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_the_last_prompt_position_is_what_a_full_capture_holds_there(make_driver,
                                                                      padded: bool) -> None:
    selection = "resid_pre:last_prompt,final_ln,final_logits:last_prompt"
    full, full_sink = make_driver("resid_pre,final_ln,final_logits")
    some, some_sink = make_driver(selection)
    some.prompts = {"a": 5, "b": 7}
    for d in (full, some):
        # b's prompt comes in two chunks: the first one (0-3) does not reach position 6
        d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 4], seq_lens=[5, 8]))
        d.forward(BatchLayout.extend(["b"], [4], [3]))
        if padded:
            d.graph_capture(4)
        for n in range(3):
            d.forward(BatchLayout.decode(["a", "b"], [6 + n, 8 + n],
                                         padded_batch_size=4 if padded else None),
                      padded=padded)
    full.t.stop()
    some.t.stop()
    some.verify(some_sink.records)

    last_prompt = {"a": 4, "b": 6}
    want = {row for row in stored_rows(full_sink.records)
            if "final_ln" in row[1] or row[3] == last_prompt[row[0]]}
    assert set(stored_rows(some_sink.records)) == want
    logits = sorted((row[0], row[3]) for row in want if "logits" in row[1])
    assert logits == [("a", 4), ("b", 6)]  # the rows that decided the first tokens


def test_last_prompt_without_a_prompt_length_is_a_commit_error(make_driver) -> None:
    from dmi_sglang.errors import CommitError

    d, _ = make_driver("resid_pre:last_prompt")
    with pytest.raises(CommitError, match="prompt length of request 'a'"):
        d.plan(BatchLayout.extend(["a"], [0], [5]))


def test_the_monitor_gives_the_plans_each_requests_prompt_length(make_driver) -> None:
    from types import SimpleNamespace

    from dmi_sglang.app.session import SchedulerMonitor
    from dmi_sglang.domain.records import RunInfo

    from .conftest import SHAPE

    d, sink = make_driver("resid_pre:last_prompt")
    mon = SchedulerMonitor(run=RunInfo("run-1", "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True)
    reqs = [SimpleNamespace(rid=r, origin_input_ids=[1] * n, output_ids=[], finished=bool)
            for r, n in (("a", 3), ("b", 5))]
    for layout in (BatchLayout.extend(["a", "b"], [0, 0], [3, 5]),
                   BatchLayout.decode(["a", "b"], [4, 6])):
        mon.requests.add_reqs(reqs)
        mon.begin_forward()
        mon.commit_eager(layout)
        d.fire(layout)
        mon.end_forward()
    d.t.stop()
    assert sorted((r.request_id, r.layer_no, r.start_token_idx, r.end_token_idx)
                  for r in sink.records) == [
        (rid, layer, p, p + 1) for rid, p in (("a", 2), ("b", 4)) for layer in range(3)]


def test_a_last_prompt_logits_row_is_stored_without_waiting_for_its_request(make_driver):
    import time

    d, sink = make_driver("final_logits:last_prompt", flush_timeout_s=0.01)
    d.prompts = {"a": 4}
    d.forward(BatchLayout.extend(["a"], [0], [4]))
    for n in range(3):
        d.forward(BatchLayout.decode(["a"], [5 + n]))
    deadline = time.monotonic() + 5
    while not sink.records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(r.start_token_idx, r.end_token_idx) for r in sink.records] == [(3, 4)]
    assert len(d.t._drain.held) == 0  # nothing waits for a later row of the request
    d.t.stop()


@pytest.mark.parametrize("k", [1, 3, 4, 5])
def test_gathered_rows_narrower_than_the_copy_element_arrive_whole(make_driver, k) -> None:
    """``topk(K)`` rows of 4 K bytes, one request left out of decode graph replays: the
    device gathers the kept rows of every segment at once, in elements no wider than a
    row (a 20-byte row is not 8-byte elements)."""
    d, sink = make_driver(f"final_logits:topk({k})")
    d.skip = frozenset({"b"})
    d.forward(BatchLayout.extend(["a", "b", "c"], [0, 0, 0], [5, 3, 4]))
    d.graph_capture(4)
    for n in range(3):
        d.forward(BatchLayout.decode(["a", "b", "c"], [6 + n, 4 + n, 5 + n],
                                     padded_batch_size=4), padded=True)
    d.t.stop()
    d.verify(sink.records)
    assert {r.request_id for r in sink.records} == {"a", "c"}
