"""On the GPU: ``dmi-sglang serve`` as a user runs it, driven over HTTP.

Run on the H200 machine with the GPU kit::

    python -m pytest tests/gpu/test_serving.py -m gpu -q -s

One server (``--api-key``, decode CUDA graphs, a generated Qwen3 checkpoint) serves
native ``/generate`` (plain and streamed) and OpenAI ``/v1/completions`` and
``/v1/chat/completions`` requests, some asking to be captured through
``custom_params``, one streamed and cancelled by its client (``/abort_request``); then
``POST /dmi/stop``,
more requests (served, not captured), and SIGINT. A second server is stopped by SIGTERM
(SGLang's drain, then its shutdown request to the schedulers), a third by SIGINT to its
whole process group (a terminal's Ctrl-C) with no stop before. Checks: every response
names the run; the endpoints refuse a request without the key; tokens of a captured
request equal those of the same prompt uncaptured; each captured request is complete in
the store, the cancelled one is not, and nothing else is stored; every run ends committed.
A JSON summary (timings included) goes to ``$DMI_EVIDENCE_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import Evidence  # type: ignore[import-not-found]

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KEY = "serve-test-key"
PROMPT = "w1 w2 w3 w4 w5"
NEW_TOKENS = 8
START_S = 600
EXIT_S = 90  # SGLang's SIGTERM drain polls every 5 s, then waits 15 s for the schedulers
STACKS_SIGNAL = signal.SIGUSR1
"""On this signal every Python process of a test's server writes its threads' stacks to
``NAME-stacks/stacks-PID.txt`` in the work directory (a ``sitecustomize`` the test puts
first on the server's ``PYTHONPATH``; it then loads the environment's own
``sitecustomize``, if any): how a server that does not exit after its stop signal is
diagnosed."""
STACKS_HOOK = """\
import faulthandler, importlib, os, signal, sys
_here = os.path.dirname(os.path.abspath(__file__))
_out = open(os.path.join(_here, f"stacks-{os.getpid()}.txt"), "w")  # kept open: faulthandler
faulthandler.register(signal.Signals(SIGNAL), file=_out, all_threads=True)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["sitecustomize"]
try:
    importlib.import_module("sitecustomize")  # the one this hook hid, if any
except ImportError:
    pass
""".replace("SIGNAL", str(int(STACKS_SIGNAL)))
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w7{% endif %}")


class Server:
    """One ``dmi-sglang serve`` child, its log, and HTTP calls to it."""

    def __init__(self, workdir: Path, name: str, model: Path, run_id: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.run_id = run_id
        self.log = workdir / f"{name}.log"
        template = workdir / "chat.jinja"
        template.write_text(CHAT_TEMPLATE)
        argv = [sys.executable, "-m", "dmi_sglang", "serve", "--model-path", str(model),
                "--run-id", run_id, "--db", f"chdb://{workdir / 'store'}",
                "--port", str(self.port), "--host", "127.0.0.1", "--api-key", KEY,
                "--attention-backend", "triton", "--sampling-backend", "pytorch",
                "--mem-fraction-static", "0.3", "--cuda-graph-max-bs-decode", "16",
                "--chat-template", str(template), "--log-level", "warning"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMX_")}
        self.stacks = workdir / f"{name}-stacks"
        self.stacks.mkdir(exist_ok=True)
        (self.stacks / "sitecustomize.py").write_text(STACKS_HOOK)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.stacks), *filter(None, [env.get("PYTHONPATH")])])
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # its own process group
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if self.call("GET", "/v1/models")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > START_S:
                pytest.fail(f"server not up after {START_S} s: {self.tail()}")
            time.sleep(2)
        self.start_s = time.monotonic() - t0
        self.model_name = self.call("GET", "/v1/models")[1]["data"][0]["id"]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
             key: str | None = KEY) -> tuple[int, Any, dict[str, str]]:
        """``(status, parsed JSON or text, headers)``."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                status, raw, headers = resp.status, resp.read().decode(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            status, raw, headers = exc.code, exc.read().decode(), dict(exc.headers)
        try:
            return status, json.loads(raw), headers
        except json.JSONDecodeError:
            return status, raw, headers

    def fetch(self, path: str) -> tuple[int, bytes]:
        """``(status, body bytes)`` of a GET with the key."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def committed_listing(self, rid: str, wait_s: float = 30) -> dict[str, Any]:
        """A request's listing once it reads complete (per-request commit: while the run
        still captures), waiting up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            status, out, _ = self.call("GET", f"/dmi/runs/{self.run_id}/requests/{rid}")
            if status == 200 and out["complete"]:
                return out  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                pytest.fail(f"{rid} not complete over HTTP after {wait_s} s: {out}")
            time.sleep(0.5)

    def generate(self, rid: str, *, capture: bool | None, stream: bool = False,
                 prompt: str = PROMPT) -> tuple[list[int], dict[str, str]]:
        params: dict[str, Any] = {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                  "ignore_eos": True}
        if capture is not None:
            params["custom_params"] = {"dmi_capture": capture}
        status, out, headers = self.call("POST", "/generate", {
            "text": prompt, "rid": rid, "sampling_params": params, "stream": stream})
        assert status == 200, out
        if stream:  # server-sent events: the last data line holds every output id
            events = [json.loads(line.removeprefix("data: ")) for line in out.splitlines()
                      if line.startswith("data: {")]
            assert len(events) > 1
            out = events[-1]
        assert out["meta_info"]["id"] == rid
        return list(out["output_ids"]), headers

    def cancel_stream(self, rid: str) -> None:
        """A captured streamed request cancelled after two events with SGLang's abort
        endpoint while its stream is open (SGLang 0.5.19 forgets a request whose client
        went away, so an abort after the close does nothing); the stream ends with an
        ``abort`` finish, and its capture must never read as complete."""
        body = {"text": PROMPT, "rid": rid, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 3000, "ignore_eos": True,
            "custom_params": {"dmi_capture": True}}}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/generate", method="POST",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        events, last, aborted = 0, {}, False
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                if line.strip() == b"data: [DONE]":
                    break
                if line.startswith(b"data: {"):
                    events += 1
                    last = json.loads(line[len(b"data: "):])
                if events == 2 and not aborted:
                    status, out, _ = self.call("POST", "/abort_request", {"rid": rid})
                    assert status == 200, out
                    aborted = True
        assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
        assert events < 3000

    def stop_with(self, sig: int, *, group: bool = False) -> float:
        """Send ``sig`` to the server (``group``: to its whole process group, as a
        terminal's Ctrl-C does) and wait for it to exit."""
        t0 = time.monotonic()
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, STACKS_SIGNAL)  # where each process is stuck
            time.sleep(3)
            os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # reported below either way
                self.proc.wait(30)
            stacks = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')}"
                               for f in sorted(self.stacks.glob("stacks-*.txt"))
                               if f.stat().st_size)
            pytest.fail(f"server still running {EXIT_S} s after signal {sig}; the end of "
                        f"its log:\n{self.tail()}\nits processes' stacks:\n{stacks}")
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve")


def _complete(store: Path, run_id: str) -> dict[str, Any]:
    """The run's status, and per stored request its missing captures and resid_pre rows."""
    from dmi_sglang import open_store

    captures = open_store(f"chdb://{store}")
    with captures.session():
        run = captures.require_run(run_id)
        out: dict[str, Any] = {"status": run.status.value, "requests": {}}
        for summary in captures.requests(run_id):
            handle = captures.handle(run_id, summary.request_id)
            missing = list(handle.missing)
            out["requests"][summary.request_id] = {
                "missing": missing,
                "resid_pre_rows": None if missing else [
                    int(handle.get("resid_pre", layer).shape[0]) for layer in range(4)],
            }
    return out


def test_serve_captures_what_requests_ask_and_stops_durably(workdir: Path, checkpoint: Path,
                                                           evidence: Evidence) -> None:
    server = Server(workdir, "serve-sigint", checkpoint, "serve-sigint")
    report: dict[str, Any] = {"start_s": round(server.start_s, 1)}
    try:
        captured_ids, headers = server.generate("cap-native", capture=True)
        assert headers.get("x-dmi-run-id") == server.run_id
        plain_ids, _ = server.generate("plain-native", capture=None)
        assert plain_ids == captured_ids  # capture changes no token
        streamed_ids, headers = server.generate("cap-stream", capture=True, stream=True)
        assert streamed_ids == captured_ids
        assert headers.get("x-dmi-run-id") == server.run_id
        status, out, headers = server.call("POST", "/v1/completions", {
            "model": server.model_name, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True, "rid": "cap-openai",
            "custom_params": {"dmi_capture": True}})
        assert status == 200, out
        assert out["id"] == "cap-openai"
        assert headers.get("x-dmi-run-id") == server.run_id
        status, out, _ = server.call("POST", "/v1/chat/completions", {
            "model": server.model_name, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "rid": "cap-chat", "custom_params": {"dmi_capture": True}})
        assert status == 200, out
        assert out["id"] == "cap-chat"

        from openai import OpenAI  # the client users drive OpenAI-compatible servers with

        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY)
        chat = client.chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": PROMPT}],
            max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"custom_params": {"dmi_capture": True}, "rid": "cap-openai-client",
                        "ignore_eos": True})
        assert chat.id == "cap-openai-client"
        pieces = list(client.completions.create(
            model=server.model_name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
            stream=True, extra_body={"custom_params": {"dmi_capture": True},
                                     "rid": "cap-openai-stream", "ignore_eos": True}))
        assert len(pieces) > 1
        assert {p.id for p in pieces} == {"cap-openai-stream"}

        server.cancel_stream("cancel-stream")

        # per-request commit and readback over HTTP while the run still captures
        t0 = time.monotonic()
        listing = server.committed_listing("cap-native")
        report["committed_listing_s"] = round(time.monotonic() - t0, 3)
        assert listing["run_status"] == "running"
        status, body = server.fetch(f"/dmi/runs/{server.run_id}/requests/cap-native/safetensors")
        assert status == 200, body[:300]
        from safetensors.torch import load as load_safetensors

        over_http = load_safetensors(body)
        assert set(over_http) == {t["name"] for t in listing["tensors"]}
        report["http_tensors"] = {t["name"]: t["shape"] for t in listing["tensors"]}
        runs = server.call("GET", "/dmi/runs")[1]["runs"]
        assert server.run_id in [r["run_id"] for r in runs]
        listed = server.call("GET", f"/dmi/runs/{server.run_id}/requests")[1]["requests"]
        assert {r["request_id"] for r in listed} >= {"cap-native", "cap-stream"}
        base = f"/dmi/runs/{server.run_id}/requests"
        # aborted: never served as complete (under :last it may have stored nothing: 404)
        assert server.fetch(f"{base}/cancel-stream/safetensors")[0] in (404, 409)
        assert server.fetch(f"{base}/nobody")[0] == 404
        assert server.call("GET", f"{base}/cap-native", key=None)[0] == 401
        assert headers.get("x-dmi-capture") == "capturing"

        assert server.call("GET", "/dmi/status", key=None)[0] == 401
        assert server.call("POST", "/dmi/stop", key="wrong")[0] == 401
        status, out, _ = server.call("GET", "/dmi/status")
        assert (status, out["state"], out["run_id"]) == (200, "capturing", server.run_id)
        t0 = time.monotonic()
        status, out, _ = server.call("POST", "/dmi/stop")
        report["stop_endpoint_s"] = round(time.monotonic() - t0, 3)
        assert (status, out["state"]) == (200, "stopped"), out
        assert server.call("GET", "/dmi/status")[1]["state"] == "stopped"

        after_ids, _ = server.generate("after-stop", capture=True)  # served, not captured
        assert after_ids == captured_ids
        after_stream, _ = server.generate("after-stop-stream", capture=True, stream=True)
        assert after_stream == captured_ids
    finally:
        report["sigint_exit_s"] = round(server.stop_with(signal.SIGINT), 1)
        report["log_tail"] = server.tail()[-1500:]
        evidence("serve-sigint", report)
    stored = _complete(workdir / "store", server.run_id)
    report["store"] = stored
    evidence("serve-sigint", report)
    assert stored["status"] == "committed"
    cancelled = stored["requests"].pop("cancel-stream", None)  # under :last: maybe no row
    assert cancelled is None or "not committed" in cancelled["missing"][0], cancelled
    assert set(stored["requests"]) == {"cap-native", "cap-stream", "cap-openai", "cap-chat",
                                       "cap-openai-client", "cap-openai-stream"}
    for rid, got in stored["requests"].items():
        assert got["missing"] == [], (rid, got)
        assert got["resid_pre_rows"] == [1, 1, 1, 1], (rid, got)  # serve's default: last
    from dmi_sglang import open_store

    direct = open_store(f"chdb://{workdir / 'store'}").handle(server.run_id, "cap-native")
    for t in listing["tensors"]:  # what HTTP returned while running = the store after stop
        layer = None if t["layer"] < 0 else t["layer"]
        assert torch.equal(over_http[t["name"]], direct.get(t["hook"], layer)), t["name"]


def _one_request_then_signal(workdir: Path, checkpoint: Path, evidence: Evidence, name: str,
                             sig: int, *, group: bool = False) -> None:
    """A server that captures one request, then gets ``sig`` (``group``: its whole
    process group); its run must end committed with that request complete."""
    server = Server(workdir, name, checkpoint, name)
    report: dict[str, Any] = {"start_s": round(server.start_s, 1)}
    try:
        server.generate(f"cap-{name}", capture=True)
        server.generate(f"plain-{name}", capture=False)
    finally:
        report["exit_after_signal_s"] = round(server.stop_with(sig, group=group), 1)
        report["log_tail"] = server.tail()[-1500:]
    stored = _complete(workdir / "store", server.run_id)
    report["store"] = stored
    evidence(name, report)
    assert stored["status"] == "committed"
    assert set(stored["requests"]) == {f"cap-{name}"}
    assert stored["requests"][f"cap-{name}"]["missing"] == []


def test_sigterm_makes_the_run_durable(workdir: Path, checkpoint: Path,
                                       evidence: Evidence) -> None:
    """SIGTERM: SGLang drains, then asks its schedulers to shut down; the run ends
    committed and the server exits."""
    _one_request_then_signal(workdir, checkpoint, evidence, "serve-sigterm", signal.SIGTERM)


def test_ctrl_c_to_the_process_group_makes_the_run_durable(workdir: Path, checkpoint: Path,
                                                          evidence: Evidence) -> None:
    """SIGINT to every process of the server (a terminal's Ctrl-C), with no stop before:
    the run still ends committed with the captured request complete."""
    _one_request_then_signal(workdir, checkpoint, evidence, "serve-ctrl-c", signal.SIGINT,
                             group=True)
