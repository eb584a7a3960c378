"""An abort of a request waiting to run: SGLang 0.5.19 pops it from its waiting queue and
lets it go unfinished (``Scheduler.abort_request``), so ``finished()`` never reports it;
the runtime hook tells the capture, which ends that request's capture incomplete."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

TARGET = "sglang.srt.managers.scheduler.Scheduler.abort_request"


def test_sglang_lets_waiting_requests_go_unfinished_where_the_hooks_wrap() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import WAITING_ABORTS

    assert TARGET in WAITING_ABORTS
    source = inspect.getsource(Scheduler.abort_request)
    waiting = source[source.index("for i in reversed(to_del)"):]  # the waiting queue's
    waiting = waiting[: waiting.index("\n\n")]
    blocks = [waiting, *(inspect.getsource(getattr(Scheduler, t.rpartition(".")[2]))
                         for t in WAITING_ABORTS if t != TARGET)]
    for block in blocks:
        assert "waiting_queue" in block
        assert ".finished_reason =" not in block  # nothing marks them finished
        assert "to_finish" not in block
    assert "self.waiting_queue.pop(i)" in waiting
    timeout = inspect.getsource(Scheduler._abort_on_waiting_timeout)
    assert "self.waiting_queue = [" in timeout  # the queue is rebuilt without them


class _Req:
    def __init__(self, rid: str, done: bool = False) -> None:
        self.rid, self.done = rid, done

    def finished(self) -> bool:
        return self.done


def test_the_hook_reports_the_requests_the_abort_let_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    hooks = {target: (kind, fn) for target, kind, fn in runtime_hooks.HOOKS}
    kind, around = hooks[TARGET]
    assert kind == "AROUND"
    dropped: list[list[Any]] = []
    mon = SimpleNamespace(active=True, requests_dropped=dropped.append,
                          add_host_seconds=lambda s: None)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    keep, gone = _Req("keep"), _Req("gone-1")
    scheduler = SimpleNamespace(waiting_queue=[keep, gone])

    def abort_request(sched: Any, recv_req: Any) -> str:  # as SGLang's: pops the match
        sched.waiting_queue = [r for r in sched.waiting_queue
                               if not r.rid.startswith(recv_req.rid)]
        return "done"

    assert around(abort_request, scheduler, SimpleNamespace(rid="gone")) == "done"
    assert dropped == [[gone]]
    monkeypatch.setattr(runtime_hooks, "_MONITOR", None)  # not capturing: not asked
    scheduler.waiting_queue = [keep]
    assert around(abort_request, scheduler, SimpleNamespace(rid="keep")) == "done"
    assert dropped == [[gone]]


def test_a_failure_to_report_them_never_fails_an_engines_abort(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    def broken(reqs: Any) -> None:
        raise RuntimeError("the capture's own bug")

    mon = SimpleNamespace(active=True, requests_dropped=broken,
                          add_host_seconds=lambda s: None, run=SimpleNamespace(run_id="r"))
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    monkeypatch.delenv(runtime_hooks.SERVER_MARK, raising=False)
    scheduler = SimpleNamespace(waiting_queue=[_Req("gone")])

    def abort(sched: Any) -> None:  # as _abort_on_waiting_timeout: the queue rebuilt
        sched.waiting_queue = []

    assert runtime_hooks.around_waiting_abort(abort, scheduler) is None
    assert scheduler.waiting_queue == []



def test_the_checks_sglang_runs_every_iteration_cost_nothing_while_their_setting_is_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang calls the waiting-time check every scheduler iteration and the queue limit
    for every new request; each does nothing unless its setting is on, and then neither
    does the hook (no copy of the queue, no report)."""
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    reports: list[list[Any]] = []
    mon = SimpleNamespace(active=True, requests_dropped=reports.append,
                          add_host_seconds=lambda s: None)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    monkeypatch.delenv("SGLANG_REQ_WAITING_TIMEOUT", raising=False)

    def _abort_on_waiting_timeout(sched: Any) -> None:
        return None

    def _abort_on_queued_limit(sched: Any, recv_req: Any) -> bool:
        return False

    scheduler = SimpleNamespace(waiting_queue=[_Req("w")], max_queued_requests=None)
    around = runtime_hooks.around_waiting_abort
    around(_abort_on_waiting_timeout, scheduler)
    around(_abort_on_queued_limit, scheduler, _Req("new"))
    assert reports == []
    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "30")
    scheduler.max_queued_requests = 8
    around(_abort_on_waiting_timeout, scheduler)
    around(_abort_on_queued_limit, scheduler, _Req("new"))
    assert reports == [[], []]  # looked: nothing was let go


def test_requests_a_retraction_ends_for_good_are_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under memory pressure ``retract_decode`` may end requests for good (its third
    value): they leave the batch with ``to_finish`` set but are never processed, so
    ``finished()`` never reports them."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    source = inspect.getsource(ScheduleBatch.retract_decode)
    assert "return retracted_reqs, new_estimate_ratio, reqs_to_abort" in source
    assert "to_finish = FINISH_ABORT(" in source
    hooks = {target: (kind, fn) for target, kind, fn in runtime_hooks.HOOKS}
    kind, after = hooks["sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode"]
    assert kind == "AFTER"
    reports: list[list[Any]] = []
    mon = SimpleNamespace(active=True, requests_dropped=reports.append)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    ended = _Req("ended")
    assert after(([_Req("retracted")], 0.5, [ended]), object()) is None  # result kept
    after(([_Req("retracted")], 0.5, []), object())  # nothing ended: nothing to say
    assert reports == [[ended]]
    monkeypatch.setattr(runtime_hooks, "_MONITOR", None)
    after(([], 0.5, [ended]), object())
    assert reports == [[ended]]
