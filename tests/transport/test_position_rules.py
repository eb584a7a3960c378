"""Position rules on the capture path: ``positions(A-B)`` keeps the rows of those
positions on the device, before they reach the ring (fewer bytes moved), and stores
exactly the rows a full capture holds at those positions."""

from __future__ import annotations

import pytest

from dmi_sglang.domain.layout import BatchLayout


def _forwards(d, *, padded: bool) -> None:
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    if padded:
        d.graph_capture(4)
    for n in range(4):
        d.forward(BatchLayout.decode(["a", "b"], [6 + n, 4 + n], padded_batch_size=4 if padded
                                     else None), padded=padded)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("coalesce", [True, False], ids=["window", "per-step"])
def test_a_position_range_stores_those_rows_of_a_full_capture(make_driver, padded: bool,
                                                               coalesce: bool) -> None:
    full, full_sink = make_driver("resid_pre,final_ln,final_logits", coalesce_decode=coalesce)
    ruled, ruled_sink = make_driver("resid_pre:positions(3-6),final_ln,final_logits",
                                    coalesce_decode=coalesce)
    for d in (full, ruled):
        _forwards(d, padded=padded)
    full_stats, ruled_stats = full.t.stop(), ruled.t.stop()
    ruled.verify(ruled_sink.records)  # every row once, with the bytes of its position

    def rows(records):
        """(request, hook, layer, position, row bytes) of every stored row."""
        out = set()
        for r in records:
            width = len(r.payload) // r.rows
            for i in range(r.rows):
                out.add((r.request_id, r.act_name, r.layer_no, r.start_token_idx + i,
                         bytes(r.payload[i * width : (i + 1) * width])))
        return out

    everything = rows(full_sink.records)
    resid = {row for row in everything if "resid_pre" in row[1]}
    kept = {row for row in resid if 3 <= row[3] <= 6}
    assert kept  # the full capture holds rows inside the range
    assert resid - kept  # and outside it
    assert rows(ruled_sink.records) == (everything - resid) | kept
    resid_row_bytes = len(next(iter(resid))[4])
    left_out = len(resid - kept)
    assert full_stats.bytes - ruled_stats.bytes == left_out * resid_row_bytes  # never moved


def test_a_range_outside_every_computed_position_captures_nothing_of_that_hook(make_driver):
    d, sink = make_driver("resid_pre:positions(100-200),final_ln")
    _forwards(d, padded=False)
    d.t.stop()
    d.verify(sink.records)
    assert sink.records
    assert not [r for r in sink.records if "resid_pre" in r.act_name]
