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


def test_sglang_pops_an_aborted_waiting_request_without_finishing_it() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    source = inspect.getsource(Scheduler.abort_request)
    waiting = source[source.index("for i in reversed(to_del)"):]
    waiting = waiting[: waiting.index("\n\n")]
    assert "self.waiting_queue.pop(i)" in waiting
    assert "finished_reason" not in waiting
    assert "to_finish" not in waiting


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
