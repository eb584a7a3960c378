"""Requests left out of a capture (request sampling, a caller's ``dmi_capture=False``):
their rows are dropped on the device like padding, every other request's rows are
stored exactly as a full capture stores them."""

from __future__ import annotations

import pytest

from dmi_sglang.domain.layout import BatchLayout


def _forwards(d, *, padded: bool) -> None:
    d.forward(BatchLayout.extend(["a", "b", "c"], [0, 0, 0], [5, 3, 4]))
    if padded:
        d.graph_capture(4)
    for n in range(5):
        d.forward(BatchLayout.decode(["a", "b", "c"], [6 + n, 4 + n, 5 + n],
                                     padded_batch_size=4 if padded else None), padded=padded)
    d.forward(BatchLayout.decode(["a", "c"], [11, 10]))  # b finished


def _rows(records) -> set[tuple]:
    out = set()
    for r in records:
        width = len(r.payload) // r.rows
        for i in range(r.rows):
            out.add((r.request_id, r.act_name, r.layer_no, r.start_token_idx + i,
                     bytes(r.payload[i * width : (i + 1) * width])))
    return out


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
    everything = _rows(full_sink.records)
    of_b = {row for row in everything if row[0] == "b"}
    assert of_b
    assert _rows(some_sink.records) == everything - of_b
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
