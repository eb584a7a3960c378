"""The overlap scheduler's extra forward: its final_logits row is discarded, nothing else.

SGLang's overlap scheduler forwards each request's last generated token once more (the
scheduler learns the request finished one step later). Token rows of that forward are
stored; its final_logits row decides a token that is never generated and must not be.
"""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmi_sglang.app.session import SchedulerMonitor
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.ports import HookPart
from dmi_sglang.domain.records import RunInfo

from .conftest import SHAPE, Driver  # type: ignore[import-not-found]
from .conftest import TrackedReq as _Req  # type: ignore[import-not-found]

LOGITS = "final_logits"


def _drop(d: Driver, rid: str, pos: int) -> None:
    """The extra forward's logits row at ``pos`` is not expected."""
    d.expected[(rid, LOGITS, -1)].remove((pos, pos + 1))


def _coverage(records, rid: str, act: str, layer: int) -> list[int]:
    return sorted(p for r in records if (r.request_id, r.act_name, r.layer_no) == (rid, act, layer)
                  for p in range(r.start_token_idx, r.end_token_idx))


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("notice_after_flush", [True, False])
def test_extra_forward_logits_row_is_discarded(make_driver, coalesce, notice_after_flush):
    d, sink = make_driver("resid_pre,token_ids,final_logits", coalesce_decode=coalesce,
                          flush_timeout_s=0.01 if notice_after_flush else 30.0)
    # a: prompt 5, completion 3 (tokens at 5, 6, 7); b keeps going and finishes at stop.
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 4]))  # logits at 4 / 3
    d.forward(BatchLayout.decode(["a", "b"], [6, 5]))          # a: logits at 5 -> token 6
    d.forward(BatchLayout.decode(["a", "b"], [7, 6]))          # a: at 6 -> token 7 (last)
    d.forward(BatchLayout.decode(["a", "b"], [8, 7]))          # a: the extra forward at 7
    if notice_after_flush:
        time.sleep(0.2)  # the window went out; a's newest logits row is held on its own
    d.t.finish_request("a", 5 + 3 - 1)                         # learned one step later
    d.forward(BatchLayout.decode(["b"], [8]))
    stats = d.t.stop()
    _drop(d, "a", 7)
    d.verify(sink.records)
    assert _coverage(sink.records, "a", LOGITS, -1) == [4, 5, 6]  # [prompt-1, p+c-1)
    assert _coverage(sink.records, "a", "blocks.hook_resid_pre", 1) == list(range(8))
    assert _coverage(sink.records, "a", "token_ids", -1) == list(range(8))
    assert _coverage(sink.records, "b", LOGITS, -1) == [3, 4, 5, 6, 7]  # nothing dropped
    assert stats.discarded_logit_rows == 1
    assert stats.rows == sum(r.rows for r in sink.records)


def test_request_without_extra_forward_keeps_every_row(make_driver):
    d, sink = make_driver()
    d.forward(BatchLayout.extend(["a"], [0], [3]))  # logits at 2 -> token 3
    d.forward(BatchLayout.decode(["a"], [4]))       # at 3 -> token 4 (last: completion 2)
    d.t.finish_request("a", 3 + 2 - 1)              # no overlap: nothing past position 3
    stats = d.t.stop()
    d.verify(sink.records)
    assert _coverage(sink.records, "a", LOGITS, -1) == [2, 3]
    assert stats.discarded_logit_rows == 0


def test_unfinished_requests_keep_everything_at_stop(make_driver):
    d, sink = make_driver(flush_timeout_s=0.01)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [2, 6]))
    for n in range(3):
        d.forward(BatchLayout.decode(["a", "b"], [3 + n, 7 + n]))
    d.t.finish_request("a", None)  # what the monitor sends for an unfinished request
    stats = d.t.stop()              # b gets no notice at all: kept as well
    d.verify(sink.records)
    assert stats.discarded_logit_rows == 0
    assert d.t.drain_counters()["held_rows"] == 0


def test_retracted_request_keeps_recomputed_rows_and_drops_only_the_extra_one(make_driver):
    d, sink = make_driver("resid_pre,final_logits", flush_timeout_s=0.01)
    d.forward(BatchLayout.extend(["a"], [0], [4]))             # logits at 3 -> token 4
    for seq_len in (5, 6, 7):                                   # at 4, 5, 6 -> tokens 5..7
        d.forward(BatchLayout.decode(["a"], [seq_len]))
    time.sleep(0.05)
    d.forward(BatchLayout.extend(["a"], [0], [7], seq_lens=[7]))  # retracted: recomputed
    d.forward(BatchLayout.decode(["a"], [8]))                   # at 7 -> token 8 (last)
    d.forward(BatchLayout.decode(["a"], [9]))                   # the extra forward at 8
    d.t.finish_request("a", 4 + 5 - 1)
    stats = d.t.stop()
    _drop(d, "a", 8)
    d.verify(sink.records)
    logits = [(r.start_token_idx, r.end_token_idx, r.seq) for r in sink.records
              if r.act_name == LOGITS]
    assert sorted(p for a, b, _ in logits for p in range(a, b)) == [3, 4, 5, 6, 6, 7]
    assert max(s for a, _, s in logits if a == 6) == 5  # the recomputation supersedes
    assert stats.discarded_logit_rows == 1


def test_held_rows_are_bounded_by_live_requests(make_driver):
    d, sink = make_driver(flush_timeout_s=0.005)
    rids = [f"r{i}" for i in range(5)]
    d.forward(BatchLayout.extend(rids, [0] * 5, [2] * 5))
    for n in range(20):
        d.forward(BatchLayout.decode(rids, [3 + n] * 5))
        assert d.t.drain_counters()["held_rows"] <= len(rids)
    deadline = time.monotonic() + 5  # the window times out, then holds one newest row each
    while d.t.drain_counters()["held_rows"] != len(rids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.t.drain_counters()["held_rows"] == len(rids)
    d.t.stop()
    d.verify(sink.records)


# -- a random overlap scheduler -----------------------------------------------------------

requests = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 5), st.booleans(), st.integers(0, 4)),
    min_size=1, max_size=6,
)


def _prefill(d: Driver, rid: str, prompt: int, chunk: int) -> None:
    for start in range(0, prompt, chunk):
        n = min(chunk, prompt - start)
        d.forward(BatchLayout.extend([rid], [start], [n], seq_lens=[prompt]))


def _decode(d: Driver, rids: list[str], seq_lens: list[int], *, padded: bool) -> None:
    if padded:
        d.forward(BatchLayout.decode(rids, seq_lens, padded_batch_size=8), padded=True)
    else:
        d.forward(BatchLayout.decode(rids, seq_lens))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, padded=st.booleans(), coalesce=st.booleans(),
       window_bytes=st.sampled_from([150, 1 << 20]), notify_late=st.booleans(),
       chunk=st.integers(2, 9))
def test_any_overlap_schedule_stores_exact_logits_coverage(
    make_driver, reqs, padded, coalesce, window_bytes, notify_late, chunk
):
    """Requests (prompt, completion, extra forward?, arrival step) decode together; a
    finish notice follows one step (or, late, two steps) after each last forward."""
    d, sink = make_driver("resid_pre,token_ids,final_logits", max_graph_batch=8,
                          coalesce_decode=coalesce, coalesce_max_bytes=window_bytes,
                          max_prefill_tokens=16)
    if padded:
        d.graph_capture(8)
    state = {}  # rid -> [prompt, completion, extra, next position, forwards left]
    notices: list[tuple[int, str, int]] = []
    step = 0
    pending = sorted(enumerate(reqs), key=lambda x: x[1][3])
    while pending or state:
        while pending and pending[0][1][3] <= step:
            i, (prompt, completion, extra, _) = pending.pop(0)
            _prefill(d, f"q{i}", prompt, chunk)
            state[f"q{i}"] = [prompt, completion, extra, prompt, completion - 1 + int(extra)]
        for when, rid, end in [n for n in notices if n[0] <= step]:
            d.t.finish_request(rid, end)
            notices.remove((when, rid, end))
        live = [r for r, s in state.items() if s[4] > 0]
        if live:
            _decode(d, live, [state[r][3] + 1 for r in live], padded=padded)
            for r in live:
                state[r][3] += 1
                state[r][4] -= 1
        for rid in [r for r, s in state.items() if s[4] == 0]:
            prompt, completion, extra, _, _ = state.pop(rid)
            notices.append((step + 1 + int(notify_late), rid, prompt + completion - 1))
            if extra:
                _drop(d, rid, prompt + completion - 1)
        step += 1
    for _, rid, end in notices:  # the monitor's notices at stop
        d.t.finish_request(rid, end)
    stats = d.t.stop()
    d.verify(sink.records)
    for i, (prompt, completion, extra, _) in enumerate(reqs):
        rid = f"q{i}"
        assert _coverage(sink.records, rid, LOGITS, -1) == list(
            range(prompt - 1, prompt + completion - 1))
        assert _coverage(sink.records, rid, "token_ids", -1) == list(
            range(prompt + completion - 1 + int(extra)))
    assert stats.discarded_logit_rows == sum(1 for *_, extra, _ in reqs if extra)
    assert d.t.drain_counters()["held_rows"] == 0


# -- the monitor's side -------------------------------------------------------------------

def test_monitor_reports_finished_requests_one_step_later_and_all_at_stop(make_driver):
    d, sink = make_driver("resid_pre,final_logits")
    run = RunInfo("run-1", "toy", (), (), "2026-01-01T00:00:00+00:00")
    mon = SchedulerMonitor(run=run, selection=d.selection, shape=SHAPE, transport=d.t,
                           sink=sink, strip=True)
    a, b = _Req("a", 3), _Req("b", 2)

    def forward(layout: BatchLayout, reqs) -> None:
        mon.requests.add_reqs(reqs)
        mon.begin_forward()
        mon.commit_eager(layout)
        d.fire(layout)
        mon.end_forward()
        d.step += 1
        plan = d.plan(layout)
        for seg in plan.segments:
            for sl in plan.slices(seg):
                d.expected[(sl.request_id, seg.hook.act_name, seg.layer_no)].append(
                    (sl.start, sl.end))

    forward(BatchLayout.extend(["a", "b"], [0, 0], [3, 2]), [a, b])
    a.output_ids.append(1)  # the result of the prefill: a's token at 3, b's at 2
    b.output_ids.append(1)
    forward(BatchLayout.decode(["a", "b"], [4, 3]), [a, b])  # a at 3 -> its last token
    # overlap: the next batch is launched before the previous result is processed
    forward(BatchLayout.decode(["a", "b"], [5, 4]), [a, b])  # a's extra forward at 4
    a.output_ids.append(2)
    a.done = True  # result of the step before: a finished (completion 2)
    b.output_ids.append(2)
    forward(BatchLayout.decode(["b"], [5]), [b])  # begin_forward reports a: end 3 + 2 - 1
    mon.stop()  # b is unfinished: everything kept
    _drop(d, "a", 4)
    d.verify(sink.records)
    assert _coverage(sink.records, "a", LOGITS, -1) == [2, 3]
    assert _coverage(sink.records, "b", LOGITS, -1) == [1, 2, 3, 4]
    assert d.t.stats().discarded_logit_rows == 1
    (_, manifests), = sink.finished  # a was committed when it finished, not at stop
    assert [(m.request_id, m.committed) for m in manifests] == [("b", False)]
    by_rid = {m.request_id: m for m in sink.manifests}
    assert by_rid["a"].committed
    assert by_rid["a"].overlap_extra_forward
    assert (by_rid["a"].prompt_tokens, by_rid["a"].completion_tokens) == (3, 2)
    assert not by_rid["b"].committed


def test_a_graph_step_commits_the_plan_its_preflight_built(make_driver):
    d, sink = make_driver("resid_pre")
    run = RunInfo("run-2", "toy", (), (), "2026-01-01T00:00:00+00:00")
    mon = SchedulerMonitor(run=run, selection=d.selection, shape=SHAPE, transport=d.t,
                           sink=sink, strip=True)
    layout = BatchLayout.decode(["a", "b"], [3, 4])

    def unexpected() -> BatchLayout:
        raise AssertionError("the preflighted plan was not reused")

    mon.begin_forward()
    assert mon.graph_allowed(layout, 4)
    plan = mon.graph_plan(4, unexpected)
    assert plan.padded
    assert plan.layout == layout.with_padding(4)
    mon.abort_forward()
    mon.begin_forward()  # a new forward never reuses the previous step's plan
    fresh = mon.graph_plan(4, lambda: layout)
    assert fresh.layout == layout.with_padding(4)
    assert mon.graph_allowed(layout, 4)
    other = mon.graph_plan(8, lambda: layout)  # another bucket: planned anew
    assert other.layout.padded_batch_size == 8
    mon.abort_forward()
    d.t.stop()


def test_the_hooks_time_is_split_by_the_kind_of_forward_it_was_spent_for(
        make_driver, monkeypatch) -> None:
    """``host_graph_seconds`` holds what the hooks spent for decode graph replays: their
    batch hook (counted before the forward's commit), preflight, commit and seal; a
    prefill's, and a decode step's the preflight sent to run eagerly, stay out of it.
    The amounts are powers of two, so the sums are exact."""
    from dmi_sglang.domain.capacity import Decision, Preflight

    d, sink = make_driver("resid_pre")
    mon = SchedulerMonitor(run=RunInfo("run-9", "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True)
    spent = 0.0

    def hook(seconds: float, *, before_forward: bool = False,
             part: HookPart | None = None) -> None:
        nonlocal spent
        spent += seconds
        mon.add_host_seconds(seconds, before_forward=before_forward, part=part)

    def prefill(rids: list[str], seconds: float) -> None:
        hook(seconds, before_forward=True)  # the batch hook
        mon.begin_forward()
        layout = BatchLayout.extend(rids, [0] * len(rids), [3] * len(rids))
        mon.commit_eager(layout)
        hook(seconds)  # the eager commit
        d.fire(layout)
        mon.end_forward()
        hook(seconds)  # around the forward: begin and seal

    def graph_step(position: int, seconds: float) -> None:
        hook(seconds, before_forward=True)  # the batch hook
        mon.begin_forward()
        layout = BatchLayout.decode(["a", "b"], [position, position])
        assert mon.graph_allowed(layout, 4)
        hook(2 * seconds, part="preflight")
        mon.commit_graph(mon.graph_plan(4, lambda: layout))
        hook(4 * seconds, part="commit")
        d.fire(layout, padding=2)
        mon.end_forward()
        hook(8 * seconds, part="end")  # around the forward: the seal ...
        hook(16 * seconds, part="begin")  # ... and its start, counted after it

    prefill(["a", "b"], 0.5)
    graph_step(4, 2.0)
    prefill(["c"], 0.25)
    graph_step(5, 32.0)
    with monkeypatch.context() as patch:  # the next decode step's preflight says eager
        patch.setattr(d.t, "preflight",
                      lambda plan, eager_plan=None: Preflight(Decision.RUN_EAGER, "test"))
        hook(0.125, before_forward=True)
        mon.begin_forward()
        assert not mon.graph_allowed(BatchLayout.decode(["a", "b"], [6, 6]), 4)
        hook(0.125)  # that preflight
        mon.abort_forward()
    mon.stop()
    assert mon.graph_forwards == 2
    assert mon.host_graph_seconds == 31 * (2.0 + 32.0)
    assert mon.host_seconds == spent
    assert mon.graph_parts == {"requests": 34.0, "begin": 16 * 34.0, "preflight": 2 * 34.0,
                               "commit": 4 * 34.0, "end": 8 * 34.0}
    timing = mon.timing(mon.transport.stats())
    assert timing["host_graph_commit_seconds"] == 4 * 34.0


def test_timing_reports_hook_time_and_the_drain_counters(make_driver, monkeypatch):
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    d, sink = make_driver("resid_pre")
    run = RunInfo("run-3", "toy", (), (), "2026-01-01T00:00:00+00:00")
    mon = SchedulerMonitor(run=run, selection=d.selection, shape=SHAPE, transport=d.t,
                           sink=sink, strip=True)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    runner = SimpleNamespace(_dmi_monitor=mon)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False))

    def model_forward(runner, fb) -> str:
        layout = BatchLayout.decode(["a", "b"], [3 + d.step, 4 + d.step])
        if d.step == 2:  # a decode graph step, padded to a bucket of 4
            assert mon.graph_allowed(layout, 4)
            mon.commit_graph(mon.graph_plan(4, lambda: layout))
            d.fire(layout, padding=2)
        else:
            mon.commit_eager(layout)
            d.fire(layout)
        time.sleep(0.01)  # the model's own time is not the hooks' time
        return "logits"

    for _ in range(4):
        assert runtime_hooks.around_forward(model_forward, runner, fb) == "logits"
        d.step += 1
    stats = mon.stop()
    timing = mon.timing(stats)
    assert timing["forwards"] == 4
    assert 0 < timing["host_seconds"] < 0.04
    # the graph step's share: its commit and seal, nothing of the eager forwards' commits
    assert timing["graph_forwards"] == 1
    assert 0 < timing["host_graph_seconds"] < timing["host_seconds"]
    assert timing["stall_seconds"] == stats.stall_seconds
    assert timing["drain_records"] == len(sink.records)
    assert {"gc_collections", "gc_seconds", "gc_full_seconds"} <= set(timing)
    assert mon.gc_pauses._callback not in gc.callbacks  # timed while the monitor ran
    # decode steps reach the host through the window's flushes, anything else as staged
    # or direct copies: together at least every stored byte, each byte once
    moved = timing["drain_d2h_bytes"] + timing["drain_window_bytes"]
    assert moved >= stats.bytes > 0
    assert timing["drain_window_bytes"] > 0


def test_a_forward_that_raised_after_its_commit_leaves_the_next_one_capturable(make_driver):
    d, sink = make_driver("resid_pre@0:last,final_ln")
    run = RunInfo("run-4", "toy", (), (), "2026-01-01T00:00:00+00:00")
    mon = SchedulerMonitor(run=run, selection=d.selection, shape=SHAPE, transport=d.t,
                           sink=sink, strip=True)
    first = BatchLayout.extend(["a"], [0], [3])
    mon.begin_forward()
    mon.commit_eager(first)
    mon.abort_forward()  # the forward raised after load_batch committed its plan
    mon.begin_forward()
    mon.commit_eager(first)  # no "committed while step 1 is not sealed"
    d.fire(first)
    mon.end_forward()
    d.t.finish_request("a", 3)
    d.t.stop()
    assert sorted((r.act_name, r.start_token_idx, r.end_token_idx) for r in sink.records) == [
        ("blocks.hook_resid_pre", 2, 3), ("hook_final_ln", 0, 3)]


def test_garbage_collections_count_from_the_first_batch_of_requests(make_driver) -> None:
    """The engine's start collects (SGLang 0.5.19: around its CUDA-graph capture) after
    the monitor attached and before any request: those are not the serving's pauses."""
    from .conftest import captured_forward, monitor_of  # type: ignore[import-not-found]

    d, sink = make_driver("resid_pre")
    mon = monitor_of(d, sink)
    gc.collect()  # the engine starting: not counted
    assert mon.gc_pauses.counters()["gc_collections"] == 0
    captured_forward(mon, d, BatchLayout.extend(["a"], [0], [3]), [_Req("a", 3)])
    gc.collect()  # while requests are served: counted
    timing = mon.timing(mon.stop())
    assert timing["gc_full_collections"] >= 1
    gc.collect()  # after the stop: not counted
    assert mon.timing(mon.stop())["gc_full_collections"] == timing["gc_full_collections"]


def test_a_graph_load_batch_outside_a_captured_forward_guards_the_replay(make_driver,
                                                                          monkeypatch):
    """The decode graph runner's ``load_batch`` outside a forward the session captures
    (nothing committed) points the ``last`` slot index at the spare row before the replay;
    the same call for another runner, or inside a captured forward, does not."""
    import torch

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    d, sink = make_driver("resid_pre@0:last")
    run = RunInfo("run-5", "toy", (), (), "2026-01-01T00:00:00+00:00")
    mon = SchedulerMonitor(run=run, selection=d.selection, shape=SHAPE, transport=d.t,
                           sink=sink, strip=True)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.forward(BatchLayout.decode(["a"], [4], padded_batch_size=4), padded=True)
    slots = d.t._last_slots
    armed = slots._control.clone()
    assert not torch.equal(armed, slots._idle)
    other = SimpleNamespace(model_runner=SimpleNamespace(_dmi_monitor=None), bs=4, raw_bs=1)
    runtime_hooks.after_decode_load_batch(None, other, SimpleNamespace())
    assert torch.equal(slots._control, armed)  # not this session's runner
    ours = SimpleNamespace(model_runner=SimpleNamespace(_dmi_monitor=mon), bs=4, raw_bs=1)
    runtime_hooks.after_decode_load_batch(None, ours, SimpleNamespace())
    assert torch.equal(slots._control, slots._idle)
    mon.stop()


def test_the_scheduler_shutdown_makes_the_run_durable_once(make_driver, monkeypatch):
    """SGLang's server asks each scheduler to shut down after SIGTERM drained its
    requests (``Scheduler.handle_shutdown``): the hook stops the monitor first, so the
    run is finished (flushed, its status written) before the process exits; a monitor stopped
    already (the engine's own stop) is left alone, and a failing stop is logged, never
    raised into SGLang's shutdown."""
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    d, sink = make_driver("resid_pre")
    run = RunInfo("run-6", "toy", (), (), "2026-01-01T00:00:00+00:00")
    mon = SchedulerMonitor(run=run, selection=d.selection, shape=SHAPE, transport=d.t,
                           sink=sink, strip=True)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace()))
    mon.begin_forward()
    layout = BatchLayout.extend(["a"], [0], [3])
    mon.commit_eager(layout)
    d.fire(layout)
    mon.end_forward()
    runtime_hooks.before_scheduler_shutdown(scheduler, object())
    assert not mon.active
    assert [r.status.value for r, _ in sink.finished] == ["committed"]
    assert {(r.request_id, r.start_token_idx, r.end_token_idx) for r in sink.records} == {
        ("a", 0, 3)}
    runtime_hooks.before_scheduler_shutdown(scheduler, object())  # stopped already
    assert len(sink.finished) == 1

    broken = SchedulerMonitor(run=RunInfo("run-7", "toy", (), (), "t"),
                              selection=d.selection, shape=SHAPE, transport=d.t,
                              sink=sink, strip=True)
    monkeypatch.setattr(broken, "stop", lambda: (_ for _ in ()).throw(RuntimeError("disk")))
    monkeypatch.setattr(runtime_hooks, "_MONITOR", broken)
    runtime_hooks.before_scheduler_shutdown(scheduler, object())  # logged, not raised


@pytest.mark.sglang
def test_after_a_stop_the_scheduler_goes_on_serving_as_stock(make_driver, monkeypatch):
    """A server's stop (``POST /dmi/stop``) ends the run while SGLang keeps serving:
    later forwards pass through (no step begins, nothing raises, nothing is stored), the
    capture points leave the model, requests of later batches are not tracked, and a
    decode graph's load_batch guards nothing."""
    import torch

    from dmi_sglang.adapters.sglang_v0519 import _points, runtime_hooks

    d, sink = make_driver("resid_pre")
    mon = SchedulerMonitor(run=RunInfo("run-8", "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    model = torch.nn.Linear(2, 2)
    patches: list[_points.Patch] = []
    _points.wrap(patches, model, lambda forward: lambda x: forward(x) * 0)
    object.__setattr__(model, "_dmi_capture_points", tuple(patches))
    runner = SimpleNamespace(model=model, _dmi_monitor=mon)
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))
    x = torch.ones(1, 2)
    assert torch.equal(model(x), torch.zeros(1, 2))  # the capture point is in place

    runtime_hooks.dmi_stop_monitoring(scheduler)
    assert not mon.active
    assert torch.equal(model(x), model.weight.sum(1, keepdim=True).T + model.bias)
    assert not hasattr(model, "_dmi_capture_points")

    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False))
    assert runtime_hooks.around_forward(lambda r, f: "stock", runner, fb) == "stock"
    seen = mon.requests.seen_requests
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="late")])
    assert runtime_hooks.around_forward_batch_generation(
        lambda w, b: "ran", SimpleNamespace(), batch) == "ran"
    assert mon.requests.seen_requests == seen
    monkeypatch.setattr(mon, "uncommitted_replay", lambda: pytest.fail("guarded a replay"))
    runtime_hooks.after_decode_load_batch(
        None, SimpleNamespace(model_runner=runner, bs=1, raw_bs=1), fb)
    assert [r.status.value for r, _ in sink.finished] == ["committed"]


def _failing_setup(make_driver, monkeypatch, run_id: str):
    import torch

    from dmi_sglang.adapters.sglang_v0519 import _points, runtime_hooks

    d, sink = make_driver("resid_pre")
    mon = SchedulerMonitor(run=RunInfo(run_id, "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    model = torch.nn.Linear(2, 2)
    patches: list[_points.Patch] = []
    _points.wrap(patches, model, lambda forward: forward)
    object.__setattr__(model, "_dmi_capture_points", tuple(patches))
    runner = SimpleNamespace(model=model, _dmi_monitor=mon)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False))
    layout = BatchLayout.extend(["a"], [0], [3])
    done = [False]
    req = SimpleNamespace(rid="a", origin_input_ids=[1, 2, 3], output_ids=[4],
                          finished=lambda: done[0])
    mon.add_requests([req], frozenset())
    mon.begin_forward()  # one forward captured before the failure
    mon.commit_eager(layout)
    d.fire(layout)
    mon.end_forward()
    done[0] = True  # that forward finished it
    return mon, sink, runner, fb


@pytest.mark.sglang
@pytest.mark.parametrize("where", ["begin", "inside", "end", "end-bug"])
def test_a_capture_failure_in_a_server_ends_the_capture_not_the_serving(
        make_driver, monkeypatch, where):
    """In a server's scheduler (the server mark set) a capture failure, before, inside
    or after the model's forward (a CaptureError, or any error of the capture's own code
    around it), ends the capture: the forward is served uncaptured (the failed one run
    again when the failure interrupted it), the run is recorded failed with no request
    complete but one that finished before the failure (on a side thread), the capture
    points leave the model, later forwards pass
    through, and the status and stop RPCs report why."""
    import threading

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks
    from dmi_sglang.errors import CaptureError

    monkeypatch.setenv(runtime_hooks.SERVER_MARK, "1")
    mon, sink, runner, fb = _failing_setup(make_driver, monkeypatch, f"run-{where}")
    calls: list[str] = []
    boom = KeyError("store down") if where == "end-bug" else CaptureError(
        "sink failed: store down")

    def original(_runner, _fb):
        calls.append("forward")
        if where == "inside" and len(calls) == 1:
            raise boom
        return "logits"

    if where != "inside":
        phase = where.removesuffix("-bug")
        monkeypatch.setattr(mon, f"{phase}_forward", lambda: (_ for _ in ()).throw(boom))
    assert runtime_hooks.around_forward(original, runner, fb) == "logits"
    assert calls == (["forward", "forward"] if where == "inside" else ["forward"])
    for thread in threading.enumerate():
        if thread.name == "dmi-fail":
            thread.join(30)
    assert not mon.active
    assert not hasattr(runner.model, "_dmi_capture_points")
    (run, manifests), = sink.finished
    assert run.status.value == "failed"
    assert "store down" in run.error
    # "a" finished before the failure: a forward that began normally committed it, and
    # the run's failure leaves that commit alone (its rows were all stored before it);
    # when the failure came first, the failed run's manifest of it is not committed
    stored = {m.request_id: m.committed for m in sink.manifests}
    assert stored == {"a": where != "begin"}
    assert [m.committed for m in manifests] == ([False] if where == "begin" else [])
    assert runtime_hooks.around_forward(original, runner, fb) == "logits"  # as stock
    with pytest.raises(CaptureError, match=r"failed and was ended .*store down"):
        runtime_hooks.dmi_assert_active(SimpleNamespace())
    with pytest.raises(CaptureError, match="store down"):
        runtime_hooks.dmi_stop_monitoring(
            SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner)))


@pytest.mark.sglang
def test_outside_a_server_a_capture_failure_still_raises(make_driver, monkeypatch):
    """An engine's scheduler (no server mark) keeps failing loudly."""
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks
    from dmi_sglang.errors import CaptureError

    monkeypatch.delenv(runtime_hooks.SERVER_MARK, raising=False)
    mon, _sink, runner, fb = _failing_setup(make_driver, monkeypatch, "run-engine")

    def original(_runner, _fb):
        raise CaptureError("sink failed")

    with pytest.raises(CaptureError, match="sink failed"):
        runtime_hooks.around_forward(original, runner, fb)
    assert mon.active
    assert hasattr(runner.model, "_dmi_capture_points")
    mon.stop()


def test_a_sink_that_fails_to_close_after_a_committed_finish_is_logged(make_driver):
    """``finish_run`` made the run durable: a failing ``close`` after it (a store owner
    that exits badly) is logged, and the stop returns; a stop that failed raises its own
    error, not the close's."""
    import structlog.testing

    from dmi_sglang.domain.records import RunStatus
    from dmi_sglang.errors import CaptureError, StoreError
    from dmi_sglang.testing import MemorySink

    def broken_close() -> None:
        raise StoreError("the owner exited with status 1")

    d, sink = make_driver("resid_pre")
    sink.close = broken_close
    mon = SchedulerMonitor(run=RunInfo("run-c", "toy", (), (), "2026-01-01T00:00:00+00:00"),
                           selection=d.selection, shape=SHAPE, transport=d.t, sink=sink,
                           strip=True)
    with structlog.testing.capture_logs() as logs:
        mon.stop()
    assert [run.status for run, _ in sink.finished] == [RunStatus.COMMITTED]
    assert [e["error"] for e in logs if e["event"] == "dmi.sink_close_failed"] == [
        "StoreError('the owner exited with status 1')"]
    mon.stop()  # terminal and idempotent

    failing = MemorySink(fail_on_flush=True)
    d2, _ = make_driver("resid_pre", sink=failing)
    failing.close = broken_close
    mon2 = SchedulerMonitor(run=RunInfo("run-d", "toy", (), (), "2026-01-01T00:00:00+00:00"),
                            selection=d2.selection, shape=SHAPE, transport=d2.t, sink=failing,
                            strip=True)
    with pytest.raises(CaptureError, match="injected failure on flush"):
        mon2.stop()


EIGHT = [f"r{i}" for i in range(8)]


@pytest.mark.parametrize(("text", "ring", "stored"), [
    # final_logits (320 B a step of 8) and topk's two captures (64 B each) in a ring of
    # 384 B: each decode step commits piecewise, one capture a part
    ("final_logits,final_logits:topk(2)", 384,
     [("final_logits", 1), ("logits_topk_ids", 1), ("logits_topk_values", 1)]),
    # topk alone: its values and ids in two parts
    ("final_logits:topk(2)", 112, [("logits_topk_ids", 1), ("logits_topk_values", 1)]),
])
@pytest.mark.parametrize("coalesce", [True, False], ids=["window", "no-window"])
def test_extra_forward_rows_of_a_piecewise_step_are_discarded(make_driver, text, ring,
                                                              stored, coalesce):
    # Found in review: each part's request rows confirmed the rows an earlier part of
    # the SAME step had just held (by staging, and by the decode window, the default), so
    # the extra forward's rows were stored
    d, sink = make_driver(text, payload_bytes=ring, max_graph_batch=8, max_requests=8,
                          coalesce_decode=coalesce)
    d.forward(BatchLayout.extend(EIGHT, [0] * 8, [2] * 8, seq_lens=[2] * 8))  # 1 token
    d.forward(BatchLayout.decode(EIGHT, [3] * 8))  # the overlap scheduler's extra forward
    for rid in EIGHT:
        d.t.finish_request(rid, 2)  # decisions end at position 2: prompt 2 + 1 token - 1
    stats = d.t.stop()
    assert stats.piecewise_steps >= 1
    assert sorted({(r.act_name, r.start_token_idx) for r in sink.records}) == stored
    assert len(sink.records) == 8 * len(stored)


def test_request_rows_are_held_by_their_own_rule_in_a_shared_copy_group(make_driver):
    # Found in review: vocab 10 makes final_logits and topk(10) rows 40 bytes alike, so
    # they share a copy group, and the group's first rule (last_prompt: stored at once)
    # was applied to topk's rows too; a request that generated nothing keeps none of them
    d, sink = make_driver("final_logits:last_prompt,final_logits:topk(10)")
    d.prompts = {"a": 3}
    d.forward(BatchLayout.extend(["a"], [0], [3], seq_lens=[3]))
    d.t.finish_request("a", 2)  # no token generated: the row at position 2 decided none
    d.t.stop()
    assert sorted({(r.act_name, r.start_token_idx) for r in sink.records}) == [
        ("final_logits", 2)]


def test_a_finished_request_in_the_batch_about_to_run_is_reported_after_it(make_driver):
    # Found in review: with SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP=1 and mixed chunks,
    # the mixed batch N+1 is built before a finishes (so it keeps a for its extra
    # forward) and N's result is processed before N+1 runs: a finished and in the batch
    # about to run. It was reported (manifest committed) before N+1 captured it once
    # more, so the extra forward's logits row (a token never generated) was stored.
    from dmi_sglang.domain.hooks import hook_by_name

    d, sink = make_driver("resid_pre,final_logits")
    mon = SchedulerMonitor(run=RunInfo("run-1", "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True)

    def forward(layout, reqs, unfinished=frozenset()):
        mon.add_requests(reqs, unfinished)
        mon.begin_forward()
        mon.commit_eager(layout)
        d.fire(layout)
        mon.end_forward()
        d.step += 1

    a, x, y = _Req("a", 3), _Req("x", 4), _Req("y", 2)
    forward(BatchLayout.extend(["a"], [0], [3]), [a])
    a.output_ids.append(1)
    # N: x's first chunk beside a's decode (a's second and last token)
    forward(BatchLayout.extend(["x", "a"], [0, 3], [2, 1], seq_lens=[5, 4]), [x, a],
            frozenset({"x"}))
    a.output_ids.append(2)
    a.done = True  # N's result processed before N+1 runs
    # N+1, built before a finished: x's last chunk, y new, and a's extra forward
    forward(BatchLayout.extend(["x", "y", "a"], [2, 0, 4], [2, 2, 1]), [x, y, a])
    x.output_ids.append(1)
    y.output_ids.append(1)
    forward(BatchLayout.decode(["x", "y"], [5, 3]), [x, y])
    mon.stop()
    (m,) = [m for m in sink.manifests if m.request_id == "a"]
    assert m.committed
    assert m.overlap_extra_forward
    want = m.coverage(hook_by_name("final_logits"))
    assert _coverage(sink.records, "a", LOGITS, -1) == list(range(want.start, want.end))
    resid = m.coverage(hook_by_name("resid_pre"))
    assert _coverage(sink.records, "a", "blocks.hook_resid_pre", 0) == list(
        range(resid.start, resid.end))


@pytest.mark.sglang
def test_a_store_failure_while_the_server_idles_ends_the_capture(make_driver, monkeypatch):
    # Found in review: the idle commit swallowed the drain's sticky failure, so with no
    # forward coming /dmi/status (dmi_assert_active) said "capturing" after the store failed
    import time

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks
    from dmi_sglang.errors import CaptureError
    from dmi_sglang.testing import MemorySink

    sink = MemorySink(fail_on_put=1)  # the store is gone: its first put fails
    d, _ = make_driver("resid_pre", sink=sink)
    mon = SchedulerMonitor(run=RunInfo("run-1", "toy", (), (), "t"), selection=d.selection,
                           shape=SHAPE, transport=d.t, sink=sink, strip=True)
    a = _Req("a", 3)
    layout = BatchLayout.extend(["a"], [0], [3])
    mon.add_requests([a], frozenset())
    mon.begin_forward()
    mon.commit_eager(layout)
    d.fire(layout)
    mon.end_forward()
    a.output_ids.append(1)
    a.done = True
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(
        model_runner=SimpleNamespace(_dmi_monitor=mon)))
    monkeypatch.setenv(runtime_hooks.SERVER_MARK, "1")
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    monkeypatch.setattr(runtime_hooks, "_detach", lambda runner: None)
    deadline = time.monotonic() + 10
    while runtime_hooks._FAILED is None and time.monotonic() < deadline:  # idle rounds
        monkeypatch.setattr(runtime_hooks, "_last_idle", 0.0)
        runtime_hooks.after_scheduler_on_idle(None, scheduler)
        time.sleep(0.05)
    assert sink.puts >= 1
    with pytest.raises(CaptureError, match=r"failed and was ended .*injected failure"):
        runtime_hooks.dmi_assert_active(None, run_id="run-1")
