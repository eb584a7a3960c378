"""A server's reads of a live embedded store, through the store owner's read channel
(``adapters.owner``) and the export (``app.export``), on the real embedded engine: the
owner holds the store and its sink runs while another reader asks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.adapters.owner import ReadService, RemoteReader
from dmi_sglang.app import export
from dmi_sglang.app.export import StoreReads
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import IncompleteCaptureError, StoreError

from ._support import RESID, handle, manifest, records_of, run_info

LOGITS = "final_logits"
CAPTURES = [(RESID, 0), (RESID, 1), (LOGITS, -1)]
PROMPT, COMPLETION = 4, 3  # token rows [0, 6), logits rows [3, 6)


def _put(sink: ClickHouseSink, rid: str) -> None:
    for act, layer in CAPTURES:
        first = PROMPT - 1 if act == LOGITS else 0
        bounds = [first, PROMPT, PROMPT + 1, PROMPT + 2]
        dtype = torch.float32 if act == LOGITS else torch.bfloat16
        t = torch.randn(bounds[-1] - first, 3, 2).to(dtype)
        sink.put(RecordBatch.from_records(
            records_of("run", rid, act, layer, t, bounds, base=first)))


@pytest.fixture
def served(open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
           tmp_path: Path) -> Iterator[tuple[StoreReads, ClickHouseSink]]:
    """A running run with request "done" committed and "live" not, its store read
    through a read service as a server's main process reads it."""
    sink = open_sink()
    sink.start_run(run_info("run", CAPTURES))
    _put(sink, "done")
    sink.commit_requests([manifest("run", "done", PROMPT, COMPLETION)])
    _put(sink, "live")
    sink.flush()
    service = ReadService(ClickHouseReader(store), f"ipc://{tmp_path}/reads")
    remote = RemoteReader(service.address, timeout_s=30)
    yield StoreReads(lambda: remote), sink
    service.close()


def test_a_committed_request_exports_as_safetensors_equal_to_the_store(
        served: tuple[StoreReads, ClickHouseSink], store: StoreConfig, tmp_path: Path) -> None:
    remote = RemoteReader(f"ipc://{tmp_path}/reads", timeout_s=30)
    reads = StoreReads(lambda: remote, piece_bytes=20)  # a piece of at most 20 B: one row each
    listing = reads.listing("run", "done")
    assert listing["complete"] is True
    assert listing["run_status"] == "running"
    assert (listing["prompt_tokens"], listing["completion_tokens"]) == (PROMPT, COMPLETION)
    by_name = {t["name"]: t for t in listing["tensors"]}  # type: ignore[attr-defined]
    assert by_name[f"{RESID}.1"] == {"name": f"{RESID}.1", "hook": RESID, "layer": 1,
                                     "dtype": "bfloat16", "shape": [6, 3, 2],
                                     "positions": [0, 6, 1]}
    assert by_name[LOGITS]["shape"] == [3, 3, 2]
    assert by_name[LOGITS]["dtype"] == "float32"
    length, pieces = reads.safetensors("run", "done")
    parts = list(pieces)
    body = b"".join(parts)
    assert len(body) == length
    assert len(parts) == 1 + 6 + 6 + 3  # the header, then one row per piece
    tensors = load_safetensors(body)
    h = handle(store, "run", "done")
    assert set(tensors) == set(by_name)
    for act, layer in CAPTURES:
        got = tensors[export.tensor_name(act, layer)]
        assert torch.equal(got, h.get(act, None if layer < 0 else layer))
    header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])
    assert header["__metadata__"]["run_id"] == "run"
    assert json.loads(header["__metadata__"]["positions"])[LOGITS] == [3, 6, 1]


def test_an_export_reads_the_tensors_that_fit_one_piece_in_one_query(
        served: tuple[StoreReads, ClickHouseSink], store: StoreConfig,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[list[tuple[str, int]]] = []
    remote = RemoteReader(f"ipc://{tmp_path}/reads", timeout_s=30)
    real = remote.batches_within

    def counted(*args: object, **kwargs: object) -> object:
        asked.append(list(kwargs["captures"]))  # type: ignore[call-overload]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(remote, "batches_within", counted)
    counting = StoreReads(lambda: remote)
    whole = b"".join(counting.safetensors("run", "done")[1])
    assert asked == [[(RESID, 0), (RESID, 1), (LOGITS, -1)]]  # 72 + 72 + 72 bytes: one piece
    asked.clear()
    pieced = StoreReads(lambda: remote, piece_bytes=150)  # two resid tensors, then logits
    assert b"".join(pieced.safetensors("run", "done")[1]) == whole
    assert asked == [[(RESID, 0), (RESID, 1)], [(LOGITS, -1)]]
    asked.clear()
    sliced = StoreReads(lambda: remote, piece_bytes=30)  # each alone: 2 resid, 1 logits row
    assert b"".join(sliced.safetensors("run", "done")[1]) == whole
    assert asked == [[(RESID, 0)]] * 3 + [[(RESID, 1)]] * 3 + [[(LOGITS, -1)]] * 3
    tensors = load_safetensors(whole)
    h = handle(store, "run", "done")
    for act, layer in CAPTURES:
        assert torch.equal(tensors[export.tensor_name(act, layer)],
                           h.get(act, None if layer < 0 else layer))


def test_an_uncommitted_or_unknown_request_is_not_exported(
        served: tuple[StoreReads, ClickHouseSink]) -> None:
    reads, _ = served
    live = reads.listing("run", "live")
    assert live["complete"] is False
    assert "running, not committed" in live["missing"][0]  # type: ignore[index]
    assert live["tensors"] == []
    with pytest.raises(IncompleteCaptureError, match="'live' of run 'run' is not complete"):
        reads.safetensors("run", "live")
    with pytest.raises(LookupError, match="no run 'nope'"):
        reads.listing("nope", "done")
    with pytest.raises(LookupError, match="nothing of request 'other'"):
        reads.listing("run", "other")
    with pytest.raises(LookupError):
        reads.requests("nope")


def test_runs_and_requests_are_listed_with_what_is_committed(
        served: tuple[StoreReads, ClickHouseSink]) -> None:
    reads, _ = served
    (run,) = reads.runs()
    assert (run["run_id"], run["status"], run["captures"]) == ("run", "running", 3)
    requests = {r["request_id"]: r for r in reads.requests("run")}
    assert requests["done"]["committed"] is True
    assert requests["live"]["committed"] is False
    assert requests["done"]["records"] == requests["live"]["records"] == 3 * 3


def test_the_read_channel_answers_reads_only_and_a_silent_owner_times_out(
        served: tuple[StoreReads, ClickHouseSink], tmp_path: Path) -> None:
    reads, _ = served
    assert reads.runs()  # the channel works
    remote = RemoteReader(f"ipc://{tmp_path}/reads", timeout_s=5)
    with pytest.raises(StoreError, match="cannot be deleted"):
        remote.delete_run("run")
    with pytest.raises(StoreError, match="does not answer 'delete_run'"):
        remote._call("delete_run", "run")  # what a forged request gets
    for forged in ([["a", "1"]], [["a", 1, 2]], "a", [[["a"], 1]], [["a", True]], None,
                   [[RESID, 1 << 32]]):  # a layer past Int32 would wrap to layer 0
        with pytest.raises(StoreError, match="does not answer 'batches_within'"):
            remote._call("batches_within", "run", "done", captures=forged, start=0, end=1)
    with pytest.raises(StoreError, match="does not answer 'records'"):
        remote._call("records", "run", "done", captures=[[RESID, 0]])
    assert remote.run("run") is not None  # still there
    nobody = RemoteReader(f"ipc://{tmp_path}/nobody", timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="no store owner answers reads at"):
        nobody.runs()
    assert time.monotonic() - t0 < 5  # at once, not after the timeout
    import zmq

    mute = zmq.Context.instance().socket(zmq.REP)  # an owner that never answers
    mute.bind(f"ipc://{tmp_path}/mute")
    try:
        with pytest.raises(StoreError, match=r"did not answer runs within 0.3 s"):
            RemoteReader(f"ipc://{tmp_path}/mute", timeout_s=0.3).runs()
    finally:
        mute.close(0)


def test_a_request_that_is_not_plain_json_is_refused_unread(
        served: tuple[StoreReads, ClickHouseSink], tmp_path: Path) -> None:
    """Nothing a client sends is unpickled: a pickled request (which could run code when
    loaded) is answered as malformed."""
    import pickle

    import zmq

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (Path(tmp_path / "pwned").touch, ())  # type: ignore[return-value]

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"ipc://{tmp_path}/reads")
    try:
        for raw in (pickle.dumps(Boom()), b'{"method": "delete_run", "args": ["run"], '
                                          b'"kwargs": {}}',
                    b'{"method": "records", "args": [["x"]], "kwargs": {}}'):
            sock.send(raw)
            kind, *rest = pickle.loads(sock.recv())
            assert kind == "error", rest
    finally:
        sock.close(0)
    assert not (tmp_path / "pwned").exists()


def test_only_a_private_ipc_address_is_served(tmp_path: Path, store: StoreConfig) -> None:
    from dmi_sglang.adapters.owner import check_address

    with pytest.raises(StoreError, match="only at ipc:///absolute/path"):
        check_address("tcp://127.0.0.1:5555")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(StoreError, match="admit no one else"):
        ReadService(ClickHouseReader(store), f"ipc://{shared}/reads")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert check_address(f"ipc://{private}/reads").endswith("/reads")


def test_records_read_through_the_owner_hold_read_only_payloads(
        served: tuple[StoreReads, ClickHouseSink], tmp_path: Path) -> None:
    remote = RemoteReader(f"ipc://{tmp_path}/reads", timeout_s=30)
    direct = list(remote.records("run", "done"))
    assert direct
    for r in direct:
        assert isinstance(r.payload, memoryview)
        assert r.payload.readonly  # as CaptureRecord says: and hashable, like any record
        assert hash(r) == hash(r)
    (batch,) = remote.batches_within("run", "done", captures=[(RESID, 0)], start=0, end=1)
    assert len(batch) == 1
    for column in (batch.payload, batch.offsets, batch.start, batch.seq):
        assert not column.flags.writeable  # views of the received frames
    assert all(r.payload.readonly for r in batch.records())


def test_a_failed_answer_costs_one_exchange_and_the_channel_goes_on(
        store: StoreConfig, open_sink: Callable[..., ClickHouseSink], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sink = open_sink()
    sink.start_run(run_info("run", CAPTURES))
    sink.flush()
    service = ReadService(ClickHouseReader(store), f"ipc://{tmp_path}/reads")
    try:
        real = service._answer
        monkeypatch.setattr(service, "_answer", lambda request: [object()])  # not sendable
        with pytest.raises(StoreError, match="did not answer runs"):
            RemoteReader(service.address, timeout_s=1).runs()
        monkeypatch.setattr(service, "_answer", real)
        assert [r.run_id for r in RemoteReader(service.address, timeout_s=30).runs()] == [
            "run"]
    finally:
        service.close()


def test_batches_within_cut_the_rows_in_the_store(
        served: tuple[StoreReads, ClickHouseSink], store: StoreConfig) -> None:
    reader = ClickHouseReader(store)
    whole = reader.records("run", "done", act_name=RESID, layer_no=0)
    (batch,) = reader.batches_within("run", "done", captures=[(RESID, 0)], start=1, end=5)
    cut = list(batch.records())
    assert [(r.start_token_idx, r.end_token_idx, r.shape) for r in cut] == [
        (1, 4, (3, 3, 2)), (4, 5, (1, 3, 2))]
    prefill = whole[0]  # rows [0, 4): its rows 1..3 are the first cut record's bytes
    row = len(prefill.payload) // prefill.rows
    assert cut[0].payload == prefill.payload[row : 4 * row]
    assert cut[1].payload == whole[1].payload


def test_handles_of_one_store_are_read_from_two_threads_at_once(
        open_sink: Callable[..., ClickHouseSink], store: StoreConfig) -> None:
    # Found in review: the handles share one reader, whose one session client a thread
    # closed while the other read through it ("The client has been closed")
    import threading

    from dmi_sglang.app.reading import CaptureStore

    from ._support import batch_of, commit, same_bits

    sink = open_sink(writers=1)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    want = {f"r{k}": torch.randn(6, 32) for k in range(4)}
    for rid, rows in want.items():
        sink.put(batch_of("run", rid, RESID, 0, rows, [0, 3, 6]))
    commit(sink, run, [manifest("run", rid, 6, 1) for rid in want])
    sink.close()
    captures = CaptureStore(store)
    errors: list[str] = []

    def read(ids: list[str]) -> None:
        try:
            for _ in range(15):
                for rid in ids:
                    got = captures.handle("run", rid).get(RESID, 0)
                    assert same_bits(got, want[rid]), rid
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(repr(exc)[:300])

    threads = [threading.Thread(target=read, args=(ids,)) for ids in (["r0", "r1"],
                                                                       ["r2", "r3"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]


def test_an_answer_in_hand_when_the_channel_closes_reaches_its_caller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner closes its read channel (its parent is gone) right after answering: the
    answer (an export's can be hundreds of MB) is written out before the socket closes,
    not dropped so that its caller waits out its timeout."""
    import contextlib
    import threading

    from dmi_sglang.adapters.owner import _service

    monkeypatch.setattr(_service, "LATE_ANSWER_GRACE_S", 0.0)  # no grace to hide behind
    tmp_path.chmod(0o700)
    big = "x" * (64 << 20)

    class Big:
        @contextlib.contextmanager
        def session(self) -> Iterator[Big]:
            yield self

        def runs(self) -> str:
            return big

    service = ReadService(Big(), f"ipc://{tmp_path}/reads")  # type: ignore[arg-type]
    got: list[int] = []
    caller = threading.Thread(target=lambda: got.append(
        len(RemoteReader(service.address, timeout_s=60).runs())), daemon=True)
    caller.start()
    deadline = time.monotonic() + 20
    while service.answered == 0 and time.monotonic() < deadline:
        time.sleep(0.0005)
    service.close()
    caller.join(90)
    assert got == [len(big)]
