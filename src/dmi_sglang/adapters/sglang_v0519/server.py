"""SGLang 0.5.19's HTTP server with capture: the main process's part.

``python -m sglang.launch_server`` (and ``sglang serve``, and ``dmi-sglang serve``, which
runs the former) loads the plugin in its main process before it parses its arguments. In
that process, and only there, :data:`SERVER_HOOKS` wraps
``http_server._setup_and_run_http_server``, which runs after the schedulers loaded the
model and before the HTTP server starts. The wrapper:

* opens the RPC line to the schedulers that SGLang's ``Engine`` has and its server lacks (a
  DEALER bound at ``PortArgs.rpc_ipc_name``; the schedulers already connect to it) and
  asks them whether they monitor the run: a server asked to capture that cannot starts no
  HTTP server;
* adds ``GET /dmi/status`` and ``POST /dmi/stop`` to SGLang's FastAPI app before SGLang
  adds its API-key middleware, so both are protected like the server's own API (the stop
  as an admin endpoint), and the header ``X-DMI-Run-Id`` to every response;
* stops the run when the HTTP server returns (SIGINT) while the schedulers still run,
  before SGLang kills them: the stop is durable or the run is marked failed, within
  :data:`STOP_WAIT_S`; a call that no scheduler takes or answers in its time fails, and
  every later one at once.

SGLang's own SIGTERM path (drain the requests, then ``ShutdownReq`` to the schedulers) is
covered in the scheduler (``runtime_hooks.before_scheduler_shutdown``). After a stop the
server keeps serving, uncaptured.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from dmi_sglang.adapters.sglang_v0519.engine import SchedulerSilentError, rpc_call
from dmi_sglang.errors import CaptureError

__all__ = [
    "RUN_HEADER",
    "SERVER_HOOKS",
    "STATUS_PATH",
    "STOP_PATH",
    "STOP_WAIT_S",
    "RunControl",
    "around_http_server",
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
STOP_WAIT_S = 30.0
"""How long a stop (the endpoint, or the server's exit) waits for the schedulers' answer."""
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


class RunControl:
    """The server's line to its schedulers' capture session, one call at a time.

    Args:
        socket: a DEALER bound where the schedulers' RPC sockets connect.
        run_id / store_url: what the server captures into (for answers and logs).
    """

    def __init__(self, socket: Any, run_id: str, store_url: str) -> None:
        self.run_id = run_id
        self.store_url = store_url
        self._socket = socket
        self._lock = threading.Lock()
        self._stopped: dict[str, Any] | None = None
        self._broken: str | None = None

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
            CaptureError: with the schedulers' reason.
        """
        self._call(CHECK_WAIT_S, "dmi_assert_active", run_id=self.run_id)

    def status(self) -> dict[str, Any]:
        """``{"run_id", "store", "state", "reason"}``; state is ``capturing``, ``stopped``
        or ``failed`` (the reason says why, and whether the stop was durable)."""
        out: dict[str, Any] = {"run_id": self.run_id, "store": self.store_url}
        if self._stopped is not None:
            return {**out, **self._stopped}
        try:
            self.check()
        except CaptureError as exc:
            return {**out, "state": "failed", "reason": str(exc)}
        return {**out, "state": "capturing", "reason": None}

    def stop(self) -> dict[str, Any]:
        """Stop the run in the schedulers: durable when it returns. Terminal and
        idempotent: later calls answer what the first one found.

        Returns:
            ``{"run_id", "store", "state": "stopped" | "failed", "reason", "seconds"}``.
        """
        with self._lock:
            if self._stopped is None:
                t0 = time.monotonic()
                try:
                    self._call_locked(STOP_WAIT_S, "dmi_stop_monitoring")
                    state, reason = "stopped", None
                except CaptureError as exc:
                    state, reason = "failed", str(exc)
                self._stopped = {"state": state, "reason": reason,
                                 "seconds": round(time.monotonic() - t0, 3)}
                level = log.info if state == "stopped" else log.error
                level("dmi.server_stop", run_id=self.run_id, **self._stopped)
            return {"run_id": self.run_id, "store": self.store_url, **self._stopped}

    def close(self) -> None:
        """Close the socket (the schedulers' sockets reconnect to nothing)."""
        self._socket.close(0)

    def _call(self, timeout_s: float, method: str, **parameters: Any) -> None:
        with self._lock:
            self._call_locked(timeout_s, method, **parameters)

    def _call_locked(self, timeout_s: float, method: str, **parameters: Any) -> None:
        import zmq

        if self._broken is not None:  # a late answer would be taken for the next call's
            raise CaptureError(self._broken)
        self._socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self._socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        try:
            rpc_call(self._socket, method, **parameters)
        except SchedulerSilentError as exc:
            self._broken = f"the schedulers stopped answering ({exc})"
            raise


def mount(app: Any, control: RunControl) -> None:
    """Add the ``/dmi`` endpoints and the run header to SGLang's FastAPI ``app`` (before
    SGLang adds its API-key middleware, which then covers them)."""
    from fastapi.responses import JSONResponse
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def dmi_status() -> JSONResponse:
        body = await asyncio.to_thread(control.status)
        return JSONResponse(body, status_code=200)

    async def dmi_stop() -> JSONResponse:
        body = await asyncio.to_thread(control.stop)
        return JSONResponse(body, status_code=200 if body["state"] == "stopped" else 500)

    auth_level(AuthLevel.ADMIN_OPTIONAL)(dmi_stop)  # an admin endpoint, as SGLang's own

    app.add_api_route(STATUS_PATH, dmi_status, methods=["GET"])
    app.add_api_route(STOP_PATH, dmi_stop, methods=["POST"])
    app.add_middleware(_RunHeader, run_id=control.run_id)


class _RunHeader:
    """ASGI middleware: add :data:`RUN_HEADER` to every HTTP response (streamed ones
    included; pure ASGI, so a client's disconnect still reaches SGLang)."""

    def __init__(self, app: Any, run_id: str) -> None:
        self.app = app
        self.header = (RUN_HEADER.lower().encode("latin-1"), run_id.encode("utf-8"))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def around_http_server(original: Callable[..., Any], server_args: Any, tokenizer_manager: Any,
                       template_manager: Any, port_args: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``http_server._setup_and_run_http_server``: check, mount, serve, stop.

    Raises:
        CaptureError: the schedulers do not monitor the run (nothing is served).
    """
    from dmi_sglang.domain.settings import Settings

    settings = Settings.from_env()
    control = RunControl.bind(port_args.rpc_ipc_name, settings.model_id or "",
                              settings.store().url)
    try:
        control.check()
        mount(_sglang_app(), control)
        log.info("dmi.serving", run_id=control.run_id, store=control.store_url,
                 status=STATUS_PATH, stop=STOP_PATH)
        return original(server_args, tokenizer_manager, template_manager, port_args,
                        *args, **kw)
    finally:
        if _children_running():  # SGLang has not ended them (its SIGTERM path does)
            control.stop()
        control.close()


def _children_running() -> bool:
    """True while a process this one started with ``multiprocessing`` (SGLang's
    schedulers and detokenizer) still runs. ``multiprocessing`` cannot tell once SGLang
    killed and reaped them itself (``kill_process_tree``), so ask the OS."""
    import psutil

    for child in multiprocessing.active_children():
        try:
            if psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def _sglang_app() -> Any:
    """SGLang's FastAPI application (module state of its HTTP server)."""
    from sglang.srt.entrypoints import http_server

    return http_server.app


SERVER_HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("sglang.srt.entrypoints.http_server._setup_and_run_http_server", "AROUND",
     around_http_server),
)
"""``(target, hook type, function)`` registered only in the server's main process."""
