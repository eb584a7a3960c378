"""The capture-side contracts: transport, capturer, session, factory, engine tap, adapter.

The transport runs on the CPU (same code path as on the GPU, with host copies).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch

from dmi_sglang.adapters.sglang_v0519.adapter import ADAPTER
from dmi_sglang.adapters.sglang_v0519.engine import EngineRpcTap
from dmi_sglang.adapters.transport import create_transport
from dmi_sglang.app import composition
from dmi_sglang.app.composition import SGLANG_ADAPTERS, PipelineFactory
from dmi_sglang.app.null_sink import NullSink
from dmi_sglang.app.reading import open_store
from dmi_sglang.app.store_owner import OwnedSink
from dmi_sglang.domain.capacity import arena_bytes
from dmi_sglang.domain.hooks import CATALOG, ModelHooks, Selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import make_plan
from dmi_sglang.domain.ports import (
    CaptureSession,
    CaptureSpec,
    CaptureTransport,
    EngineTap,
    TransportStats,
)
from dmi_sglang.domain.records import RunStatus
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.errors import CapacityError, CaptureError
from dmi_sglang.tensor_ports import CaptureFactory, Capturer, OpenedCapture, SGLangAdapter
from dmi_sglang.testing import MemorySink
from tests.reliability._faults import ends

from . import _data as d

SHAPE = ModelShape(num_layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=6,
                   vocab=10)
MODEL = ModelHooks("ToyForCausalLM", frozenset(h.name for h in CATALOG), SHAPE.num_layers)


def _settings(**kw: str) -> Settings:
    values = {"dmx_hook_selection": "resid_pre,final_logits", "dmx_ring_payload_mb": "4",
              "dmx_ring_pinned_mb": "4", "dmx_model_id": "contract-run", **kw}
    return Settings.from_kwargs(values, env={}).resolve(model_path="/models/toy")


def _spec(settings: Settings) -> CaptureSpec:
    selection = settings.selection.resolve(MODEL)
    run = d.run_info(settings.model_id or "")
    return CaptureSpec(settings=settings, run=run, selection=selection, shape=SHAPE,
                       max_graph_batch=4, device="cpu", max_prefill_tokens=16, max_requests=4)


def _fire(capturer: Capturer, selection: Selection, layout: BatchLayout) -> None:
    for hook, layer in selection.captures():
        rows = len(layout.requests) if hook.name == "final_logits" else layout.token_rows
        width = SHAPE.row(hook).dims
        dtype = torch.float32 if hook.name == "final_logits" else torch.bfloat16
        capturer.capture(hook.name, layer, torch.ones(rows, *width, dtype=dtype))
    capturer.join()


@pytest.fixture
def transport() -> Iterator[tuple[CaptureTransport, Capturer, MemorySink, Selection]]:
    settings = _settings()
    spec = _spec(settings)
    sink = MemorySink()
    made = create_transport(
        payload_mb=4, pinned_mb=4, task_entries=256, padding_strip=True,
        flush_timeout_us=10_000, selection=spec.selection, shape=SHAPE, max_graph_batch=4,
        sink=sink, run_id="contract-run", device="cpu", max_prefill_tokens=16, max_requests=4)
    yield made, made.capturer, sink, spec.selection
    made.stop()


def test_the_transport_and_its_capturer_conform(
    transport: tuple[CaptureTransport, Capturer, MemorySink, Selection],
) -> None:
    t, capturer, _, selection = transport
    assert isinstance(t, CaptureTransport)
    assert isinstance(capturer, Capturer)
    assert t.device_bytes > 0
    hook, layer = selection.captures()[0]
    assert capturer.wants(hook.name, layer)
    assert not capturer.wants("mlp_out", 0)


def test_the_transport_step_protocol_delivers_records_and_counts(
    transport: tuple[CaptureTransport, Capturer, MemorySink, Selection],
) -> None:
    t, capturer, sink, selection = transport
    layout = BatchLayout.extend(["r1", "r2"], [0, 0], [3, 2])
    plan = make_plan(layout, selection, SHAPE, padded=False)
    assert t.preflight(plan).decision.name == "FITS"
    t.commit(plan, step=1)
    _fire(capturer, selection, layout)
    t.seal()
    t.finish_request("r1", None)
    stats = t.stop()
    assert t.stop() == stats  # idempotent
    assert isinstance(stats, TransportStats)
    assert stats.steps == 1
    assert stats.bytes == sink.payload_bytes > 0
    assert {r.request_id for r in sink.records} == {"r1", "r2"}
    counters = t.drain_counters()
    assert isinstance(counters, Mapping)
    assert all(isinstance(k, str) and isinstance(v, int | float) for k, v in counters.items())


def _prefill(opened: OpenedCapture, spec: CaptureSpec, rid: str, length: int) -> None:
    """One captured prefill forward of ``rid`` (positions ``[0, length)``)."""
    session = opened.session
    layout = BatchLayout.extend([rid], [0], [length])
    session.begin_forward()
    session.commit_eager(layout)
    _fire(opened.capturer, spec.selection, layout)
    session.end_forward()


@pytest.mark.parametrize("store", ["none", "embedded"])
def test_the_pipeline_factory_opens_a_session_the_adapter_can_drive(
    store: str, tmp_path: Any
) -> None:
    url = "none" if store == "none" else f"chdb://{tmp_path / 'store'}"
    spec = _spec(_settings(dmx_db_url=url))
    factory = PipelineFactory()
    assert isinstance(factory, CaptureFactory)
    opened = factory.open(spec)
    assert isinstance(opened, OpenedCapture)
    session = opened.session
    assert isinstance(session, CaptureSession)
    assert session.run == spec.run
    assert session.active
    req = SimpleNamespace(rid="r1", origin_input_ids=[1, 2, 3], output_ids=[4],
                          finished=lambda: True)
    session.add_requests([req], frozenset())
    _prefill(opened, spec, "r1", 3)
    session.add_host_seconds(0.001)
    stats = session.stop()
    assert not session.active
    assert stats.steps == 1
    assert set(session.timing(stats)) >= {  # the keys; their values are clock readings
        "forwards", "host_seconds", "stall_seconds", "piecewise_stall_seconds",
        "capture_seconds",
        "stop_transport_seconds", "stop_finish_run_seconds", "stop_close_seconds",
        "gc_collections", "gc_seconds", "gc_full_collections", "gc_full_seconds",
        "gc_longest_seconds"}
    if store == "embedded":
        run = open_store(url).run(spec.run.run_id)
        assert run is not None
        assert run.status is RunStatus.COMMITTED
        assert open_store(url).handle(spec.run.run_id, "r1").available


def _device_bytes(**setting: str) -> int:
    """Device bytes of a capture the pipeline factory opens with ``setting`` (no store)."""
    opened = PipelineFactory().open(_spec(_settings(dmx_db_url="none", **setting)))
    try:
        return opened.device_bytes
    finally:
        opened.session.stop()


def test_the_pipeline_factory_sizes_the_decode_window_from_the_setting() -> None:
    # the window and its gather buffer, each as large as the setting
    assert _device_bytes(dmx_drain_window_mb="48") - _device_bytes(dmx_drain_window_mb="16") \
        == 2 * (32 << 20)


def test_the_pipeline_factory_gives_the_arena_the_slots_the_setting_holds() -> None:
    one = arena_bytes(_spec(_settings()).selection, SHAPE, max_graph_batch=4)
    # 0 MiB: one slot; 1 MiB: 32 slots (the most), a spare and a landing slot
    assert _device_bytes(dmx_arena_slots_mb="1") - _device_bytes(dmx_arena_slots_mb="0") \
        == (32 + 2 - 1) * one


def test_the_pipeline_factory_passes_the_copy_settings_to_the_drain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.adapters.transport import _device

    warmed: list[int] = []  # the kernel itself needs a GPU or Triton's interpreter
    monkeypatch.setattr(_device, "warm_up", lambda device, programs: warmed.append(programs))
    opened = PipelineFactory().open(_spec(_settings(
        dmx_db_url="none", dmx_drain_copy_piece_mb="3", dmx_drain_copy_ahead="5",
        dmx_drain_copy_kernel="7", dmx_drain_copy_gaps="1")))
    try:
        ops = opened.session.transport._ops  # type: ignore[attr-defined]
        assert (ops._piece_bytes, ops._ahead, ops._kernel_programs) == (3 << 20, 5, 7)
        assert ops._gap is not None
        assert warmed == [7]  # checked at start, before the first flush
    finally:
        opened.session.stop()


def test_a_factory_whose_transport_cannot_be_made_closes_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = attrs.evolve(_spec(_settings(dmx_ring_payload_mb="1")), max_prefill_tokens=10**6)
    closed: list[bool] = []

    class Sink(NullSink):
        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(composition, "open_capture_sink", lambda settings, address: Sink())
    with pytest.raises(CapacityError, match="ring"):
        PipelineFactory().open(spec)
    assert closed == [True]


@pytest.mark.sglang
def test_the_engine_tap_checks_the_schedulers_answer_itself() -> None:
    """Over a real socket pair, as SGLang's engine and scheduler talk: a refusal is a
    CaptureError whatever ``python -O`` strips (see tests/reliability for -O itself)."""
    zmq = pytest.importorskip("zmq")
    from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send

    context = zmq.Context.instance()
    engine_side = context.socket(zmq.PAIR)
    scheduler_side = context.socket(zmq.PAIR)
    engine_side.bind("inproc://dmi-tap-contract")
    scheduler_side.connect("inproc://dmi-tap-contract")
    seen: list[tuple[str, dict[str, Any]]] = []

    def scheduler(answers: list[tuple[bool, str]]) -> None:
        for ok, message in answers:
            request = sock_recv(scheduler_side)
            seen.append((request.method, dict(request.parameters)))
            sock_send(scheduler_side, RpcReqOutput(success=ok, message=message))

    worker = threading.Thread(target=scheduler,
                              args=([(True, ""), (True, ""), (False, "scheduler says no")],))
    worker.start()
    try:
        tap: EngineTap = ADAPTER.engine_tap(SimpleNamespace(send_to_rpc=engine_side))
        assert isinstance(tap, EngineRpcTap)
        tap.assert_active("run-1")
        tap.stop_monitoring()
        with pytest.raises(CaptureError, match="dmi_stop_monitoring failed in the scheduler: "
                                                "scheduler says no"):
            tap.stop_monitoring()
    finally:
        worker.join(5)
        engine_side.close(0)
        scheduler_side.close(0)
    assert seen == [("dmi_assert_active", {"run_id": "run-1"}), ("dmi_stop_monitoring", {}),
                    ("dmi_stop_monitoring", {})]


def test_every_registered_sglang_adapter_conforms() -> None:
    for version in SGLANG_ADAPTERS:
        adapter = composition.sglang_adapter(version)
        assert isinstance(adapter, SGLangAdapter)
        assert adapter.sglang_version == version
    assert composition.sglang_adapter("0.5.19") is ADAPTER


def test_a_servers_reads_go_through_the_store_owner(tmp_path: Any) -> None:
    """With a read address (a server's scheduler), the store owner process the factory
    started answers the server's reads of the embedded store it holds: a finished request
    reads back complete while the run still captures, and after the stop; a store of none
    has no reads."""
    import time

    url = f"chdb://{tmp_path / 'store'}"
    address = f"ipc://{tmp_path}/reads"
    settings = _settings(dmx_db_url=url)
    spec = attrs.evolve(_spec(settings), read_address=address)
    factory = PipelineFactory()
    opened = factory.open(spec)
    session = opened.session
    done = [False]
    req = SimpleNamespace(rid="r1", origin_input_ids=[1, 2, 3], output_ids=[4],
                          finished=lambda: done[0])
    session.add_requests([req], frozenset())
    _prefill(opened, spec, "r1", 3)
    done[0] = True
    _prefill(opened, spec, "r2", 2)  # its start reports r1 finished: r1's commit follows
    reads = factory.serving_reads(settings, address)
    assert reads is not None
    deadline = time.monotonic() + 30
    listing: dict[str, Any] = {}
    while not listing.get("complete"):
        assert time.monotonic() < deadline, listing
        time.sleep(0.05)
        try:
            listing = reads.listing(spec.run.run_id, "r1")
        except LookupError:  # none of its rows is stored yet
            continue
    assert session.active
    assert [r["status"] for r in reads.runs()] == ["running"]
    length, pieces = reads.safetensors(spec.run.run_id, "r1")
    assert len(b"".join(pieces)) == length
    sink = session.sink
    assert isinstance(sink, OwnedSink)
    assert sink.pid != os.getpid()  # a process of its own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reads", "store", "writes"]  # its
    # write channel beside the server's read channel: the server's cleanup removes both
    session.stop()
    assert [r["status"] for r in reads.runs()] == ["committed"]  # the owner answers on
    assert factory.serving_reads(_settings(dmx_db_url="none"), address) is None
    sink.end()  # what the scheduler's exit does
    assert open_store(url).run(spec.run.run_id).status is RunStatus.COMMITTED  # free at once
    assert ends(sink.pid)  # its exit completes on its own, and a thread reaps it
