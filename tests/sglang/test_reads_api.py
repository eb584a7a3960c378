"""The server's read-back endpoints on a FastAPI app as SGLang's server builds it (its
API-key middleware added after the hook mounted them): protection, id checks, the
answers' codes, and a streamed safetensors body equal to the store's rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

from dmi_sglang.app.export import StoreReads
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo
from dmi_sglang.errors import StoreError
from dmi_sglang.testing import MemoryReader, MemorySink

pytestmark = pytest.mark.sglang

RESID = "blocks.hook_resid_pre"
KEY = {"Authorization": "Bearer sekret"}


def _store() -> MemorySink:
    sink = MemorySink()
    sink.start_run(RunInfo("run-1", "/m", (), ((RESID, 0),), "2026-12-02T00:00:00Z"))
    rows = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)
    for rid in ("done", "live"):
        sink.put(RecordBatch.from_records([CaptureRecord(
            "run-1", rid, RESID, 0, 0, 0, 5, "torch.float32", (5, 4),
            rows.numpy().tobytes(), 1)]))
    sink.commit_requests([RequestManifest("run-1", "done", 3, 3, committed=True)])
    return sink


def _client(reads: Any, api_key: str | None = "sekret", admin: str | None = None) -> Any:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.auth import add_api_key_middleware

    from dmi_sglang.adapters.sglang_v0519.reads_api import mount_reads

    app = FastAPI()
    mount_reads(app, reads)
    if api_key is not None or admin is not None:  # as SGLang's server does after the hook
        add_api_key_middleware(app, api_key=api_key, admin_api_key=admin)
    return TestClient(app)


@pytest.mark.parametrize("api_key", [None, "sekret"])
def test_with_an_admin_key_only_the_admin_reads_every_users_captures(
        api_key: str | None) -> None:
    """The reads serve every request's captures (``token_ids`` are the prompts): with
    ``--admin-api-key`` they need it, as the stop does; the plain API key (or none, when
    only the admin key is set) is refused."""
    client = _client(StoreReads(lambda: MemoryReader(_store())), api_key=api_key,
                     admin="admin-sekret")
    for path in ("/dmi/runs", "/dmi/runs/run-1/requests", "/dmi/runs/run-1/requests/done",
                 "/dmi/runs/run-1/requests/done/safetensors", "/dmi/runs/x/y/z/w"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=KEY).status_code == 401, path
        answered = client.get(path, headers={"Authorization": "Bearer admin-sekret"})
        assert answered.status_code in (200, 404), path
    assert client.get("/dmi/runs", headers={"Authorization": "Bearer admin-sekret"}
                      ).json()["runs"]


def test_the_reads_answer_only_with_the_servers_key() -> None:
    client = _client(StoreReads(lambda: MemoryReader(_store())))
    for path in ("/dmi/runs", "/dmi/runs/run-1/requests", "/dmi/runs/run-1/requests/done",
                 "/dmi/runs/run-1/requests/done/safetensors"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get(path, headers=KEY).status_code == 200, path


def test_listings_and_a_streamed_export_equal_the_store() -> None:
    sink = _store()
    client = _client(StoreReads(lambda: MemoryReader(sink)))
    runs = client.get("/dmi/runs", headers=KEY).json()["runs"]
    assert [(r["run_id"], r["status"]) for r in runs] == [("run-1", "running")]
    requests = client.get("/dmi/runs/run-1/requests", headers=KEY).json()
    assert [(r["request_id"], r["committed"]) for r in requests["requests"]] == [
        ("done", True), ("live", False)]
    listing = client.get("/dmi/runs/run-1/requests/done", headers=KEY).json()
    assert listing["complete"] is True
    assert listing["tensors"] == [{"name": f"{RESID}.0", "hook": RESID, "layer": 0,
                                   "dtype": "float32", "shape": [5, 4],
                                   "positions": [0, 5, 1]}]
    answer = client.get("/dmi/runs/run-1/requests/done/safetensors", headers=KEY)
    assert answer.status_code == 200
    assert int(answer.headers["content-length"]) == len(answer.content)
    assert 'filename="run-1-done.safetensors"' in answer.headers["content-disposition"]
    got = load_safetensors(answer.content)[f"{RESID}.0"]
    want = CaptureHandle("run-1", "done", lambda: MemoryReader(sink)).get("resid_pre", 0)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("path", "code", "words"), [
    ("/dmi/runs/run-1/requests/live/safetensors", 409, "not complete"),
    ("/dmi/runs/run-2/requests/done", 404, "no run 'run-2'"),
    ("/dmi/runs/run-1/requests/nobody", 404, "nothing of request 'nobody'"),
    ("/dmi/runs/run-2/requests", 404, "no run"),
    ("/dmi/runs/" + "r" * 300 + "/requests", 400, "1 to 256 characters, got 300"),
    ("/dmi/runs/run-1/requests/%20done", 400, "no leading or trailing blanks"),
    ("/dmi/runs/run-1/requests/do%0Ane", 400, "printable characters only"),
    # found in review: %2F is decoded before routing, so the listing of request
    # "done/safetensors" was answered with request "done"'s file
    ("/dmi/runs/run-1/requests/done%2Fsafetensors", 400, "an id holding '/' (%2F)"),
    ("/dmi/runs/run-1/requests/done%2fx", 400, "cannot be named in the path"),
    ("/dmi/runs/run%2F1/requests", 400, "cannot be named in the path"),
])
def test_bad_and_unknown_ids_and_incomplete_captures_get_clear_answers(
        path: str, code: int, words: str) -> None:
    client = _client(StoreReads(lambda: MemoryReader(_store())), api_key=None)
    answer = client.get(path)
    assert answer.status_code == code
    assert words in answer.json()["error"]


def test_a_store_that_cannot_be_read_answers_503_and_no_store_404() -> None:
    class Down:
        def runs(self) -> Any:
            raise StoreError("the store's owner did not answer runs within 120 s")

    answer = _client(Down(), api_key=None).get("/dmi/runs")
    assert answer.status_code == 503
    assert "did not answer" in answer.json()["error"]
    nothing = _client(None, api_key=None).get("/dmi/runs")
    assert nothing.status_code == 404
    assert "stores nothing" in nothing.json()["error"]


def test_a_read_of_another_run_is_not_labelled_with_the_servers_run() -> None:
    """The run header named the server's run (and ``capturing``) on answers about any
    run of the store: a client labelling a download by it filed run-1's rows as run-s."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.auth import add_api_key_middleware

    from dmi_sglang.adapters.sglang_v0519.reads_api import mount_reads
    from dmi_sglang.adapters.sglang_v0519.server import CAPTURE_HEADER, RUN_HEADER, mount

    control = SimpleNamespace(run_id="run-s", last_state="capturing")
    app = FastAPI()
    app.get("/generate-like")(lambda: {})  # a request of this server's run
    mount(app, control)  # type: ignore[arg-type]
    mount_reads(app, StoreReads(lambda: MemoryReader(_store())))
    add_api_key_middleware(app, api_key="sekret", admin_api_key=None)
    client = TestClient(app)
    for path in ("/dmi/runs/run-1/requests/done/safetensors", "/dmi/runs/run-1/requests/done",
                 "/dmi/runs/run-1/requests"):
        answer = client.get(path, headers=KEY)
        assert answer.status_code == 200
        assert RUN_HEADER not in answer.headers, path
        assert CAPTURE_HEADER not in answer.headers, path
    assert client.get("/generate-like", headers=KEY).headers.get(RUN_HEADER) == "run-s"


def test_query_parameters_are_refused_not_ignored() -> None:
    """No read endpoint takes a query string: a filter the server does not know (say
    ``?run_id=``) answered every run with 200 before; now 400, naming it."""
    client = _client(StoreReads(lambda: MemoryReader(_store())), api_key=None)
    for path in ("/dmi/runs?run_id=nope", "/dmi/runs/run-1/requests?limit=1",
                 "/dmi/runs/run-1/requests/done?x=1&y",
                 "/dmi/runs/run-1/requests/done/safetensors?dtype=float16"):
        answer = client.get(path)
        assert answer.status_code == 400, path
        assert "are not accepted by" in answer.json()["error"], path
        assert "it takes none" in answer.json()["error"], path
    assert "'x', 'y'" in client.get("/dmi/runs/run-1/requests/done?x=1&y").json()["error"]


def test_an_export_whose_first_read_fails_answers_503_not_a_cut_200() -> None:
    """The store fails at the export's first rows: the answer is 503 with the store's
    reason (its header and first rows are read before the answer starts), not a 200 whose
    body stops after the header."""
    class Failing(MemoryReader):
        def batches_within(self, *args: Any, **kwargs: Any) -> Any:
            raise StoreError("the store's owner did not answer within 120 s")

    client = _client(StoreReads(lambda: Failing(_store())), api_key=None)
    answer = client.get("/dmi/runs/run-1/requests/done/safetensors")
    assert answer.status_code == 503
    assert "did not answer" in answer.json()["error"]


def test_status_and_stop_carry_the_state_they_found() -> None:
    """``X-DMI-Capture`` of a status or stop answer is the state that answer found (it
    said ``capturing`` beside a body saying ``paused`` or ``stopped``); their query
    strings are refused before the schedulers are asked."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from dmi_sglang.adapters.sglang_v0519.server import CAPTURE_HEADER, mount

    class Control:
        run_id = "run-s"
        last_state = "capturing"
        asked = 0

        def status(self) -> Any:
            self.asked += 1
            self.last_state = "paused"
            return SimpleNamespace(state="paused", to_json=lambda: {"state": "paused"})

        def stop(self, wait_s: float) -> Any:
            self.asked += 1
            self.last_state = "stopped"
            return SimpleNamespace(state="stopped", to_json=lambda: {"state": "stopped"})

    control = Control()
    app = FastAPI()
    mount(app, control)  # type: ignore[arg-type]
    client = TestClient(app)
    refused = client.get("/dmi/status?run_id=other")
    assert refused.status_code == 400
    assert "'run_id'" in refused.json()["error"]
    assert client.post("/dmi/stop?now=1").status_code == 400
    assert control.asked == 0
    status = client.get("/dmi/status")
    assert (status.json()["state"], status.headers[CAPTURE_HEADER]) == ("paused", "paused")
    stop = client.post("/dmi/stop")
    assert (stop.json()["state"], stop.headers[CAPTURE_HEADER]) == ("stopped", "stopped")
