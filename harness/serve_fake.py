"""The dry run's stand-ins for ``python -m harness serve-load`` (``--dry-run``): a fake of
SGLang 0.5.19's HTTP server and of dmi-sglang's endpoints, and bench_serving without the
``datasets`` package.

``python -m harness.serve_fake fake-server ARGS`` is started with the very argument lists
the real servers would get (``-m sglang.launch_server ...`` or ``-m dmi_sglang serve ...``):
it answers ``/v1/models``, ``/generate`` (plain and streamed), ``/abort_request`` and, when
monitored, ``/dmi/status``, ``/dmi/stop`` and ``/dmi/runs/...``, behaving as SGLang does
where the benchmark's checks depend on it (a streamed request whose client went away runs
on, and an abort then does nothing; an abort while the stream is open ends it with an
``abort`` finish). A monitored fake writes its captures into a real embedded store at its
stop, through the library's sink, so the benchmark's direct read is the real one.
``python -m harness.serve_fake bench-shim ARGS`` runs ``sglang.bench_serving`` with a
stub ``datasets`` module where that package is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import signal
import sys
import threading
import time
import types
import urllib.parse
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.results import Json
from harness.serve_load import HOST, first_id

if TYPE_CHECKING:
    import torch

FAKE_LAYERS = 2
"""Layers of ``resid_pre`` the dry run's fake server captures."""
FAKE_HIDDEN = 8
FAKE_TOKEN_DELAY_S = 0.001
"""Seconds between the fake server's streamed tokens."""
FAKE_FAULT_ENV = "SERVE_LOAD_FAKE_FAULT"
"""Faults a monitored fake server injects, comma-separated (tests prove the checks see
them): ``tokens`` (other output ids), ``readback`` (served tensors off by one)."""


def fake_output_ids(input_ids: Sequence[int], n: int, vocab: int) -> list[int]:
    """The fake server's deterministic "generation": a function of the prompt alone."""
    low = first_id()
    seed = sum(input_ids) * 31 + len(input_ids)
    return [low + (seed + 7 * k) % (vocab - low) for k in range(n)]


def fake_tensor(rid: str, layer: int, rows: int) -> torch.Tensor:
    """The fake capture of one request's layer: fixed by the request id."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{layer}".encode()))
    return torch.randn(rows, FAKE_HIDDEN, generator=gen)


@dataclass
class FakeRequest:
    """One request the fake server served: its lengths and whether it finished."""

    rid: str
    prompt_tokens: int
    completion_tokens: int
    finished: bool


class FakeState:
    """The fake server's run: what it captured, and its stop (which writes a real
    embedded store, as the real server's stop makes the run durable)."""

    RESID = "blocks.hook_resid_pre"

    def __init__(self, args: argparse.Namespace, monitored: bool, vocab: int) -> None:
        self.args, self.monitored, self.vocab = args, monitored, vocab
        self.lock = threading.Lock()
        self.requests: dict[str, FakeRequest] = {}
        self.streaming: set[str] = set()
        """Ids of the streams still open (SGLang still knows their requests)."""
        self.aborted: set[str] = set()
        """Open streams ``/abort_request`` named (by id prefix), ended at their next event."""
        self.state = "capturing"
        self.stop_s = 0.0
        self.faults = set(os.environ.get(FAKE_FAULT_ENV, "").split(","))

    def served(self, req: FakeRequest) -> None:
        """Record a request (captured: every request, ``--request-sample 1``)."""
        if self.monitored and self.state == "capturing":
            with self.lock:
                self.requests[req.rid] = req

    def abort(self, prefix: str) -> None:
        """Abort the open streams whose id starts with ``prefix``, as SGLang 0.5.19 does:
        a request whose client already went away is unknown to its tokenizer manager,
        so naming it changes nothing (it runs on to its end)."""
        with self.lock:  # SGLang forwards the abort only for an id it knows
            if prefix in self.streaming:
                self.aborted |= {rid for rid in self.streaming if rid.startswith(prefix)}

    def rows(self, req: FakeRequest) -> int:
        """Positions stored: every forwarded one (the last token is never forwarded)."""
        return max(req.prompt_tokens + req.completion_tokens - 1, 0)

    def tensors(self, req: FakeRequest) -> dict[str, torch.Tensor]:
        """The request's captured tensors by name."""
        return {f"resid_pre.{layer}": fake_tensor(req.rid, layer, self.rows(req))
                for layer in range(FAKE_LAYERS)}

    def stop(self) -> None:
        """Write every capture, commit the run (cancelled requests uncommitted)."""
        with self.lock:
            if self.state != "capturing" or not self.monitored:
                return
            self.state = "stopping"
            t0 = time.monotonic()
            self._write()
            self.state, self.stop_s = "stopped", time.monotonic() - t0

    def _write(self) -> None:
        import attrs

        from dmi_sglang.adapters.clickhouse import ClickHouseSink
        from dmi_sglang.columns import RecordBatch
        from dmi_sglang.domain.records import (
            CaptureRecord,
            RequestManifest,
            RunInfo,
            RunStatus,
            storable_request_id,
        )
        from dmi_sglang.domain.store_config import StoreConfig, StoreKind

        run_id = self.args.run_id
        sink = ClickHouseSink(StoreConfig(kind=StoreKind.EMBEDDED,
                                          path=self.args.db.removeprefix("chdb://"),
                                          flush_timeout_us=20_000))
        now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        run = RunInfo(run_id, self.args.model_path, (),
                      tuple((self.RESID, layer) for layer in range(FAKE_LAYERS)), now)
        sink.start_run(run)
        records = [CaptureRecord(
            model_id=run_id, request_id=storable_request_id(req.rid), act_name=self.RESID,
            layer_no=layer, shard_rank=0, start_token_idx=0, end_token_idx=self.rows(req),
            dtype="torch.float32", shape=(self.rows(req), FAKE_HIDDEN),
            payload=fake_tensor(req.rid, layer, self.rows(req)).numpy().tobytes(), seq=1)
            for req in self.requests.values() if self.rows(req)
            for layer in range(FAKE_LAYERS)]
        if records:
            sink.put(RecordBatch.from_records(records))
        sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED, stopped_at=now),
                        [RequestManifest(run_id, storable_request_id(r.rid), r.prompt_tokens,
                                         r.completion_tokens, committed=r.finished)
                         for r in self.requests.values()])
        sink.close()

    def listing(self, rid: str) -> Json | None:
        """The ``GET /dmi/runs/RUN/requests/ID`` answer, or None for an unknown id."""
        req = self.requests.get(rid)
        if req is None:
            return None
        complete = req.finished  # committed when it finished, as the real server does
        rows = self.rows(req)
        return {"run_id": self.args.run_id, "request_id": rid, "complete": complete,
                "missing": [] if complete else ["not committed"],
                "prompt_tokens": req.prompt_tokens, "completion_tokens": req.completion_tokens,
                "tensors": [{"name": f"resid_pre.{layer}", "hook": "resid_pre", "layer": layer,
                             "dtype": "float32", "shape": [rows, FAKE_HIDDEN],
                             "positions": [0, rows, 1]} for layer in range(FAKE_LAYERS)]}


class FakeHandler(BaseHTTPRequestHandler):
    """SGLang's HTTP API as far as this benchmark uses it, and dmi-sglang's endpoints on a
    monitored fake."""

    state: FakeState  # set on the subclass the fake server builds

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: no line per request."""

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.state.monitored:
            self.send_header("X-DMI-Run-Id", self.state.args.run_id)
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        key = self.state.args.api_key
        return not key or self.headers.get("Authorization") == f"Bearer {key}" or \
            self.headers.get("X-API-Key") == key

    def do_GET(self) -> None:
        """The GET routes."""
        if not self._authorized():
            self._send(401, {"error": "unauthorized"})
            return
        s, path = self.state, urllib.parse.unquote(self.path.split("?")[0])
        fixed = {"/v1/models": {"object": "list", "data": [{"id": s.args.model_path}]},
                 "/model_info": {"model_path": s.args.model_path,
                                 "tokenizer_path": s.args.model_path},
                 "/server_info": {"internal_states": []}, "/health": {}}
        if path in fixed:
            self._send(200, fixed[path])
        elif s.monitored and path == "/dmi/status":
            self._send(200, {"run_id": s.args.run_id, "store": s.args.db, "state": s.state,
                             "reason": None, "seconds": s.stop_s})
        elif s.monitored and path.startswith(f"/dmi/runs/{s.args.run_id}/requests"):
            self._dmi_requests(path.removeprefix(f"/dmi/runs/{s.args.run_id}/requests"))
        else:
            self._send(404, {"error": f"no route {path}"})

    def _dmi_requests(self, rest: str) -> None:
        s = self.state
        if not rest:
            self._send(200, {"run_id": s.args.run_id, "requests": [  # as the real server
                {"request_id": r, "records": FAKE_LAYERS if s.rows(req) else 0,
                 "bytes": s.rows(req) * 4 * FAKE_HIDDEN * FAKE_LAYERS,
                 "committed": req.finished} for r, req in sorted(s.requests.items())]})
            return
        rid, _, tail = rest.removeprefix("/").partition("/")
        listing = s.listing(rid)
        if listing is None or tail not in ("", "safetensors"):
            self._send(404, {"error": f"no request {rid!r}"})
        elif not tail:
            self._send(200, listing)
        else:
            from safetensors.torch import save

            tensors = s.tensors(s.requests[rid])
            if "readback" in s.faults:
                tensors = {k: v + 1 for k, v in tensors.items()}
            self._send(200, save(tensors), "application/octet-stream")

    def do_POST(self) -> None:
        """``/generate`` (plain and streamed), ``/abort_request`` and ``/dmi/stop``."""
        if not self._authorized():
            self._send(401, {"error": "unauthorized"})
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.state.monitored and self.path == "/dmi/stop":
            self.state.stop()
            self._send(200, {"run_id": self.state.args.run_id, "state": self.state.state,
                             "seconds": self.state.stop_s})
        elif self.path == "/generate":
            self._generate(body)
        elif self.path == "/abort_request":  # as SGLang: every id starting with the one named
            self.state.abort(str(body.get("rid") or ""))
            self._send(200, {})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def _generate(self, body: Json) -> None:
        s = self.state
        ids = [int(i) for i in body.get("input_ids") or []] or \
            [int(w[1:]) + first_id() for w in str(body.get("text", "w0")).split()
             if w[1:].isdigit()]
        params = body.get("sampling_params") or {}
        rid = str(body.get("rid") or f"{zlib.crc32(os.urandom(8)):08x}{time.time_ns()}")
        out = fake_output_ids(ids, int(params.get("max_new_tokens", 16)), s.vocab)
        if "tokens" in s.faults and s.monitored:
            out = out[::-1]
        meta: Json = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": len(out)}
        text = " ".join(f"w{i - first_id()}" for i in out)
        if not body.get("stream"):
            s.served(FakeRequest(rid, len(ids), len(out), finished=True))
            self._send(200, {"text": text, "output_ids": out, "meta_info": meta})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        with s.lock:
            s.streaming.add(rid)
        finished, recorded = True, False
        try:
            for k in range(1, len(out) + 1):
                with s.lock:
                    finished = rid not in s.aborted
                reason = ({"type": "abort", "message": "Aborted"} if not finished else
                          {"type": "length", "length": k} if k == len(out) else None)
                if reason is not None:  # captured before its last event leaves, as in SGLang
                    s.served(FakeRequest(rid, len(ids), len(out), finished=finished))
                    recorded = True
                chunk = {"text": " ".join(text.split()[:k]), "output_ids": out[:k],
                         "meta_info": meta | {"completion_tokens": k, "finish_reason": reason}}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                if not finished:
                    break
                time.sleep(FAKE_TOKEN_DELAY_S)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:  # the client went away: SGLang 0.5.19 runs the request on to its end
            pass
        finally:
            with s.lock:
                s.streaming.discard(rid)
                s.aborted.discard(rid)
        if not recorded:
            s.served(FakeRequest(rid, len(ids), len(out), finished=finished))
        self.close_connection = True


def fake_main(argv: Sequence[str]) -> int:
    """``python -m harness.serve_fake fake-server -m sglang.launch_server|dmi_sglang serve
    ARGS``: serve the fake until SIGINT or SIGTERM (a monitored fake stops its run first)."""
    p = argparse.ArgumentParser(prog="serve_fake fake-server", add_help=False,
                                allow_abbrev=False)
    for flag in ("--model-path", "--host", "--api-key", "--hooks", "--request-sample",
                 "--run-id", "--db"):
        p.add_argument(flag)
    p.add_argument("--port", type=int, required=True)
    args, rest = p.parse_known_args(list(argv))
    monitored = "dmi_sglang" in rest
    if monitored and (not args.db or not args.run_id or args.request_sample != "1"
                      or not args.hooks):
        print("fake-server: a monitored start needs --hooks, --request-sample 1, --run-id "
              "and --db", file=sys.stderr)
        return 2
    vocab = int(json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"])
    state = FakeState(args, monitored, vocab)
    handler = type("Handler", (FakeHandler,), {"state": state})
    server_class = type("FakeHTTPServer", (ThreadingHTTPServer,),
                        {"request_queue_size": 1024, "daemon_threads": True})
    httpd = server_class((args.host or HOST, args.port), handler)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"fake-server: {'monitored' if monitored else 'stock'} on port {args.port}",
          flush=True)
    done.wait()
    state.stop()
    httpd.shutdown()
    print("fake-server: exit", flush=True)
    return 0


def bench_shim(argv: Sequence[str]) -> int:
    """``python -m harness.serve_load bench-shim ARGS``: bench_serving with a stub
    ``datasets`` module where the package is missing (a dry run's machine)."""
    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")

        def load_dataset(*_args: Any, **_kwargs: Any) -> Any:
            msg = "the datasets package is not installed (dry run stub)"
            raise RuntimeError(msg)

        stub.__dict__["load_dataset"] = load_dataset
        sys.modules["datasets"] = stub
    sys.argv = ["sglang.bench_serving", *argv]
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
    return 0




def _module_main(argv: Sequence[str]) -> int:
    """``python -m harness.serve_fake fake-server|bench-shim ARGS`` (the dry run's
    children)."""
    if argv[:1] == ["fake-server"]:
        return fake_main(argv[1:])
    if argv[:1] == ["bench-shim"]:
        return bench_shim(argv[1:])
    print("usage: python -m harness.serve_fake fake-server|bench-shim ARGS "
          "(the command is python -m harness serve-load --dry-run)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_module_main(sys.argv[1:]))
