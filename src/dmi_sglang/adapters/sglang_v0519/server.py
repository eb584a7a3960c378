"""SGLang 0.5.19's HTTP server with capture: the main process's part.

``python -m sglang.launch_server`` (and ``sglang serve``, and ``dmi-sglang serve``, which
runs the former) loads the plugin in its main process before it parses its arguments. In
that process, and only there, :data:`SERVER_HOOKS` adds two hooks:

* before ``http_server.launch_server`` starts any process (:func:`before_launch_server`):
  refuse the server modes the capture cannot follow, mark the schedulers as a server's
  (a capture failure there ends the capture, not the serving), start the
  detokenizer ignoring SIGINT, as monitoring schedulers do, and let SGLang's warm-up
  give up once the HTTP server shuts down (its lifespan waits for the warm-up, which
  otherwise polls a server that is gone for two minutes);
* around ``http_server._setup_and_run_http_server``, which runs after the schedulers
  loaded the model and before the HTTP server starts (:func:`around_http_server`): open
  the RPC line to the schedulers that SGLang's ``Engine`` has and its server lacks (a
  DEALER bound at ``PortArgs.rpc_ipc_name``; the schedulers already connect to it) and
  ask them whether they monitor the run (a server asked to capture that cannot starts no
  HTTP server); add ``GET /dmi/status`` and ``POST /dmi/stop`` to SGLang's FastAPI app
  before SGLang adds its API-key middleware, so both are protected like the server's own
  API (the stop as an admin endpoint), and the header ``X-DMI-Run-Id`` to the responses
  the app gives; when the HTTP server returns (SIGINT) while the schedulers still run,
  stop the run before SGLang ends them (waiting up to SGLang's ``--watchdog-timeout``).

SGLang's own SIGTERM path (drain the requests, then ``ShutdownReq`` to the schedulers) is
covered in the scheduler (``runtime_hooks.before_scheduler_shutdown``). After a stop the
server keeps serving, uncaptured.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import structlog

from dmi_sglang.adapters.sglang_v0519 import _state
from dmi_sglang.adapters.sglang_v0519.engine import SchedulerSilentError, check_answer
from dmi_sglang.adapters.sglang_v0519.reads_api import RUNS_PATH, mount_reads, unexpected_query
from dmi_sglang.errors import CaptureError
from dmi_sglang.threads import OsNamedThread

__all__ = [
    "CAPTURE_HEADER",
    "RUN_HEADER",
    "SERVER_HOOKS",
    "STATUS_PATH",
    "STOP_ANSWER_S",
    "STOP_PATH",
    "STOP_WAIT_S",
    "RunControl",
    "RunState",
    "around_http_server",
    "around_kill_process_tree",
    "before_launch_server",
    "mount",
    "serving_process",
]

log = structlog.get_logger(__name__)

STATUS_PATH = "/dmi/status"
"""``GET``: the run, its store and whether the schedulers still capture."""
STOP_PATH = "/dmi/stop"
"""``POST``: stop the run (durable, terminal); the server goes on serving, uncaptured."""
RUN_HEADER = "X-DMI-Run-Id"
"""The response header that names the run every response of the server belongs to."""
CAPTURE_HEADER = "X-DMI-Capture"
"""The response header with the run's state as last seen (:data:`WATCH_S`): a response
with anything but ``capturing`` belongs to a request that was not captured."""
WATCH_S = 2.0
"""How often the server asks its schedulers for the run's state (for the header)."""
STOP_WAIT_S = 30.0
"""How long ``POST /dmi/stop`` waits for the stop's outcome before answering ``stopping``."""
STOP_ANSWER_S = 300.0
"""How long the server's exit waits for the stop where SGLang's ``--watchdog-timeout``
(300 s by default: it takes a server down whose scheduler is stuck in a batch that long)
resolved to nothing."""
CHECK_WAIT_S = 60.0
"""How long the start-up check and the status endpoint wait for the schedulers."""

_ENTRY_MODULE = "sglang.launch_server"


def serving_process(argv: list[str] | None = None, main_module: str | None = None) -> bool:
    """True in the main process of SGLang's HTTP server (``python -m
    sglang.launch_server`` or ``sglang serve``), not in its children or an Engine's
    process. The arguments stand in for ``sys.argv`` and ``__main__``'s module name."""
    if multiprocessing.parent_process() is not None:
        return False
    argv = sys.argv if argv is None else argv
    if main_module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        main_module = getattr(spec, "name", None) or ""
    if main_module == _ENTRY_MODULE:
        return True
    return bool(argv) and os.path.basename(argv[0]) == "sglang" and argv[1:2] == ["serve"]


@attrs.frozen
class RunState:
    """What the server knows of its run: the body of ``/dmi/status`` and ``/dmi/stop``.

    Attributes:
        state: ``capturing``; ``paused`` (new requests are not captured: the store
            reached its cap or its disk runs short; the reason says which; requests
            taken before still are); ``stopping`` (the stop is writing what was captured);
            ``stopped`` (durable); ``failed`` (the reason says why; the run is not
            complete); ``unresponsive`` (the schedulers did not answer in time).
        seconds: how long the stop took (stopped / failed by the stop), or has taken so
            far (stopping).
    """

    run_id: str
    store: str
    state: str
    reason: str | None = None
    seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON body."""
        return attrs.asdict(self)


class RunControl:
    """The server's line to its schedulers' capture session.

    One exchange on the socket at a time. An answer that comes after its call gave up
    waiting is read and set aside by the next exchange (the scheduler answers in order),
    so it is never taken for another call's. The stop runs on its own thread, once.

    Args:
        socket: a DEALER bound where the schedulers' RPC sockets connect.
        run_id / store_url: what the server captures into (for answers and logs).
    """

    def __init__(self, socket: Any, run_id: str, store_url: str) -> None:
        self.run_id = run_id
        self.store_url = store_url
        self._socket = socket
        self._lock = threading.Lock()
        self._pending: collections.deque[str] = collections.deque()
        self._start_stop = threading.Lock()
        self._stopper: threading.Thread | None = None
        self._stop_began = 0.0
        self._stopped: RunState | None = None
        self._last_state = "capturing"
        self._asked: tuple[float, RunState] | None = None
        """When the latest status exchange began, and what it found: a caller that
        arrived before it began takes its answer (concurrent polls cost one exchange,
        not one each, one after another)."""
        self._closed = threading.Event()

    @classmethod
    def bind(cls, address: str, run_id: str, store_url: str) -> RunControl:
        """Bind the DEALER at ``address`` (``PortArgs.rpc_ipc_name``)."""
        import zmq

        socket: Any = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        return cls(socket, run_id, store_url)

    def check(self) -> None:
        """Raise unless the schedulers monitor this run.

        Raises:
            CaptureError: with the schedulers' reason (SchedulerSilentError: no answer).
        """
        with self._lock:
            self._exchange(CHECK_WAIT_S, "dmi_assert_active", run_id=self.run_id)

    def status(self) -> RunState:
        """The run's state; asks the schedulers only while neither stopping nor stopped,
        and answers ``stopping`` as soon as a stop begins. Callers waiting while another
        asks share the answer of the first exchange that began after they arrived."""
        arrived = time.monotonic()
        deadline = arrived + CHECK_WAIT_S
        while True:
            known = self._stop_state()
            if known is not None:
                return known
            if self._lock.acquire(timeout=0.2):
                break
            if time.monotonic() >= deadline:
                return self._state("unresponsive",
                                   f"the schedulers' line was busy for {CHECK_WAIT_S:g} s")
        try:
            known = self._stop_state()
            if known is not None:
                return known
            if self._asked is not None and self._asked[0] >= arrived:
                return self._asked[1]  # asked after this caller came: as fresh as its own
            began = time.monotonic()
            found = self._ask(deadline)
            self._asked = (began, found)
            return found
        finally:
            self._lock.release()

    def _ask(self, deadline: float) -> RunState:
        """One status exchange with the schedulers (under ``_lock``)."""
        try:
            self._exchange(max(0.05, deadline - time.monotonic()), "dmi_assert_active",
                           run_id=self.run_id)
        except SchedulerSilentError as exc:
            return self._stop_state() or self._state("unresponsive", str(exc))
        except CaptureError as exc:
            return self._stop_state() or self._state("failed", str(exc))
        return self._stop_state() or self._admitting(deadline)

    def _admitting(self, deadline: float) -> RunState:
        """``capturing``, or ``paused`` while new requests are refused (under ``_lock``)."""
        try:
            self._exchange(max(0.05, deadline - time.monotonic()), "dmi_assert_admitting")
        except SchedulerSilentError as exc:
            return self._state("unresponsive", str(exc))
        except CaptureError as exc:
            reason = str(exc).partition("failed in the scheduler: ")[2] or str(exc)
            return self._state("paused", reason)
        return self._state("capturing")

    @property
    def last_state(self) -> str:
        """What :data:`CAPTURE_HEADER` says: the stop's state once a stop began, else the
        state the latest status found."""
        known = self._stop_state()
        return known.state if known is not None else self._last_state

    def watch(self, every_s: float = WATCH_S) -> None:
        """Ask for the run's state every ``every_s`` on a daemon thread (until
        :meth:`close`), keeping :attr:`last_state` fresh."""

        def loop() -> None:
            while not self._closed.wait(every_s):
                try:
                    self.status()
                except Exception as exc:  # the header keeps its last value
                    log.warning("dmi.watch_failed", error=repr(exc))

        OsNamedThread(target=loop, name="dmi-watch", daemon=True).start()

    def stop(self, wait_s: float = STOP_WAIT_S) -> RunState:
        """Start the stop (the first call only) and wait up to ``wait_s`` for its outcome.

        Returns:
            ``stopped`` (durable), ``failed``, or ``stopping`` while it still runs.
        """
        with self._start_stop:
            if self._stopper is None:
                log.info("dmi.server_stopping", run_id=self.run_id)
                self._stop_began = time.monotonic()
                self._stopper = OsNamedThread(target=self._run_stop, name="dmi-stop",
                                              daemon=True)
                self._stopper.start()
        self._stopper.join(wait_s)
        return self._stop_state() or self._state("stopping")

    def close(self) -> None:
        """Close the socket, unless a stop still waits on it (closing a zmq socket
        another thread uses is unsafe; the process is ending anyway)."""
        self._closed.set()
        if self._stopper is not None and self._stopper.is_alive():
            log.warning("dmi.stop_unanswered", run_id=self.run_id)
            return
        if self._lock.acquire(timeout=5):  # not while the watcher's exchange uses it
            try:
                self._socket.close(0)
            finally:
                self._lock.release()

    def _run_stop(self) -> None:
        """The stop, sent once; it waits for the schedulers' answer however long the
        writing out takes (a scheduler that never answers is a dead server)."""
        t0 = time.monotonic()
        try:
            with self._lock:
                self._exchange(None, "dmi_stop_monitoring")
            state, reason = "stopped", None
        except Exception as exc:  # any failure is the stop's outcome
            state, reason = "failed", str(exc)
        self._stopped = self._state(state, reason, time.monotonic() - t0)
        level = log.info if state == "stopped" else log.error
        level("dmi.server_stop", **self._stopped.to_json())

    def _stop_state(self) -> RunState | None:
        if self._stopped is not None:
            return self._stopped
        if self._stopper is None:
            return None
        return self._state("stopping", None, time.monotonic() - self._stop_began)

    def _state(self, state: str, reason: str | None = None,
               seconds: float | None = None) -> RunState:
        self._last_state = state
        return RunState(self.run_id, self.store_url, state, reason,
                        None if seconds is None else round(seconds, 3))

    def _exchange(self, timeout_s: float | None, method: str, **parameters: Any) -> None:
        """Send ``method`` and wait for its answer (under ``_lock``), setting aside the
        late answers of earlier calls first (the scheduler answers in order).
        ``timeout_s``: the most the answer may take (None: no limit); a scheduler must
        take the call within :data:`CHECK_WAIT_S` in any case.

        Raises:
            SchedulerSilentError: no scheduler took the call, or no answer in time.
            CaptureError: the scheduler said no.
        """
        import zmq
        from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

        take_s = CHECK_WAIT_S if timeout_s is None else min(timeout_s, CHECK_WAIT_S)
        self._socket.setsockopt(zmq.SNDTIMEO, int(take_s * 1000))
        try:
            sock_send(self._socket, RpcReqInput(method=method, parameters=parameters))
        except zmq.Again:
            msg = f"{method}: no scheduler took the request within {take_s:g} s"
            raise SchedulerSilentError(msg) from None
        self._pending.append(method)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if deadline is None:
                self._socket.setsockopt(zmq.RCVTIMEO, -1)
            else:
                left = deadline - time.monotonic()
                self._socket.setsockopt(zmq.RCVTIMEO, max(1, int(left * 1000)))
            try:
                answer = sock_recv(self._socket)
            except zmq.Again:
                msg = f"{method}: the scheduler did not answer within {timeout_s:g} s"
                raise SchedulerSilentError(msg) from None
            answered = self._pending.popleft()
            if self._pending:  # the late answer of an earlier call: not this one's
                log.info("dmi.late_answer", method=answered)
                continue
            check_answer(method, answer)
            return


def mount(app: Any, control: RunControl) -> None:
    """Add the ``/dmi`` endpoints and the run header to SGLang's FastAPI ``app`` (before
    SGLang adds its API-key middleware, which then covers them)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def dmi_status(request: Request) -> JSONResponse:
        why = unexpected_query(request.scope)
        if why:
            return JSONResponse({"error": why}, status_code=400)
        state = await asyncio.to_thread(control.status)
        return JSONResponse(state.to_json(), status_code=200)

    async def dmi_stop(request: Request) -> JSONResponse:
        why = unexpected_query(request.scope)
        if why:
            return JSONResponse({"error": why}, status_code=400)
        state = await asyncio.to_thread(control.stop, STOP_WAIT_S)
        code = {"stopped": 200, "stopping": 202}.get(state.state, 500)
        return JSONResponse(state.to_json(), status_code=code)

    for endpoint in (dmi_status, dmi_stop):  # FastAPI resolves string annotations
        endpoint.__annotations__["request"] = Request  # in the module's globals
    auth_level(AuthLevel.ADMIN_OPTIONAL)(dmi_stop)  # an admin endpoint, as SGLang's own

    app.add_api_route(STATUS_PATH, dmi_status, methods=["GET"])
    app.add_api_route(STOP_PATH, dmi_stop, methods=["POST"])
    app.add_middleware(_RunHeader, control=control)


class _RunHeader:
    """ASGI middleware: add :data:`RUN_HEADER` and :data:`CAPTURE_HEADER` to every HTTP
    response (streamed ones included; pure ASGI, so a client's disconnect still reaches
    SGLang), and tell the warm-up when the app's lifespan ends
    (:func:`_watching_for_shutdown`)."""

    def __init__(self, app: Any, control: RunControl) -> None:
        self.app = app
        self.control = control
        self.header = (RUN_HEADER.lower().encode("latin-1"),
                       control.run_id.encode("utf-8"))
        self.capture = CAPTURE_HEADER.lower().encode("latin-1")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, _watching_for_shutdown(receive), send)
            return
        path = _app_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path == RUNS_PATH or path.startswith(RUNS_PATH + "/"):
            await self.app(scope, receive, send)
            return
        state = (self.capture, self.control.last_state.encode("latin-1"))
        own = path in (STATUS_PATH, STOP_PATH)  # the state these answers just found

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                now = (self.capture, self.control.last_state.encode("latin-1")) if own \
                    else state
                message = {**message,
                           "headers": [*message.get("headers", []), self.header, now]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _app_path(scope: dict[str, Any]) -> str:
    """The request's path within the app (its ``root_path`` left out). A read-back
    answer (``/dmi/runs...``) is about any run of the store, not a request of this
    server's run, so it carries neither header."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root):
        path = path[len(root):]
    return path


def around_kill_process_tree(original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """AROUND SGLang's ``kill_process_tree`` in the server's main process: skipped (and
    logged) when called by a warm-up given up at a shutdown (after its polls of a server
    that is gone failed), which would otherwise end the schedulers during the run's stop;
    every other call as SGLang makes it."""
    if threading.current_thread() in _ABANDONED:
        log.warning("dmi.warmup_kill_skipped",
                    reason="SGLang's warm-up, given up at the shutdown, found no server; "
                           "the server's own exit ends its processes after the stop")
        return None
    return original(*args, **kw)


def _watching_for_shutdown(receive: Any) -> Any:
    """An ASGI lifespan ``receive`` that sets :data:`_HTTP_ENDING` when the lifespan
    ends: its shutdown message arrives (a Ctrl-C), or the wait for it is cancelled
    (uvicorn's forced exit on a second Ctrl-C; SGLang's SIGTERM path, which exits the
    event loop), before the app's lifespan goes on to its end."""

    async def watching() -> Any:
        try:
            message = await receive()
        except BaseException:
            _HTTP_ENDING.set()
            raise
        if isinstance(message, dict) and message.get("type") == "lifespan.shutdown":
            _HTTP_ENDING.set()
        return message

    return watching


EXIT_NOT_DURABLE = 4
"""The server's exit status when the stop at its end did not make the run durable
(failed, or still running when the wait ran out)."""


def around_http_server(original: Callable[..., Any], server_args: Any, tokenizer_manager: Any,
                       template_manager: Any, port_args: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``http_server._setup_and_run_http_server``: check, mount, serve, stop.

    Raises:
        CaptureError: the schedulers do not monitor the run (nothing is served).
        SystemExit: :data:`EXIT_NOT_DURABLE`, when the server ended (SIGINT) and the stop
            that followed did not make the run durable (a script can tell).
    """
    from dmi_sglang.domain.settings import Settings

    settings = Settings.from_env()
    control = RunControl.bind(port_args.rpc_ipc_name, settings.model_id or "",
                              settings.store().url)
    checked = False
    outcome: RunState | None = None
    try:
        control.check()
        checked = True
        mount(_sglang_app(), control)
        control.watch()
        factory = _state.STATE.factory
        reads = factory.serving_reads(settings, os.environ.get(_state.READS_ADDRESS, "")) \
            if factory is not None else None
        mount_reads(_sglang_app(), reads)
        log.info("dmi.serving", run_id=control.run_id, store=control.store_url,
                 status=STATUS_PATH, stop=STOP_PATH)
        result = original(server_args, tokenizer_manager, template_manager, port_args,
                          *args, **kw)
    finally:
        # SGLang's SIGTERM path asks the schedulers to shut down, and each stops the run
        # first (runtime_hooks.before_scheduler_shutdown): a stop from here would wait for
        # schedulers that no longer read requests
        sigterm = bool(getattr(tokenizer_manager, "gracefully_exit", False))
        if checked and not sigterm and _children_running():
            from sglang.srt.arg_groups.overrides import resolution_result

            watchdog = resolution_result(server_args, "watchdog_timeout")
            outcome = control.stop(float(watchdog) if watchdog else STOP_ANSWER_S)
        control.close()
        _remove_read_address(os.environ.get(_state.READS_ADDRESS, ""))
    if outcome is not None and outcome.state != "stopped":  # the server ended normally
        log.error("dmi.exit_not_durable", run_id=control.run_id, state=outcome.state,
                  reason=outcome.reason)
        raise SystemExit(EXIT_NOT_DURABLE)
    return result


def _children_running(children: Iterable[Any] | None = None) -> bool:
    """True while a process this one started with ``multiprocessing`` (SGLang's
    schedulers and detokenizer; ``children``, default all) still runs. ``multiprocessing``
    cannot tell once SGLang killed and reaped them itself (``kill_process_tree``), so ask
    the OS (which reaps an exited one: the process is ending)."""
    for child in multiprocessing.active_children() if children is None else children:
        try:
            pid, _ = os.waitpid(child.pid, os.WNOHANG)  # type: ignore[arg-type]
        except ChildProcessError:  # reaped already: gone
            continue
        if pid == 0:
            return True
    return False


def before_launch_server(server_args: Any, *args: Any,
                         **kw: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """BEFORE ``http_server.launch_server``, before any process is started: refuse the
    server modes the capture cannot follow, mark the schedulers as a server's
    (:data:`~.runtime_hooks.SERVER_MARK`: a capture failure ends the capture, not the
    serving), start the detokenizer ignoring SIGINT, and wrap the warm-up so that a
    shutdown does not wait for it (:func:`_warmup_unless_ending`).

    Ctrl-C reaches every process of the terminal's group; a detokenizer that died of it
    would make SGLang tear the server down before the run is stopped (the schedulers
    already ignore SIGINT while they capture). The main process stops the run, then
    SGLang ends them all.

    Raises:
        UnsupportedConfigurationError: ``--tokenizer-worker-num`` above 1 (its HTTP
            workers are fresh processes without the ``/dmi`` endpoints or the stop),
            ``--detokenizer-worker-num`` above 1, or ``SGLANG_RUST_SERVER`` (SGLang's
            HTTP server is not started at all).
    """
    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import SERVER_MARK
    from dmi_sglang.errors import UnsupportedConfigurationError

    problems = []
    workers = int(getattr(server_args, "tokenizer_worker_num", 1) or 1)
    if workers > 1:
        problems.append(f"--tokenizer-worker-num {workers}: serving with capture needs 1 "
                        "(the other HTTP workers have no /dmi endpoints and no stop)")
    from sglang.srt.arg_groups.overrides import resolution_result

    detokenizers = int(resolution_result(server_args, "detokenizer_worker_num") or 1)
    if detokenizers > 1:
        problems.append(f"--detokenizer-worker-num {detokenizers}: serving with capture "
                        "needs 1 (its router process would end the server on Ctrl-C "
                        "before the run is stopped)")
    from sglang.srt.environ import envs

    if envs.SGLANG_RUST_SERVER.get():
        problems.append("SGLANG_RUST_SERVER is set: serving with capture needs SGLang's "
                        "Python HTTP server (unset it)")
    if problems:
        raise UnsupportedConfigurationError(tuple(problems))
    os.environ[SERVER_MARK] = "1"
    os.environ[_state.READS_ADDRESS] = _new_read_address()
    _HTTP_ENDING.clear()  # this launch's HTTP server has not ended
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    # positions after server_args: init_tokenizer_manager_func, run_scheduler_process_func,
    # run_detokenizer_process_func (2), execute_warmup_func (3)
    args, kw = _wrapped_argument(args, kw, 2, "run_detokenizer_process_func",
                                 default=run_detokenizer_process, wrapper=_without_sigint)
    args, kw = _wrapped_argument(args, kw, 3, "execute_warmup_func", default=None,
                                 wrapper=_warmup_unless_ending)
    return (server_args, *args), kw


def _wrapped_argument(args: tuple[Any, ...], kw: dict[str, Any], slot: int, name: str, *,
                      default: Callable[..., Any] | None, wrapper: Callable[..., Any],
                      ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kw`` with the function argument at position ``slot`` (or keyword
    ``name``, or ``default`` where neither is given) replaced by ``wrapper`` bound to it;
    a ``default`` of None lets the wrapper pick SGLang's default when it runs."""
    import functools

    if len(args) > slot:
        bound = functools.partial(wrapper, args[slot])
        return (*args[:slot], bound, *args[slot + 1:]), kw
    return args, {**kw, name: functools.partial(wrapper, kw.get(name, default))}


_HTTP_ENDING = threading.Event()
"""Set in the server's main process when SGLang's HTTP server shuts down (its lifespan
ends, seen by :class:`_RunHeader`); cleared when a server launches."""
_ABANDONED: set[threading.Thread] = set()
"""Warm-up threads given up at a shutdown (:func:`_warmup_unless_ending`)."""


def _warmup_unless_ending(target: Callable[..., Any] | None, *args: Any, **kw: Any) -> Any:
    """Run SGLang's warm-up ``target`` (None: SGLang's default) on a daemon thread of its
    own and return what it returns (raising what it raises), or False as soon as the
    HTTP server's lifespan ends first.

    SGLang's lifespan joins its warm-up thread when the HTTP server shuts down, and the
    warm-up first polls the server, up to 120 times a second apart, before it kills every
    process of the server: a Ctrl-C before the first poll got its answer kept the server
    up for two minutes, then ended the schedulers without the run's stop. Returning False
    makes SGLang's warm-up thread end without marking the server ready. The abandoned
    thread goes on polling; its kill is skipped (:func:`around_kill_process_tree`), so it
    cannot end the process while the stop runs. Uvicorn ends the lifespan only after the
    open connections closed: until then the warm-up is not given up."""
    if target is None:
        from sglang.srt.entrypoints.http_server import _execute_server_warmup

        target = _execute_server_warmup
    warmup: Callable[..., Any] = target
    outcome: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(warmup(*args, **kw))
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)

    worker = OsNamedThread(target=run, name="dmi-warmup", daemon=True)
    worker.start()
    while worker.is_alive():
        if _HTTP_ENDING.is_set():
            _ABANDONED.add(worker)
            log.info("dmi.warmup_abandoned", reason="the HTTP server is shutting down")
            return False
        worker.join(0.2)
    if failure:
        raise failure[0]
    return outcome[0] if outcome else False


def _new_read_address() -> str:
    """An IPC address for the store owner's read channel, in a new directory only this
    user can enter."""
    from dmi_sglang.domain.store_config import channel_directory

    return f"ipc://{os.path.join(channel_directory('dmi-reads-'), 'reads')}"


def _remove_read_address(address: str) -> None:
    """Remove the read channel's socket directory (made by :func:`_new_read_address`)."""
    import shutil

    directory = os.path.dirname(address.removeprefix("ipc://"))
    if address.startswith("ipc://") and os.path.basename(directory).startswith("dmi-reads-"):
        shutil.rmtree(directory, ignore_errors=True)


def _without_sigint(target: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Run a child process's ``target`` with SIGINT ignored (picklable: it crosses to a
    spawned process)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return target(*args, **kw)


def _sglang_app() -> Any:
    """SGLang's FastAPI application (module state of its HTTP server)."""
    from sglang.srt.entrypoints import http_server

    return http_server.app


SERVER_HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("sglang.srt.entrypoints.http_server.launch_server", "BEFORE", before_launch_server),
    ("sglang.srt.entrypoints.http_server._setup_and_run_http_server", "AROUND",
     around_http_server),
    ("sglang.srt.entrypoints.http_server.kill_process_tree", "AROUND",
     around_kill_process_tree),
)
"""``(target, hook type, function)`` registered only in the server's main process."""
