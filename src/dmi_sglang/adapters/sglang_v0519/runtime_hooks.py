"""The HookRegistry hooks that connect SGLang 0.5.19 to the capture session.

Registered by ``register()`` (the ``sglang.srt.plugins`` entry point) only when
monitoring is requested (``DMX_SGLANG_ENABLE``). Every hook is a no-op for processes and
model runners that do not monitor. Exceptions raised here crash the scheduler loudly,
which is what a broken capture must do (SGLang's wrappers have no try/except).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from time import perf_counter
from typing import Any

import structlog

from dmi_sglang.adapters.sglang_v0519 import _state
from dmi_sglang.adapters.sglang_v0519._state import SERVER_MARK
from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch, unfinished_rids
from dmi_sglang.domain.ports import CaptureSession
from dmi_sglang.domain.settings import (
    Settings,
    engine_started,
    ignored_variables,
    monitoring_requested,
)
from dmi_sglang.errors import CaptureError

__all__ = ["HOOKS", "SCHEDULER_RPCS", "SERVER_MARK", "WAITING_ABORTS", "current_monitor"]

log = structlog.get_logger(__name__)


_MONITOR: CaptureSession | None = None
_FAILED: str | None = None
"""Why the capture of this serving scheduler failed and was detached (None: it did not)."""

_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_DECODE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_EAGER = "sglang.srt.model_executor.runner.eager_runner.EagerRunner"
_PREFILL = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
_WORKER = "sglang.srt.managers.tp_worker.TpModelWorker"


def current_monitor() -> CaptureSession | None:
    """This process's capture session, once ``load_model`` attached one."""
    return _MONITOR


def _forwarding() -> CaptureSession | None:
    mon = _MONITOR
    return mon if mon is not None and mon.in_forward() and _FAILED is None else None


# -- main process ----------------------------------------------------------------------
def before_resolve_once(server_args: Any) -> None:
    """Before SGLang resolves its arguments: force settings, resolve ours once, claim the
    run id.

    Runs in the process that builds the engine. Forces prefill CUDA graphs off and the
    radix cache off (unless ``DMX_ALLOW_PREFIX_CACHE=1``), each with a log line, then
    resolves the ``DMX_*`` settings (run id, absolute store path) into ``os.environ`` so
    the spawned scheduler inherits exactly these values, and claims the run id in the
    store: a run id the store already holds is refused here, before anything spawns. A
    run id this hook generated for an earlier engine of the process is not reused.

    Raises:
        RunExistsError: the store already holds the run id (or another start claimed it).
    """
    if getattr(server_args, "_resolution_finished", False) or not monitoring_requested():
        return
    settings = Settings.from_env().resolve(model_path=str(server_args.model_path))
    for variable, why in ignored_variables():
        log.warning("setting ignored", variable=variable, why=why)
    if not server_args.disable_prefill_cuda_graph:
        server_args.disable_prefill_cuda_graph = True
        log.warning("dmi.forced", setting="disable_prefill_cuda_graph=True",
                    why="per-layer capture points do not run at prefill graph replay")
    if not server_args.disable_radix_cache:
        if not settings.prefix_cache_allowed:
            server_args.disable_radix_cache = True
            log.warning("dmi.forced", setting="disable_radix_cache=True",
                        why="cached prefix tokens are never recomputed, so never captured; "
                        "DMX_ALLOW_PREFIX_CACHE=1 keeps the cache")
        elif not settings.allow_prefix_cache:
            log.info("dmi.radix_cache_kept",
                     why="the selection keeps only positions from the last prompt position "
                     "on, which SGLang always computes")
    factory = _state.STATE.factory
    if factory is not None:
        factory.claim_run(settings)
    engine_started(settings.model_id or "")
    os.environ.update(settings.to_env())
    log.info("dmi.settings", run_id=settings.model_id, store=settings.store().url,
             hooks=settings.hook_selection)


# -- scheduler process -----------------------------------------------------------------
def around_load_model(original: Callable[..., Any], runner: Any, *args: Any, **kw: Any) -> Any:
    """Support check, transport and store before weights load; capture points after."""
    global _MONITOR  # noqa: PLW0603 - one monitor per scheduler process, by design
    if not monitoring_requested() or getattr(runner, "is_draft_worker", False):
        return original(runner, *args, **kw)
    from dmi_sglang.adapters.sglang_v0519.attach import attach, prepare

    prepared = prepare(runner)  # raises before any capture allocation or weight load
    result = original(runner, *args, **kw)
    _MONITOR = attach(runner, prepared)
    runner._dmi_monitor = _MONITOR
    _leave_interrupts_to_the_main_process()
    return result


def _leave_interrupts_to_the_main_process() -> None:
    """Ignore SIGINT in a monitoring scheduler: Ctrl-C reaches every process of the
    terminal's group, and the run can only be stopped durably while its scheduler lives.
    The main process decides (the server stops the run when its HTTP server returns, an
    engine's caller calls ``dmi_stop_monitoring``); SGLang's own teardown, and the
    parent-death signal SGLang sets, still end the scheduler."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _capturing() -> CaptureSession | None:
    """This process's session while it captures (not stopped, no failure ended it)."""
    mon = _MONITOR
    return mon if mon is not None and mon.active and _FAILED is None else None


def around_forward(original: Callable[..., Any], runner: Any, fb: Any, *args: Any,
                   **kw: Any) -> Any:
    """One forward = one step: begin, (commit in load_batch), end and seal.

    In a server's scheduler a capture failure ends the capture, not the forward
    (:func:`_serve_on_or_raise`): a failure before or after the model's forward leaves it
    served uncaptured, and one inside it (a commit, a capture point: raised as
    :class:`CaptureError`) runs the same forward again, uncaptured. Safe for what the
    support rules admit (one rank, no speculative decoding): a failing commit comes
    before the graph replays, and an eager forward writes the same KV cache rows again.
    """
    mon = _capturing()
    if mon is None:  # never monitored, stopped, or ended by a failure: uncaptured
        return original(runner, fb, *args, **kw)
    owner: object = getattr(runner, "_dmi_monitor", None)
    if owner is not mon or fb.forward_mode.is_idle():  # another runner, or no tokens
        return original(runner, fb, *args, **kw)
    t0 = perf_counter()
    try:
        mon.begin_forward()
    except Exception as exc:  # the capture's own code: any failure is the capture's
        _serve_on_or_raise(runner, mon, exc)
        return original(runner, fb, *args, **kw)
    t1 = perf_counter()
    try:
        out = original(runner, fb, *args, **kw)
    except CaptureError as exc:
        _abort(mon)
        _serve_on_or_raise(runner, mon, exc)
        return original(runner, fb, *args, **kw)  # the same forward again, uncaptured
    except BaseException:
        _abort(mon)
        raise
    t2 = perf_counter()
    try:
        mon.end_forward()
    except Exception as exc:  # the capture's own code: any failure is the capture's
        _serve_on_or_raise(runner, mon, exc)
        return out
    mon.add_host_seconds(perf_counter() - t2, part="end")
    mon.add_host_seconds(t1 - t0, part="begin")  # counted now: the step's kind is known
    return out


def _abort(mon: CaptureSession) -> None:
    """Forget the step a failed forward left open; a failure here is logged (the
    forward's own exception is the one that matters)."""
    try:
        mon.abort_forward()
    except Exception as exc:  # reported; never hides the forward's own error
        log.error("dmi.abort_failed", error=repr(exc))


def _serve_on_or_raise(runner: Any, mon: CaptureSession, exc: Exception) -> None:
    """A capture failed. An engine's scheduler raises it (the engine fails loudly). A
    server's scheduler (:data:`SERVER_MARK`) ends the capture instead: the capture points
    leave the model, serving goes on uncaptured, ``/dmi/status`` reports why, and the run
    is recorded failed (where the store still takes it) on a side thread, so a hung
    store holds up no forward once the failure is declared.

    Raises:
        Exception: ``exc``, outside a server.
    """
    global _FAILED  # noqa: PLW0603 - one monitor per scheduler process, by design
    if os.environ.get(SERVER_MARK) != "1":
        raise exc
    _FAILED = str(exc) if isinstance(exc, CaptureError) else repr(exc)
    log.error("dmi.capture_failed_serving_on", run_id=mon.run.run_id, error=_FAILED)
    mon.fail(exc)  # no device read after this; the record is written on a side thread
    try:
        _detach(runner)
    except Exception as again:  # serving goes on; the points left behind are no-ops
        log.error("dmi.detach_failed", run_id=mon.run.run_id, error=repr(again))


def _detach(runner: Any) -> None:
    """Take the capture points out of the model: its forwards capture nothing from now on.
    Not quite stock: decode graphs keep replaying their recorded copies into buffers the
    stopped transport keeps allocated (never freed while the process lives), and what was
    forced at start (prefill graphs off, the radix cache off) stays forced."""
    model = getattr(runner, "model", None)
    if model is not None:
        from dmi_sglang.adapters.sglang_v0519.qwen3 import remove_capture_points

        remove_capture_points(model)


def around_decode_can_run_graph(original: Callable[..., Any], graph_runner: Any, fb: Any,
                                *args: Any, **kw: Any) -> bool:
    """Preflight the padded step; a step whose padded plan cannot fit runs eagerly."""
    ok = bool(original(graph_runner, fb, *args, **kw))
    mon = _forwarding()
    if not ok or mon is None:
        return ok
    t0 = perf_counter()
    try:
        rids = fb.rids  # None: the layout raises why
        padded = None if rids is None else graph_runner._pad_to_bucket(
            len(rids), graph_runner.capture_bs)
        layout = layout_from_forward_batch(fb, padded_batch_size=padded)
        allowed = mon.graph_allowed(layout, layout.padded_batch_size)
    except CaptureError:
        raise
    except Exception as exc:
        raise _capture_failure("the decode graph preflight", exc) from exc
    mon.add_host_seconds(perf_counter() - t0, part="preflight")
    return allowed


def _capture_failure(where: str, exc: Exception) -> CaptureError:
    """The capture's own work failed inside SGLang's forward: a :class:`CaptureError`,
    so a server ends the capture instead of the serving (:func:`around_forward`)."""
    return CaptureError(f"capture failed in {where}: {exc!r}")


def after_decode_load_batch(result: Any, graph_runner: Any, fb: Any, *args: Any,
                            **kw: Any) -> None:
    """The graph runner fixed the padded batch: commit the padded plan (outside a
    captured forward: guard the replay that follows)."""
    mon = _forwarding()
    if mon is None:
        idle = _capturing()
        owner: object = getattr(graph_runner.model_runner, "_dmi_monitor", None)
        if idle is not None and owner is idle:
            try:
                idle.uncommitted_replay()
            except Exception as exc:  # the capture's own code: any failure is the capture's
                _serve_on_or_raise(graph_runner.model_runner, idle, exc)
        return
    t0 = perf_counter()
    try:
        plan = mon.graph_plan(int(graph_runner.bs), lambda: layout_from_forward_batch(fb))
        if plan.batch.raw_batch_size != int(graph_runner.raw_bs):
            msg = (f"decode batch of {graph_runner.raw_bs} requests, layout has "
                   f"{plan.batch.raw_batch_size}")
            raise CaptureError(msg)
        mon.commit_graph(plan)
    except CaptureError:
        raise
    except Exception as exc:
        raise _capture_failure("the decode graph commit", exc) from exc
    mon.add_host_seconds(perf_counter() - t0, part="commit")
    del result


def after_eager_load_batch(result: Any, eager_runner: Any, fb: Any, *args: Any,
                           **kw: Any) -> None:
    """The eager runner fixed the batch: commit the unpadded plan."""
    mon = _forwarding()
    if mon is None:
        return
    t0 = perf_counter()
    try:
        layout = layout_from_forward_batch(result if result is not None else fb,
                                           unfinished_rids=mon.unfinished)
        mon.commit_eager(layout)
    except CaptureError:
        raise
    except Exception as exc:
        raise _capture_failure("the eager commit", exc) from exc
    mon.add_host_seconds(perf_counter() - t0)


def around_prefill_can_run_graph(original: Callable[..., Any], graph_runner: Any, fb: Any,
                                 *args: Any, **kw: Any) -> bool:
    """Monitored prefill runs eagerly (layer capture points do not run at its replay)."""
    if _MONITOR is not None:
        return False
    return bool(original(graph_runner, fb, *args, **kw))


def around_forward_batch_generation(original: Callable[..., Any], worker: Any, batch: Any,
                                    *args: Any, **kw: Any) -> Any:
    """Remember the batch's Req objects (prompt/output lengths for the manifest)."""
    mon = _capturing()
    if mon is not None and batch is not None:
        t0 = perf_counter()
        try:
            mon.add_requests(batch.reqs, unfinished_rids(batch))
        except Exception as exc:  # the capture's own code: any failure is the capture's
            _serve_on_or_raise(worker.model_runner, mon, exc)
        mon.add_host_seconds(perf_counter() - t0, before_forward=True)
    return original(worker, batch, *args, **kw)


def around_waiting_abort(original: Callable[..., Any], scheduler: Any, *args: Any,
                         **kw: Any) -> Any:
    """AROUND each ``Scheduler`` method that aborts requests waiting to run
    (:data:`WAITING_ABORTS`): SGLang pops them from its waiting queue (one retracted under
    memory pressure among them, say) and lets them go without finishing them, so no
    ``finished()`` will ever report them: the capture learns it here (their captures end
    incomplete; a ``last`` slot and held rows are let go). Never raises for the capture:
    the abort happened either way (a server ends the capture, an engine logs)."""
    mon = _capturing()
    queue = getattr(scheduler, "waiting_queue", None)
    if mon is None or not queue or not _may_drop(original, scheduler):
        return original(scheduler, *args, **kw)
    waiting = list(queue)
    result = original(scheduler, *args, **kw)
    t0 = perf_counter()
    try:
        still = {id(req) for req in scheduler.waiting_queue}
        mon.requests_dropped([req for req in waiting if id(req) not in still])
    except Exception as exc:  # the capture's own code: any failure is the capture's
        if os.environ.get(SERVER_MARK) == "1":
            _serve_on_or_raise(scheduler.tp_worker.model_runner, mon, exc)
        else:  # an engine's run reports its failures at its stop
            log.error("dmi.dropped_requests_failed", run_id=mon.run.run_id, error=repr(exc))
    mon.add_host_seconds(perf_counter() - t0)
    return result


def _may_drop(original: Callable[..., Any], scheduler: Any) -> bool:
    """Whether the wrapped method can let a waiting request go now: SGLang calls the
    waiting-time check every iteration and the queue limit for every new request, but
    each does nothing unless its setting is on (then the queue is copied, not before)."""
    name = getattr(original, "__name__", "")
    if name == "_abort_on_waiting_timeout":
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_REQ_WAITING_TIMEOUT.get() > 0)
    if name == "_abort_on_queued_limit":
        return getattr(scheduler, "max_queued_requests", None) is not None
    return True


def after_retract_decode(result: Any, batch: Any, *args: Any, **kw: Any) -> None:
    """AFTER ``ScheduleBatch.retract_decode`` (memory pressure): besides the requests it
    retracts, it may end some for good (``reqs_to_abort``: no room even for one more
    token), which leave the batch unprocessed, so no ``finished()`` reports them: the
    capture learns it here, as for :func:`around_waiting_abort`."""
    del batch, args, kw
    mon = _capturing()
    ended = result[2] if isinstance(result, tuple) and len(result) == 3 else None
    if mon is None or not ended:
        return
    try:
        mon.requests_dropped(list(ended))
    except Exception as exc:  # never fails the engine's own recovery
        log.error("dmi.dropped_requests_failed", run_id=mon.run.run_id, error=repr(exc))


_SCHED = "sglang.srt.managers.scheduler.Scheduler"
WAITING_ABORTS = (f"{_SCHED}.abort_request", f"{_SCHED}._abort_on_waiting_timeout",
                  f"{_SCHED}._abort_on_queued_limit")
"""SGLang 0.5.19's ways of letting requests that wait to run go unfinished: a client's
abort, ``SGLANG_REQ_WAITING_TIMEOUT``, and ``--max-queued-requests`` (a full queue, or a
higher priority request, evicts one)."""


BEAM_REFUSED = ("beam search (sampling_params.beam_width > 1) is not supported while "
                "dmi-sglang captures: its beam rows carry no request id in the batch")
"""The error SGLang returns (HTTP 400) for a beam-search request while a capture runs."""


def around_beam_validate(original: Callable[..., Any], coordinator: Any, req: Any,
                         recv_req: Any, *args: Any, **kw: Any) -> str | None:
    """AROUND ``BeamCoordinator.validate_and_init``: while this scheduler captures, a
    beam-search request is refused through SGLang's own path (its error string aborts
    that request with HTTP 400). SGLang adds a beam's member rows to every decode batch
    without request ids (``append_beam_tail``), so no layout can say whose rows they are;
    admitted, the request would end the whole capture at its first decode step."""
    if _capturing() is not None:
        return BEAM_REFUSED
    result: str | None = original(coordinator, req, recv_req, *args, **kw)
    return result


def before_scheduler_shutdown(scheduler: Any, *args: Any, **kw: Any) -> None:
    """BEFORE ``Scheduler.handle_shutdown``: SGLang's server asks each scheduler to shut
    down once SIGTERM drained its requests; the run is made durable and marked stopped
    first (a stop that fails records the run failed and is logged: shutdown goes on)."""
    del args, kw
    mon = _MONITOR
    if mon is None or (not mon.active and _FAILED is None):
        return
    try:
        dmi_stop_monitoring(scheduler)
        log.info("dmi.stopped_at_shutdown", run_id=mon.run.run_id)
    except Exception as exc:  # the server shuts down regardless
        if _FAILED is not None:  # the failed run's record had its time to be written
            log.info("dmi.failed_run_at_shutdown", run_id=mon.run.run_id, error=_FAILED)
        else:
            log.error("dmi.stop_at_shutdown_failed", run_id=mon.run.run_id, error=repr(exc))


IDLE_EVERY_S = 0.05
"""Shortest time between two idle settlements (SGLang may call ``on_idle`` in a tight
loop while requests wait for memory)."""
_last_idle = 0.0


def after_scheduler_on_idle(result: Any, scheduler: Any, *args: Any, **kw: Any) -> None:
    """AFTER ``Scheduler.on_idle`` (no batch to run): requests that finished with the
    last batch are reported and committed now, not at the next request's forward (at
    most every :data:`IDLE_EVERY_S`: SGLang calls ``on_idle`` in a loop)."""
    global _last_idle  # noqa: PLW0603 - one monitor per scheduler process, by design
    del result, args, kw
    now = time.monotonic()
    if now - _last_idle < IDLE_EVERY_S:
        return
    _last_idle = now
    _idle_commit(scheduler)


def before_scheduler_sleep(scheduler: Any, *args: Any, **kw: Any) -> None:
    """BEFORE ``Scheduler.maybe_sleep_on_idle``: with ``--sleep-on-idle`` SGLang sleeps
    there until the next request (up to a second), so the idle commit runs before it,
    whatever the rate (it is reached only once fully idle, and then blocks: no loop)."""
    del args, kw
    if getattr(scheduler, "idle_sleeper", None) is not None:
        _idle_commit(scheduler)


def _idle_commit(scheduler: Any) -> None:
    """Let the forward stream finish, then ask the monitor to report and commit what
    finished; never raises (an engine logs, a server ends the capture)."""
    mon = _MONITOR
    if mon is None or not mon.active or _FAILED is not None:
        return
    runner: Any = None
    try:
        runner = scheduler.tp_worker.model_runner
        owner: object = getattr(runner, "_dmi_monitor", None)
        if owner is not mon:  # another runner's idle
            return
        stream = getattr(runner, "forward_stream", None)
        if stream is not None:
            stream.synchronize()  # idle: the last forward's slot writes are done (at once)
        mon.idle()
    except Exception as exc:  # the capture's own code failed while SGLang idles
        if runner is not None and os.environ.get(SERVER_MARK) == "1":
            _serve_on_or_raise(runner, mon, exc)  # a server ends the capture, serves on
        else:  # an engine's run reports its failures at its stop: never kill it idling
            log.error("dmi.idle_failed", run_id=mon.run.run_id, error=repr(exc))


# -- RPC methods added to Scheduler ----------------------------------------------------
def dmi_assert_active(scheduler: Any, run_id: str = "") -> None:
    """RPC: raise unless this scheduler monitors (for ``run_id`` when given)."""
    mon = _MONITOR
    if mon is None:
        msg = ("DMI monitoring is not active in this scheduler: the dmi-sglang plugin did "
               "not attach (is the package installed as a distribution, and "
               "SGLANG_PLUGINS / DMX_SGLANG_ENABLE not excluding it?)")
        raise CaptureError(msg)
    if run_id and mon.run.run_id != run_id:
        msg = f"this scheduler monitors run {mon.run.run_id!r}, not {run_id!r}"
        raise CaptureError(msg)
    if _FAILED is not None:
        msg = (f"the capture of run {mon.run.run_id!r} failed and was ended (the server "
               f"goes on serving, uncaptured): {_FAILED}")
        raise CaptureError(msg)
    if not mon.active:
        msg = f"monitoring of run {mon.run.run_id!r} was already stopped"
        raise CaptureError(msg)


def dmi_assert_admitting(scheduler: Any) -> None:
    """RPC: raise (with the reason) while new requests are not captured because the
    store reached its cap or its disk runs short (the run still captures the requests
    it took); pass otherwise. Asked after :func:`dmi_assert_active` by the server's
    status."""
    mon = _MONITOR
    refusal = mon.refusal if mon is not None else None
    if refusal is not None:
        raise CaptureError(f"new requests are not captured: {refusal}")


def dmi_stop_monitoring(scheduler: Any) -> None:
    """RPC: the authoritative flush. Terminal; a failure stays failed (after a capture
    failure in a server it waits a while for the failed run's record, then raises).

    Stopped or failed, the capture points leave the model, so the scheduler goes on
    serving uncaptured (a server's stop endpoint); decode graphs keep replaying their
    recorded copies into buffers the stopped transport keeps allocated.
    """
    mon = _MONITOR
    if mon is None:
        dmi_assert_active(scheduler)  # raises why
        return
    runner = scheduler.tp_worker.model_runner
    stream = getattr(runner, "forward_stream", None)
    if stream is not None and _FAILED is None:
        stream.synchronize()  # under overlap the last forward may still be running
    try:
        mon.stop()
    finally:
        _detach(runner)


SCHEDULER_RPCS: dict[str, Callable[..., None]] = {
    "dmi_assert_active": dmi_assert_active,
    "dmi_assert_admitting": dmi_assert_admitting,
    "dmi_stop_monitoring": dmi_stop_monitoring,
}
"""Methods set on ``Scheduler`` so ``Engine.collective_rpc`` reaches them."""

HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("sglang.srt.server_args.ServerArgs.resolve_once", "BEFORE", before_resolve_once),
    (f"{_MR}.load_model", "AROUND", around_load_model),
    (f"{_MR}.forward", "AROUND", around_forward),
    (f"{_DECODE}.can_run_graph", "AROUND", around_decode_can_run_graph),
    (f"{_DECODE}.load_batch", "AFTER", after_decode_load_batch),
    (f"{_EAGER}.load_batch", "AFTER", after_eager_load_batch),
    (f"{_PREFILL}.can_run_graph", "AROUND", around_prefill_can_run_graph),
    (f"{_WORKER}.forward_batch_generation", "AROUND", around_forward_batch_generation),
    ("sglang.srt.beam_search.coordinator.BeamCoordinator.validate_and_init", "AROUND",
     around_beam_validate),
    *((target, "AROUND", around_waiting_abort) for target in WAITING_ABORTS),
    ("sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode", "AFTER",
     after_retract_decode),
    ("sglang.srt.managers.scheduler.Scheduler.handle_shutdown", "BEFORE",
     before_scheduler_shutdown),
    ("sglang.srt.managers.scheduler.Scheduler.on_idle", "AFTER", after_scheduler_on_idle),
    ("sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle", "BEFORE",
     before_scheduler_sleep),
)
"""``(target, hook type, function)`` registered with SGLang's HookRegistry."""
