"""The request tracker: what the manifests say each request's forwards computed."""

from __future__ import annotations

from types import SimpleNamespace

from dmi_sglang.app.session import RequestTracker
from dmi_sglang.domain.layout import BatchLayout


def _req(rid: str, prompt: int, completion: int) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=[1] * prompt, output_ids=[2] * completion,
                           finished=lambda: True)


def test_an_unchanged_decode_batch_is_folded_with_its_first_and_newest_positions() -> None:
    tracker = RequestTracker()
    tracker.add_reqs([_req("a", 4, 3), _req("b", 6, 2)])
    tracker.add_layout(BatchLayout.extend(["a", "b"], [2, 0], [2, 6]))  # a: cached prefix
    rids = ("a", "b")  # the adapter hands one tuple over while the batch is unchanged
    for step in range(3):
        tracker.add_layout(BatchLayout.decode(rids, [5 + step, 7 + step]))
    by = {m.request_id: m for m in tracker.manifests("run", committed=True)}
    assert by["a"].computed_from == 2
    assert by["b"].computed_from == 0
    assert by["a"].overlap_extra_forward  # a's last decode forwarded position 6 = 4 + 3 - 1
    assert by["b"].overlap_extra_forward  # b reached position 8 > 6 + 2 - 1


def test_the_newest_decode_layout_counts_whichever_tuple_it_holds() -> None:
    tracker = RequestTracker()
    tracker.add_reqs([_req("a", 4, 5)])
    rids = ("a",)
    tracker.add_layout(BatchLayout.decode(rids, [7]))  # positions 6, 7
    tracker.add_layout(BatchLayout.decode(rids, [8]))
    (m,) = tracker.manifests("run", committed=True)
    assert not m.overlap_extra_forward  # position 7 < 4 + 5 - 1
    tracker.add_layout(BatchLayout.decode(("a",), [9]))  # another tuple: position 8
    (m,) = tracker.manifests("run", committed=True)
    assert m.overlap_extra_forward  # position 8 = 4 + 5 - 1: the extra forward
