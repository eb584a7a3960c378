"""The HTTP server's capture side (``adapters/sglang_v0519/server.py``) on CPU.

The schedulers' end of the RPC line is a thread with a real zmq DEALER connected where the
server binds (as SGLang's schedulers connect to ``PortArgs.rpc_ipc_name``), answering
with SGLang's own ``RpcReqOutput``; the endpoints run on a FastAPI app behind SGLang's own
API-key middleware.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

Answer = tuple[bool, str] | tuple[bool, str, float] | None  # None: never; 3rd: delay (s)


class FakeSchedulers:
    """A thread that answers each RPC with the next scripted answer and records calls."""

    def __init__(self, address: str, answers: list[Answer]) -> None:
        import zmq

        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._answers = list(answers)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.connect(address)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq
        from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send

        while not self._done.is_set():
            try:
                req = sock_recv(self._socket)
            except zmq.Again:
                continue
            self.calls.append((req.method, dict(req.parameters or {})))
            answer = self._answers.pop(0) if self._answers else (True, "")
            if answer is not None:
                if len(answer) > 2:
                    time.sleep(answer[2])  # type: ignore[misc]
                sock_send(self._socket, RpcReqOutput(success=answer[0], message=answer[1]))

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self._socket.close(0)


@pytest.fixture
def line(tmp_path: Path) -> Iterator[Callable[[list[Answer]], Any]]:
    """``line(answers)`` -> ``(RunControl, FakeSchedulers)`` on a fresh ipc address."""
    from dmi_sglang.adapters.sglang_v0519.server import RunControl

    made: list[tuple[Any, FakeSchedulers]] = []

    def make(answers: list[Answer]) -> tuple[Any, FakeSchedulers]:
        address = f"ipc://{tmp_path}/rpc-{len(made)}"
        control = RunControl.bind(address, "run-s", "chdb:///tmp/store")
        made.append((control, FakeSchedulers(address, answers)))
        return made[-1]

    yield make
    for control, fake in made:
        fake.close()
        control.close()


def test_only_the_http_servers_main_process_gets_the_server_hooks() -> None:
    """``python -m sglang.launch_server`` and ``sglang serve`` are the server; an
    Engine's script, pytest and ``sglang`` with another command are not."""
    from dmi_sglang.adapters.sglang_v0519.server import serving_process

    assert serving_process(["/x/sglang/launch_server.py"], "sglang.launch_server")
    assert serving_process(["/usr/bin/sglang", "serve", "--model-path", "m"], "")
    assert not serving_process(["/usr/bin/sglang", "version"], "")
    assert not serving_process(["my_script.py"], "")
    assert not serving_process(["/x/pytest"], "pytest")
    assert not serving_process()  # this test process


def test_the_plugin_registers_the_server_hook_only_in_the_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dmi_sglang.adapters.sglang_v0519 import _state, plugin, server
    from dmi_sglang.app.composition import PipelineFactory

    calls: list[str] = []
    monkeypatch.setattr(HookRegistry, "register",
                        classmethod(lambda cls, target, *a, **k: calls.append(target)))
    monkeypatch.setenv("DMX_SGLANG_ENABLE", "1")
    target = server.SERVER_HOOKS[0][0]
    for in_server in (False, True):
        calls.clear()
        monkeypatch.setattr(_state, "STATE", _state.PluginState())
        monkeypatch.setattr(server, "serving_process", lambda in_server=in_server: in_server)
        plugin.register(PipelineFactory())
        assert (target in calls) is in_server
        assert _state.STATE.problems == []


def test_the_run_control_checks_stops_once_and_reports(line) -> None:
    """The check names the run; the stop is terminal (a second stop is not sent, it
    answers what the first found); the status after it says stopped, without asking."""
    control, fake = line([(True, ""), (True, ""), (True, "")])
    control.check()
    assert control.status().state == "capturing"
    first = control.stop()
    assert (first.state, first.reason, first.run_id) == ("stopped", None, "run-s")
    assert first.seconds is not None
    assert control.stop() == first
    assert control.status() == first
    assert fake.calls == [("dmi_assert_active", {"run_id": "run-s"}),
                          ("dmi_assert_active", {"run_id": "run-s"}),
                          ("dmi_assert_admitting", {}),
                          ("dmi_stop_monitoring", {})]


def test_the_status_says_paused_while_new_requests_are_refused(line) -> None:
    """The run still captures (and can be stopped), but new requests are not captured:
    the status says paused, with the schedulers' reason."""
    refused = "new requests are not captured: the store reached its cap: 10.2 GB of ..."
    control, fake = line([(True, ""), (False, refused), (True, ""), (True, "")])
    paused = control.status()
    assert (paused.state, paused.reason) == ("paused", refused)
    assert control.status().state == "capturing"
    assert [m for m, _ in fake.calls] == ["dmi_assert_active", "dmi_assert_admitting"] * 2


def test_the_watch_keeps_the_capture_header_fresh(line) -> None:
    from fastapi.testclient import TestClient

    from dmi_sglang.adapters.sglang_v0519.server import CAPTURE_HEADER

    control, _ = line([(True, ""), (False, "new requests are not captured: disk")] * 500)
    client = TestClient(_app(control, None))
    assert client.post("/generate").headers[CAPTURE_HEADER] == "capturing"  # not asked yet
    control.watch(0.02)
    deadline = time.monotonic() + 10
    while control.last_state != "paused" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.post("/generate").headers[CAPTURE_HEADER] == "paused"


def test_a_failed_stop_is_reported_failed_with_the_schedulers_reason(line) -> None:
    control, _ = line([(False, "flush failed: disk full")])
    out = control.stop()
    assert out.state == "failed"
    assert "flush failed: disk full" in out.reason
    assert control.status().state == "failed"


def test_concurrent_status_polls_share_the_schedulers_answers(line) -> None:
    """16 callers at once, each exchange taking 0.1 s: a caller waiting while another
    asks takes the answer of the first exchange that began after it came, so the
    schedulers are asked a few times, not 16 times two questions one after another
    (32 exchanges and 3.2 s for the last caller before)."""
    from concurrent.futures import ThreadPoolExecutor

    control, fake = line([(True, "", 0.05)] * 64)
    with ThreadPoolExecutor(16) as pool:
        timed = list(pool.map(lambda _: _timed(control.status), range(16)))
    assert all(state.state == "capturing" for state, _ in timed)
    assert len(fake.calls) <= 6  # at most 3 rounds of (active, admitting)
    assert max(seconds for _, seconds in timed) < 1.0
    before = len(fake.calls)
    assert control.status().state == "capturing"  # a caller after them asks afresh
    assert len(fake.calls) == before + 2


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    return call(), time.monotonic() - t0


def test_a_long_stop_answers_stopping_then_its_outcome(line) -> None:
    """A stop that writes out more than the endpoint waits for is ``stopping`` (not
    failed), status says so without asking the busy schedulers, and the outcome
    arrives when the schedulers answer."""
    control, fake = line([(True, "", 1.5)])
    assert control.stop(wait_s=0.2).state == "stopping"
    during = control.status()
    assert during.state == "stopping"
    assert during.seconds is not None
    final = control.stop(wait_s=10)
    assert final.state == "stopped"
    assert control.status() == final
    assert [m for m, _ in fake.calls] == ["dmi_stop_monitoring"]


def test_a_late_answer_is_never_taken_for_the_next_calls(line, monkeypatch) -> None:
    """A check that gave up waiting leaves its answer in flight; the next call sets it
    aside and reads its own (here: the late answer says yes, the next one no)."""
    from dmi_sglang.adapters.sglang_v0519 import server
    from dmi_sglang.errors import CaptureError

    control, fake = line([(True, ""), (True, "", 1.5), (False, "not monitoring")])
    control.check()  # the line is up
    monkeypatch.setattr(server, "CHECK_WAIT_S", 0.5)
    with pytest.raises(CaptureError, match=r"did not answer within 0\.5 s"):
        control.check()
    monkeypatch.setattr(server, "CHECK_WAIT_S", 10)
    with pytest.raises(CaptureError, match="not monitoring"):
        control.check()
    assert [m for m, _ in fake.calls] == ["dmi_assert_active"] * 3


def test_a_stop_after_a_check_that_gave_up_reads_its_own_answer(line, monkeypatch) -> None:
    """The stop sets aside the late answer of a status check that gave up (here: yes)
    and reports its own (here: no)."""
    from dmi_sglang.adapters.sglang_v0519 import server

    control, _ = line([(True, ""), (True, "", 1.5), (False, "flush failed")])
    control.check()
    monkeypatch.setattr(server, "CHECK_WAIT_S", 0.5)
    assert control.status().state == "unresponsive"
    monkeypatch.setattr(server, "CHECK_WAIT_S", 10)
    out = control.stop(wait_s=10)
    assert out.state == "failed"
    assert "flush failed" in out.reason


def _app(control: Any, api_key: str | None, admin: str | None = None) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from sglang.srt.utils.auth import add_api_key_middleware

    from dmi_sglang.adapters.sglang_v0519.server import mount

    app = FastAPI()

    async def tokens() -> Any:
        async def chunks() -> Any:
            for word in ("a", "b"):
                yield f"data: {word}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.add_api_route("/generate", tokens, methods=["POST"])
    mount(app, control)
    if api_key is not None:  # what SGLang's server does after the hook mounted
        add_api_key_middleware(app, api_key=api_key, admin_api_key=admin)
    return app


def test_endpoints_report_stop_and_name_the_run_on_every_response(line) -> None:
    from fastapi.testclient import TestClient

    from dmi_sglang.adapters.sglang_v0519.server import RUN_HEADER, STATUS_PATH, STOP_PATH

    control, fake = line([(True, ""), (True, ""), (True, ""), (False, "never sent")])
    client = TestClient(_app(control, None))
    status = client.get(STATUS_PATH)
    assert status.status_code == 200
    assert status.json() == {"run_id": "run-s", "store": "chdb:///tmp/store",
                             "state": "capturing", "reason": None, "seconds": None}
    streamed = client.post("/generate")
    assert streamed.text == "data: a\n\ndata: b\n\n"
    assert streamed.headers[RUN_HEADER] == "run-s"
    stop = client.post(STOP_PATH)
    assert stop.status_code == 200
    assert stop.json()["state"] == "stopped"
    assert stop.headers[RUN_HEADER] == "run-s"
    assert client.post("/generate").headers["X-DMI-Capture"] == "stopped"
    assert client.post(STOP_PATH).json() == stop.json()
    assert client.get(STATUS_PATH).json()["state"] == "stopped"
    assert [m for m, _ in fake.calls] == ["dmi_assert_active", "dmi_assert_admitting",
                                          "dmi_stop_monitoring"]


def test_a_failed_stop_answers_500(line) -> None:
    from fastapi.testclient import TestClient

    from dmi_sglang.adapters.sglang_v0519.server import STOP_PATH

    control, _ = line([(False, "store down")])
    stop = TestClient(_app(control, None)).post(STOP_PATH)
    assert stop.status_code == 500
    assert stop.json()["state"] == "failed"
    assert "store down" in stop.json()["reason"]


def test_the_endpoints_are_protected_like_the_servers_api(line) -> None:
    """With ``--api-key``, neither endpoint answers without the key (nothing is sent to
    the schedulers), and both answer with it."""
    from fastapi.testclient import TestClient

    from dmi_sglang.adapters.sglang_v0519.server import STATUS_PATH, STOP_PATH

    control, fake = line([(True, ""), (True, "")])
    client = TestClient(_app(control, "sekret"))
    assert client.get(STATUS_PATH).status_code == 401
    assert client.post(STOP_PATH).status_code == 401
    assert client.post(STOP_PATH, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert fake.calls == []
    key = {"Authorization": "Bearer sekret"}
    assert client.get(STATUS_PATH, headers=key).json()["state"] == "capturing"
    assert client.post(STOP_PATH, headers=key).json()["state"] == "stopped"


def test_the_stop_is_an_admin_endpoint(line) -> None:
    """With an admin key too, the stop needs the admin key (as SGLang's own admin
    endpoints), while the status takes the API key like ``/generate``."""
    from fastapi.testclient import TestClient

    from dmi_sglang.adapters.sglang_v0519.server import STATUS_PATH, STOP_PATH

    control, _ = line([(True, ""), (True, "")])
    client = TestClient(_app(control, "user-key", admin="admin-key"))
    user, admin = ({"Authorization": f"Bearer {k}"} for k in ("user-key", "admin-key"))
    assert client.post(STOP_PATH, headers=user).status_code == 401
    assert client.get(STATUS_PATH, headers=user).json()["state"] == "capturing"
    assert client.post(STOP_PATH, headers=admin).json()["state"] == "stopped"


def _around(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: list[Answer],
            serve: Callable[[], Any], children: bool = True,
            tm: Any = "tm") -> tuple[Any, FakeSchedulers]:
    from types import SimpleNamespace

    from fastapi import FastAPI

    from dmi_sglang.adapters.sglang_v0519 import server

    address = f"ipc://{tmp_path}/rpc"
    fake = FakeSchedulers(address, answers)
    app = FastAPI()
    monkeypatch.setattr(server, "_sglang_app", lambda: app)
    monkeypatch.setattr(server, "_children_running", lambda: children)
    monkeypatch.setenv("DMX_MODEL_ID", "run-a")
    monkeypatch.setenv("DMX_DB_URL", f"chdb://{tmp_path}/store")
    seen: list[Any] = []

    def original(server_args: Any, tm: Any, template: Any, port_args: Any, *rest: Any,
                 **kw: Any) -> Any:
        seen.append(([r.path for r in app.routes], fake.calls[:], rest, kw))
        return serve()

    port_args = SimpleNamespace(rpc_ipc_name=address)
    try:
        out = server.around_http_server(original, "sa", tm, "tpl", port_args, ["infos"],
                                        None, launch_callback=None)
    except BaseException as exc:
        out = exc
    finally:
        fake.close()
    return (out, seen), fake


def test_the_server_is_checked_then_served_then_stopped(tmp_path, monkeypatch) -> None:
    """Before SGLang serves: the schedulers monitor this run and the endpoints are
    mounted; when the HTTP server returns (SIGINT), the run is stopped before SGLang
    kills the schedulers; SGLang's arguments pass through unchanged."""
    from dmi_sglang.adapters.sglang_v0519.server import STATUS_PATH, STOP_PATH

    (out, seen), fake = _around(tmp_path, monkeypatch, [(True, ""), (True, "")],
                                lambda: "served")
    assert out == "served"
    paths, calls_before, rest, kw = seen[0]
    assert {STATUS_PATH, STOP_PATH} <= set(paths)
    assert calls_before == [("dmi_assert_active", {"run_id": "run-a"})]
    assert (rest, kw) == ((["infos"], None), {"launch_callback": None})
    assert fake.calls[1:] == [("dmi_stop_monitoring", {})]


def test_a_server_whose_schedulers_do_not_monitor_does_not_serve(tmp_path,
                                                                 monkeypatch) -> None:
    from dmi_sglang.errors import CaptureError

    (out, seen), fake = _around(tmp_path, monkeypatch,
                                [(False, "DMI monitoring is not active")], lambda: "served")
    assert isinstance(out, CaptureError)
    assert "DMI monitoring is not active" in str(out)
    assert seen == []
    assert [m for m, _ in fake.calls] == ["dmi_assert_active"]  # no stop of another run


def test_a_server_that_fails_still_stops_the_run_and_without_schedulers_does_not_wait(
        tmp_path, monkeypatch) -> None:
    def boom() -> Any:
        raise RuntimeError("uvicorn failed")

    (out, _), fake = _around(tmp_path, monkeypatch, [(True, ""), (True, "")], boom)
    assert isinstance(out, RuntimeError)
    assert [m for m, _ in fake.calls] == ["dmi_assert_active", "dmi_stop_monitoring"]
    (out, _), fake = _around(tmp_path, monkeypatch, [(True, "")], lambda: "served",
                             children=False)
    assert [m for m, _ in fake.calls] == ["dmi_assert_active"]


def test_after_sigterm_the_schedulers_stop_the_run_not_the_server(tmp_path,
                                                                  monkeypatch) -> None:
    """SGLang's SIGTERM path (``gracefully_exit``) asks the schedulers to shut down, and
    their shutdown hook stops the run: the server sends no stop that no scheduler would
    read (on the H200 it waited 60 s for one)."""
    from types import SimpleNamespace

    (out, _), fake = _around(tmp_path, monkeypatch, [(True, "")], lambda: "served",
                             tm=SimpleNamespace(gracefully_exit=True))
    assert out == "served"
    assert [m for m, _ in fake.calls] == ["dmi_assert_active"]


def test_a_call_no_scheduler_takes_fails_in_its_time(tmp_path, monkeypatch) -> None:
    """Nothing connected (the schedulers are gone): the call fails within its wait
    instead of blocking the server's exit for good."""
    from dmi_sglang.adapters.sglang_v0519 import server
    from dmi_sglang.errors import CaptureError

    monkeypatch.setattr(server, "CHECK_WAIT_S", 0.3)
    control = server.RunControl.bind(f"ipc://{tmp_path}/nobody", "run-n", "chdb:///x")
    try:
        t0 = time.monotonic()
        out = control.stop(wait_s=10)
        assert time.monotonic() - t0 < 5
        assert out.state == "failed"
        assert "no scheduler took the request within 0.3 s" in out.reason
        with pytest.raises(CaptureError, match="no scheduler took the request"):
            control.check()
    finally:
        control.close()


def test_children_are_running_until_they_exit_and_are_reaped_by_anyone() -> None:
    """The check the exit relies on: a live child counts; once it has exited and was
    reaped by something other than multiprocessing (as SGLang's kill_process_tree does),
    it does not, although multiprocessing still lists it."""
    import multiprocessing
    import os
    import signal

    from dmi_sglang.adapters.sglang_v0519.server import _children_running

    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        assert _children_running([child])
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)  # reaped behind multiprocessing's back
        assert child in multiprocessing.active_children()
        assert not _children_running([child])
    finally:
        child.kill()


def test_before_launch_the_server_marks_its_schedulers_and_shields_its_detokenizer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The detokenizer target SGLang would start (its default, or one given by keyword
    or position) is wrapped to ignore SIGINT, the warm-up to give up at shutdown; the
    schedulers' environment carries the server mark; the other arguments pass
    unchanged."""
    import functools
    from types import SimpleNamespace

    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    from dmi_sglang.adapters.sglang_v0519 import server
    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import SERVER_MARK

    monkeypatch.delenv(SERVER_MARK, raising=False)
    monkeypatch.delenv("SGLANG_RUST_SERVER", raising=False)
    args = SimpleNamespace(tokenizer_worker_num=1, detokenizer_worker_num=1)
    (sa, *rest), kw = server.before_launch_server(args, launch_callback="cb")
    assert sa is args
    assert rest == []
    wrapped = kw.pop("run_detokenizer_process_func")
    warmup = kw.pop("execute_warmup_func")  # SGLang's default, looked up when it runs
    assert (warmup.func, warmup.args) == (server._warmup_unless_ending, (None,))
    assert kw == {"launch_callback": "cb"}
    assert isinstance(wrapped, functools.partial)
    assert wrapped.func is server._without_sigint
    assert wrapped.args == (run_detokenizer_process,)
    assert os.environ[SERVER_MARK] == "1"
    (_, *rest), kw = server.before_launch_server(args, "init", "sched", "detok", "warm",
                                                 "cb")
    assert rest[:2] == ["init", "sched"]
    assert rest[4:] == ["cb"]
    assert (rest[2].func, rest[2].args) == (server._without_sigint, ("detok",))
    assert (rest[3].func, rest[3].args) == (server._warmup_unless_ending, ("warm",))
    assert kw == {}
    _, kw = server.before_launch_server(args, execute_warmup_func="warm")
    assert (kw["execute_warmup_func"].func, kw["execute_warmup_func"].args) == (
        server._warmup_unless_ending, ("warm",))


def test_the_warmup_returns_what_sglangs_returns_and_raises_what_it_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While the HTTP server runs, the wrapped warm-up is SGLang's: its result, its
    exception."""
    from dmi_sglang.adapters.sglang_v0519 import server

    monkeypatch.setattr(server, "_HTTP_ENDING", threading.Event())
    assert server._warmup_unless_ending(lambda args: ("ready", args), "sa") == ("ready", "sa")
    assert server._warmup_unless_ending(lambda args: False, "sa") is False

    def broken(args: object) -> bool:
        raise RuntimeError("warm-up request failed")

    with pytest.raises(RuntimeError, match="warm-up request failed"):
        server._warmup_unless_ending(broken, "sa")


def test_a_shutdown_during_the_warmup_ends_the_lifespan_at_once(
        line, monkeypatch: pytest.MonkeyPatch) -> None:
    """As SGLang's lifespan: a thread runs the warm-up, and the shutdown joins it. A
    warm-up still waiting for the server (SGLang's polls for up to two minutes) gives up
    when the HTTP server's shutdown reaches the app through the run header middleware,
    so the server goes on to stop the run instead of hanging."""
    import contextlib

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from dmi_sglang.adapters.sglang_v0519 import server

    monkeypatch.setattr(server, "_HTTP_ENDING", threading.Event())
    control, _ = line([(True, "")])
    server_up = threading.Event()  # never set: the server never answers the warm-up
    polled: list[bool] = []
    outcome: list[object] = []

    def sglangs_warmup(server_args: object) -> bool:
        polled.append(server_up.wait(30))
        return True

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        warmup = threading.Thread(target=lambda: outcome.append(
            server._warmup_unless_ending(sglangs_warmup, "sa")))
        warmup.start()
        try:
            yield
        finally:
            warmup.join()

    app = FastAPI(lifespan=lifespan)
    server.mount(app, control)
    try:
        with TestClient(app) as client:
            assert client.get("/nothing").headers[server.RUN_HEADER] == "run-s"
            assert not server._HTTP_ENDING.is_set()
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 5
        assert outcome == [False]
        assert polled == []  # abandoned, still waiting
    finally:
        server_up.set()


def test_a_cancelled_lifespan_ends_at_once_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uvicorn's forced exit (a second Ctrl-C) and SGLang's SIGTERM path end the lifespan
    by cancelling it while it waits for the shutdown message: the warm-up gives up then
    as well, so the lifespan's join of it returns at once."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from fastapi import FastAPI

    from dmi_sglang.adapters.sglang_v0519 import server

    monkeypatch.setattr(server, "_HTTP_ENDING", threading.Event())
    server_up = threading.Event()
    outcome: list[object] = []
    joined: list[float] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        warmup = threading.Thread(target=lambda: outcome.append(
            server._warmup_unless_ending(lambda sa: server_up.wait(30), "sa")))
        warmup.start()
        try:
            yield
        finally:
            t0 = time.monotonic()
            warmup.join()
            joined.append(time.monotonic() - t0)

    app = FastAPI(lifespan=lifespan)
    control = SimpleNamespace(run_id="run-s", last_state="capturing")  # no HTTP here
    mounted = server._RunHeader(app, control)  # type: ignore[arg-type]
    messages: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    sent: list[str] = []

    async def send(message: dict[str, str]) -> None:
        sent.append(message["type"])

    async def lifetime() -> None:
        task = asyncio.create_task(mounted({"type": "lifespan", "state": {}},
                                           messages.get, send))
        await messages.put({"type": "lifespan.startup"})
        while "lifespan.startup.complete" not in sent:
            await asyncio.sleep(0.01)
        task.cancel()  # as asyncio.run does with a task still running at the loop's end
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(lifetime())
        assert server._HTTP_ENDING.is_set()
        assert outcome == [False]
        assert joined[0] < 5
    finally:
        server_up.set()


def test_a_given_up_warmup_cannot_kill_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's warm-up kills the server's processes when its polls found no server; once
    the warm-up was given up at a shutdown (the run's stop is under way), that kill is
    skipped; every other caller's goes through."""
    from dmi_sglang.adapters.sglang_v0519 import server

    monkeypatch.setattr(server, "_HTTP_ENDING", threading.Event())
    monkeypatch.setattr(server, "_ABANDONED", set())
    polls_failed = threading.Event()
    kills: list[str] = []

    def sglangs_warmup(server_args: object) -> bool:  # its polls, then its kill
        polls_failed.wait(30)
        server.around_kill_process_tree(kills.append, "from the warm-up")
        return False

    given_up: list[object] = []
    caller = threading.Thread(target=lambda: given_up.append(
        server._warmup_unless_ending(sglangs_warmup, "sa")))
    caller.start()
    server._HTTP_ENDING.set()
    caller.join(5)
    assert given_up == [False]
    (worker,) = server._ABANDONED
    polls_failed.set()
    worker.join(5)
    assert kills == []
    server.around_kill_process_tree(kills.append, "from SGLang's own exit")
    assert kills == ["from SGLang's own exit"]


def test_each_launch_starts_with_its_http_server_not_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from dmi_sglang.adapters.sglang_v0519 import server
    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import SERVER_MARK

    monkeypatch.setattr(server, "_HTTP_ENDING", threading.Event())
    monkeypatch.delenv("SGLANG_RUST_SERVER", raising=False)
    monkeypatch.setenv(SERVER_MARK, "")
    server._HTTP_ENDING.set()  # an earlier server of this process ended
    server.before_launch_server(SimpleNamespace(tokenizer_worker_num=1,
                                                detokenizer_worker_num=1))
    assert not server._HTTP_ENDING.is_set()


@pytest.mark.parametrize(("attrs_", "env", "words"), [
    ({"tokenizer_worker_num": 2}, {}, "--tokenizer-worker-num 2"),
    ({"detokenizer_worker_num": 3}, {}, "--detokenizer-worker-num 3"),
    ({}, {"SGLANG_RUST_SERVER": "1"}, "SGLANG_RUST_SERVER"),
], ids=["tokenizer-workers", "detokenizer-workers", "rust-server"])
def test_server_modes_the_capture_cannot_follow_are_refused_before_any_process(
        attrs_, env, words, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from dmi_sglang.adapters.sglang_v0519 import server
    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import SERVER_MARK
    from dmi_sglang.errors import UnsupportedConfigurationError

    monkeypatch.delenv(SERVER_MARK, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = SimpleNamespace(**{"tokenizer_worker_num": 1, "detokenizer_worker_num": 1,
                              **attrs_})
    with pytest.raises(UnsupportedConfigurationError, match=words):
        server.before_launch_server(args)
    assert SERVER_MARK not in os.environ


_SIGINT_PROBE = """
import functools, signal, sys
from dmi_sglang.adapters.sglang_v0519 import runtime_hooks, server
which = sys.argv[1]
if which == "detokenizer":
    got = functools.partial(server._without_sigint, lambda: signal.getsignal(signal.SIGINT))()
else:
    runtime_hooks._leave_interrupts_to_the_main_process()
    got = signal.getsignal(signal.SIGINT)
print("IGNORED" if got is signal.SIG_IGN else f"NOT IGNORED: {got!r}")
"""


@pytest.mark.parametrize("process", ["detokenizer", "scheduler"])
def test_a_servers_children_ignore_sigint(process: str) -> None:
    """A terminal's Ctrl-C reaches the whole process group: the detokenizer (wrapped
    target) and a monitoring scheduler (after attach) ignore it, so the main process can
    stop the run first."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SIGINT_PROBE, process], text=True,
                         capture_output=True, timeout=120, check=False)
    assert out.stdout.strip().endswith("IGNORED"), out.stdout + out.stderr
    assert "NOT" not in out.stdout


def test_errors_of_the_captures_own_work_inside_the_forward_are_capture_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit (here: a KeyError in planning) or a capture point (here: the copy fails)
    that fails inside SGLang's forward raises CaptureError, which a server's scheduler
    contains; the cause is kept."""
    from types import SimpleNamespace

    import torch

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks
    from dmi_sglang.adapters.transport._capturer import Capturer
    from dmi_sglang.errors import CaptureError

    def broken(_layout: object) -> None:
        raise KeyError("rid-7")

    mon = SimpleNamespace(in_forward=lambda: True, unfinished=frozenset(),
                          commit_eager=broken, add_host_seconds=lambda s: None)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "layout_from_forward_batch", lambda fb, **kw: "layout")
    with pytest.raises(CaptureError, match=r"the eager commit: KeyError\('rid-7'\)") as info:
        runtime_hooks.after_eager_load_batch(None, SimpleNamespace(), SimpleNamespace())
    assert isinstance(info.value.__cause__, KeyError)

    def no_memory(_key: object, _tensor: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    capturer = Capturer([("resid_pre", 0)], no_memory)
    with pytest.raises(CaptureError, match=r"capture of resid_pre@0 failed: .*out of memory"):
        capturer.capture("resid_pre", 0, torch.zeros(2, 4))


def test_the_hooked_server_functions_take_the_arguments_the_hooks_expect() -> None:
    """SGLang 0.5.19's source (its http_server module does not import without a GPU
    stack): ``launch_server(server_args, init_tokenizer_manager_func,
    run_scheduler_process_func, run_detokenizer_process_func, execute_warmup_func,
    ...)`` (the detokenizer target at position 2 after server_args, the warm-up at 3, as
    ``before_launch_server`` assumes; the warm-up takes server_args) and
    ``_setup_and_run_http_server(server_args, tokenizer_manager, template_manager,
    port_args, ...)`` (as ``around_http_server`` takes them)."""
    import ast
    from pathlib import Path

    import sglang

    source = Path(sglang.__file__).parent / "srt" / "entrypoints" / "http_server.py"
    functions = {node.name: [a.arg for a in node.args.args]
                 for node in ast.parse(source.read_text()).body
                 if isinstance(node, ast.FunctionDef)}
    assert functions["launch_server"][:5] == [
        "server_args", "init_tokenizer_manager_func", "run_scheduler_process_func",
        "run_detokenizer_process_func", "execute_warmup_func"]
    assert functions["_execute_server_warmup"] == ["server_args"]
    # what the warm-up wrapper relies on: a False warm-up ends SGLang's warm-up thread
    # before it marks the server ready; the warm-up's kill is http_server's own name
    text = source.read_text()
    assert "if not execute_warmup_func(server_args):\n            return" in text
    assert "kill_process_tree(os.getpid())" in ast.get_source_segment(text, next(
        node for node in ast.parse(text).body
        if isinstance(node, ast.FunctionDef) and node.name == "_execute_server_warmup"))
    assert functions["_setup_and_run_http_server"][:4] == [
        "server_args", "tokenizer_manager", "template_manager", "port_args"]


def test_the_idle_hook_reports_finished_requests_at_most_every_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang calls ``on_idle`` in a loop while it has no batch: the hook lets the
    forward stream finish, then asks the monitor to settle, at most every IDLE_EVERY_S."""
    from types import SimpleNamespace

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    calls: list[str] = []
    mon = SimpleNamespace(active=True, idle=lambda: calls.append("idle"))
    stream = SimpleNamespace(synchronize=lambda: calls.append("sync"))
    runner = SimpleNamespace(forward_stream=stream, _dmi_monitor=mon)
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    monkeypatch.setattr(runtime_hooks, "_last_idle", 0.0)
    runtime_hooks.after_scheduler_on_idle(None, scheduler)
    runtime_hooks.after_scheduler_on_idle(None, scheduler)  # too soon: nothing
    assert calls == ["sync", "idle"]
    time.sleep(runtime_hooks.IDLE_EVERY_S)
    runtime_hooks.after_scheduler_on_idle(None, scheduler)
    assert calls == ["sync", "idle"] * 2
    monkeypatch.setattr(runtime_hooks, "_FAILED", "store down")
    time.sleep(runtime_hooks.IDLE_EVERY_S)
    runtime_hooks.after_scheduler_on_idle(None, scheduler)  # a failed capture: left alone
    assert calls == ["sync", "idle"] * 2


def test_with_sleep_on_idle_the_idle_commit_runs_before_the_sleep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--sleep-on-idle``: SGLang's ``on_idle`` ends in a sleep of up to a second; the
    hook before it settles finished requests first (without the option it does nothing:
    the hook after ``on_idle`` follows at once)."""
    from types import SimpleNamespace

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    calls: list[str] = []
    mon = SimpleNamespace(active=True, idle=lambda: calls.append("idle"))
    runner = SimpleNamespace(_dmi_monitor=mon)
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    monkeypatch.setattr(runtime_hooks, "_last_idle", 0.0)
    awake = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner), idle_sleeper=None)
    runtime_hooks.before_scheduler_sleep(awake)
    assert calls == []
    sleepy = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner),
                             idle_sleeper=object())
    runtime_hooks.before_scheduler_sleep(sleepy)
    assert calls == ["idle"]
    runtime_hooks.after_scheduler_on_idle(None, sleepy)  # woken by a request, which ends
    runtime_hooks.before_scheduler_sleep(sleepy)  # at once: still settled before sleeping
    assert calls == ["idle"] * 3
    targets = {(t, kind) for t, kind, _ in runtime_hooks.HOOKS}
    assert ("sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle", "BEFORE") in targets
    import sglang

    source = (Path(sglang.__file__).parent / "srt" / "managers" / "scheduler.py").read_text()
    assert "if self.idle_sleeper is not None:" in source  # the attribute the hook reads


@pytest.mark.parametrize("in_server", [False, True])
def test_an_idle_failure_never_kills_an_engine_and_ends_a_servers_capture(
        monkeypatch: pytest.MonkeyPatch, in_server: bool) -> None:
    from types import SimpleNamespace

    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    def boom() -> None:
        raise RuntimeError("drain gone")

    mon = SimpleNamespace(active=True, idle=boom, run=SimpleNamespace(run_id="r"))
    runner = SimpleNamespace(_dmi_monitor=mon)
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))
    ended: list[Any] = []
    monkeypatch.setattr(runtime_hooks, "_MONITOR", mon)
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    monkeypatch.setattr(runtime_hooks, "_last_idle", 0.0)
    monkeypatch.setattr(runtime_hooks, "_serve_on_or_raise",
                        lambda r, m, exc: ended.append((r, m, exc)))
    if in_server:
        monkeypatch.setenv(runtime_hooks.SERVER_MARK, "1")
    else:
        monkeypatch.delenv(runtime_hooks.SERVER_MARK, raising=False)
    runtime_hooks.after_scheduler_on_idle(None, scheduler)  # never raises
    assert [(r, str(e)) for r, _, e in ended] == ([(runner, "drain gone")] if in_server
                                                  else [])


def test_the_read_address_stays_bindable_under_a_long_tmpdir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``ipc://`` path over about 107 bytes cannot be bound: under a long TMPDIR the
    store channels' directory goes under /tmp (private to this user either way)."""
    import shutil
    import stat
    import tempfile

    from dmi_sglang.adapters.sglang_v0519 import server

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    address = server._new_read_address()
    path = address.removeprefix("ipc://")
    try:
        assert len(path) <= 100
        assert os.path.basename(os.path.dirname(path)).startswith("dmi-reads-")
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert list(deep.iterdir()) == []
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_a_stop_at_the_end_that_fails_makes_the_servers_exit_say_so(tmp_path,
                                                                    monkeypatch) -> None:
    """Found in review: after SIGINT the server exited the same way whether its stop made
    the run durable or not; now a failed stop is a non-zero exit status."""
    from dmi_sglang.adapters.sglang_v0519.server import EXIT_NOT_DURABLE

    (out, _), fake = _around(tmp_path, monkeypatch,
                             [(True, ""), (False, "the store failed")], lambda: "served")
    assert isinstance(out, SystemExit)
    assert out.code == EXIT_NOT_DURABLE
    assert [m for m, _ in fake.calls] == ["dmi_assert_active", "dmi_stop_monitoring"]
    (out, _), _fake = _around(tmp_path, monkeypatch, [(True, ""), (True, "")],
                              lambda: "served")
    assert out == "served"  # durable: SGLang's own exit
