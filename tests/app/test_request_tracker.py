"""The request tracker: what the manifests say each request's forwards computed."""

from __future__ import annotations

from types import SimpleNamespace

import structlog.testing

from dmi_sglang.app.session import RequestTracker
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.sampling import RequestSample


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


def test_a_finished_request_is_kept_as_two_lengths_not_as_its_req() -> None:
    import gc
    import weakref

    class Req:
        def __init__(self, rid: str, prompt: int, completion: int) -> None:
            self.rid, self.origin_input_ids = rid, [1] * prompt
            self.output_ids = [2] * completion
            self.done = False

        def finished(self) -> bool:
            return self.done

    tracker = RequestTracker()
    req = Req("a", 4, 2)
    tracker.add_reqs([req])
    tracker.add_layout(BatchLayout.extend(["a"], [0], [4]))
    assert tracker.take_finished() == []
    req.done = True
    assert tracker.take_finished() == [("a", 5)]
    tracker.add_reqs([req])  # the overlap scheduler's extra forward still names it
    tracker.add_layout(BatchLayout.decode(["a"], [6]))
    gone = weakref.ref(req)
    del req
    gc.collect()
    assert gone() is None  # nothing of the tracker holds the finished Req
    (m,) = tracker.manifests("run", committed=True)
    assert (m.prompt_tokens, m.completion_tokens, m.committed) == (4, 2, True)
    assert m.overlap_extra_forward  # position 5 = 4 + 2 - 1 was forwarded
    assert tracker.take_all() == []  # reported once


class _Counted:
    """A Req whose ``finished()`` calls are counted."""

    calls = 0

    def __init__(self, rid: str) -> None:
        self.rid, self.origin_input_ids, self.output_ids = rid, [1] * 3, [2]
        self.done = False

    def finished(self) -> bool:
        _Counted.calls += 1
        return self.done


def test_an_unchanged_batch_skips_the_scan_and_a_changed_one_reports_the_finish() -> None:
    tracker = RequestTracker()
    a, b = _Counted("a"), _Counted("b")
    tracker.add_reqs([a, b])
    assert tracker.take_finished() == []
    _Counted.calls = 0
    tracker.add_reqs([a, b])  # the same running batch: nothing can have finished since
    assert tracker.take_finished() == []
    assert _Counted.calls == 0
    a.done = True  # a's last token came with the forward just launched (the overlap
    tracker.add_reqs([a, b])  # scheduler's extra forward still holds a)
    assert tracker.take_finished() == []
    tracker.add_reqs([b])  # the engine dropped a: the batch changed, the scan finds it
    assert tracker.take_finished() == [("a", 3 + 1 - 1)]
    assert _Counted.calls == 2


def test_without_batches_every_call_scans() -> None:
    tracker = RequestTracker()
    a = _Counted("a")
    tracker.add_reqs([a])
    assert tracker.take_finished() == []
    a.done = True
    assert tracker.take_finished() == [("a", 3)]


def test_a_changed_batch_given_twice_before_a_scan_still_scans() -> None:
    tracker = RequestTracker()
    a, b = _Counted("a"), _Counted("b")
    tracker.add_reqs([a, b])
    assert tracker.take_finished() == []
    a.done = True
    tracker.add_reqs([b])  # the engine dropped a: changed
    tracker.add_reqs([b])  # given again before the forward began: still a change to scan
    assert tracker.take_finished() == [("a", 3)]



def test_a_cancelled_request_is_never_complete_whenever_its_finish_is_seen() -> None:
    """A request the engine ended by an abort (a client that cancelled or went away)
    keeps what was captured, but its manifest is never committed: whether its finish was
    taken while serving (its Req let go) or only at stop. A request that finished
    normally beside it is complete."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

    from dmi_sglang.adapters.sglang_v0519.batch import request_cancelled

    def req(rid: str, reason: object) -> SimpleNamespace:
        r = _req(rid, 4, 2)
        r.finished_reason = reason
        r.finished = lambda: r.finished_reason is not None
        return r

    for taken_while_serving in (True, False):
        tracker = RequestTracker(cancelled=request_cancelled)
        done, gone = req("done", FINISH_LENGTH(length=2)), req("gone", None)
        tracker.add_reqs([done, gone])
        tracker.add_layout(BatchLayout.extend(["done", "gone"], [0, 0], [4, 4]))
        gone.finished_reason = FINISH_ABORT("client disconnected")
        if taken_while_serving:
            # in the batch about to run, a finished request runs once more: not yet
            assert tracker.take_finished() == []
            tracker.ran()  # that batch ran, none follows (the engine is idle)
            assert sorted(r for r, _ in tracker.take_finished()) == ["done", "gone"]
        else:
            assert sorted(r for r, _ in tracker.take_all()) == ["done", "gone"]
        by = {m.request_id: m for m in tracker.manifests("run", committed=True)}
        assert by["done"].committed
        assert not by["gone"].committed
        assert tracker.cancelled_requests == 1
    assert not request_cancelled(SimpleNamespace(finished_reason=None))
    assert not request_cancelled(SimpleNamespace())


def test_a_reused_id_stays_left_out_also_when_its_first_request_was_left_out() -> None:
    """A request the capture left out (it asked not to be) finishes; a later request
    with the same id is never captured either, not even after the left-out id's
    grace rounds end, and it is counted once."""

    class Req:
        def __init__(self, rid: str, prompt: int) -> None:
            self.rid, self.origin_input_ids = rid, [1] * prompt
            self.output_ids: list[int] = []
            self.done = False

        def finished(self) -> bool:
            return self.done

    first, other = Req("x", 3), Req("o", 2)
    tracker = RequestTracker(asked=lambda r: False if r is first else None)

    def forward(batch: list[Req]) -> bool:
        tracker.add_reqs(batch)
        tracker.take_finished()
        return "x" in tracker.skipped

    assert forward([first, other])
    first.done = True
    again = Req("x", 5)
    assert all(forward([again, other]) for _ in range(6))
    assert tracker.reused_requests == 1


def test_a_running_request_whose_id_a_new_request_takes_is_never_complete() -> None:
    """Found in review: SGLang forgets a streamed request whose client went away while
    the scheduler runs it on, and admits its id again. Rows carry only the id, so
    neither request is captured from then on; the first one's capture, cut short, was
    still committed. It is not now, whether its finish is taken while serving or at stop;
    a finished request whose id comes back keeps its complete capture."""
    for taken_while_serving in (True, False):
        t = RequestTracker()
        first, done = _req("req-1", 4, 0), _req("req-2", 4, 0)
        for r in (first, done):
            r.finished = lambda r=r: bool(r.output_ids) and r.output_ids[-1] == 0
        t.add_reqs([first, done])
        t.add_layout(BatchLayout.extend(["req-1", "req-2"], [0, 0], [4, 4]))
        assert t.take_finished() == []
        done.output_ids.append(0)  # req-2 finished; its finish is not taken yet
        again, again_done = _req("req-1", 3, 0), _req("req-2", 3, 0)
        with structlog.testing.capture_logs() as logs:
            t.add_reqs([first, again, again_done])
        assert sorted((e["event"], e["request_id"]) for e in logs) == [
            ("dmi.request_id_reused", "req-2"),  # finished: its capture stays complete
            ("dmi.request_id_taken_while_running", "req-1")]
        assert {"req-1", "req-2"} <= t.skipped  # the new ones are not captured
        first.output_ids.append(0)
        if taken_while_serving:
            t.ran()
            assert sorted(r for r, _ in t.take_finished()) == ["req-1", "req-2"]
            assert t.commit("run", "req-1") is None
            assert t.commit("run", "req-2") is not None
        else:
            by = {m.request_id: m for m in t.manifests("run", committed=True)}
            assert not by["req-1"].committed
            assert by["req-2"].committed
        assert t.cancelled_requests == 1


class _Running:
    """A Req that finishes when told (SGLang's ``finished()``)."""

    def __init__(self, rid: str, prompt: int, completion: int = 0) -> None:
        self.rid, self.origin_input_ids = rid, [1] * prompt
        self.output_ids = [2] * completion
        self.done = False

    def finished(self) -> bool:
        return self.done


def test_a_finished_request_in_the_batch_about_to_run_waits_beside_a_reused_id() -> None:
    tracker = RequestTracker()
    old_r, a = _Running("r", 3, 1), _Running("a", 4, 1)
    tracker.add_reqs([old_r, a])
    assert tracker.take_finished() == []
    old_r.done = True
    tracker.add_reqs([a])
    assert tracker.take_finished() == [("r", 3)]
    a.done = True  # a batch built before this result was processed runs "a" once more
    tracker.add_reqs([a, _Running("r", 2)])  # ... beside a new request reusing "r"
    assert tracker.take_finished() == []  # reported after that forward
    tracker.add_reqs([_Running("x", 2)])
    assert tracker.take_finished() == [("a", 4)]


def test_a_long_run_that_leaves_requests_out_keeps_nothing_of_them() -> None:
    """With a sample of 0 (``serve`` without --request-sample) nothing is stored, so
    nothing of a finished request needs keeping once its grace rounds passed."""
    tracker = RequestTracker(RequestSample(0.0))
    for wave in range(50):
        reqs = [_Running(f"w{wave}-{i}", 4, 1) for i in range(8)]
        tracker.add_reqs(reqs)
        tracker.add_layout(BatchLayout.extend([r.rid for r in reqs], [0] * 8, [4] * 8))
        assert tracker.take_finished() == []
        for r in reqs:
            r.done = True
        tracker.ran()
        assert tracker.take_finished() == []  # left out: nothing to report
    assert len(tracker._seen) <= 3 * 8  # the last waves' grace rounds, not 400
    assert tracker.seen_requests == 400
    assert tracker.captured_requests == 0


class _Asking(_Running):
    def __init__(self, rid: str, prompt: int, completion: int = 0,
                 capture: bool | None = None) -> None:
        super().__init__(rid, prompt, completion)
        self.capture = capture


def _asked(req: _Asking) -> object:
    return req.capture


def test_a_forgotten_left_out_request_is_not_brought_back_by_a_pending_decode_layout() -> None:
    """Found in review: the idle report leaves the newest decode layout pending; once a
    left-out request in it was forgotten, the next fold made it anew, as captured."""
    tracker = RequestTracker(asked=_asked)
    c, left = _Asking("c", 4, 1), _Asking("l", 4, 1, capture=False)
    tracker.add_reqs([c, left])
    tracker.add_layout(BatchLayout.extend(["c", "l"], [0, 0], [4, 4]))
    assert tracker.take_finished() == []
    assert tracker.skipped == {"l"}
    tracker.add_layout(BatchLayout.decode(("c", "l"), [5, 5]))
    c.done = left.done = True
    tracker.ran()  # the engine idles
    assert tracker.take_finished() == [("c", 4)]
    tracker.fold_pending()  # as the monitor's report does
    for _ in range(3):  # idle rounds: "l"'s grace rounds pass, it is forgotten
        tracker.ran()
        assert tracker.take_finished() == []
    assert "l" not in tracker._seen
    x = _Asking("x", 3)
    tracker.add_reqs([x])
    tracker.add_layout(BatchLayout.extend(["x"], [0], [3]))  # folds what was pending
    assert "l" not in tracker._seen
    tracker.add_reqs([_Asking("l", 2, capture=False)])  # its id again, asking out
    assert "l" in tracker.skipped
    assert [rid for rid, _ in tracker.take_all()] == ["x"]
