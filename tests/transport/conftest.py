"""Fixtures for the transport tests: a toy model shape, a forward driver, a checker.

Every captured row holds values derived from (hook, layer, request, position), so a
record can be checked byte for byte without keeping the inputs; padding rows hold
``PAD`` so a stray padding row is recognisable.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from dmi_sglang.adapters.transport import TorchCaptureTransport, TransportOptions
from dmi_sglang.adapters.transport._arena import Arena
from dmi_sglang.adapters.transport._device import TORCH_DTYPES, DeviceOps
from dmi_sglang.app.session import SchedulerMonitor
from dmi_sglang.domain.capacity import ARENA_SLOTS_BUDGET, Decision, RingCapacity
from dmi_sglang.domain.hooks import (
    CATALOG,
    Hook,
    ModelHooks,
    RowBasis,
    Selection,
    hook_by_name,
    parse_selection,
)
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import CommitPlan, make_plan
from dmi_sglang.domain.records import CaptureRecord, RunInfo
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.testing import MemorySink

SHAPE = ModelShape(
    num_layers=3, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=12, vocab=10
)
_EXCLUDED = {"pos_embed", "router_logits", "topk_ids", "topk_weights"}
MODEL = ModelHooks(
    "ToyForCausalLM",
    frozenset(h.name for h in CATALOG if not h.attention_matrix and h.name not in _EXCLUDED),
    SHAPE.num_layers,
)
PAD = -5
Key = tuple[str, str, int]


def select(text: str) -> Selection:
    """A selection of the toy model."""
    return parse_selection(text).resolve(MODEL)


def _code(hook: Hook, layer: int, rid: str, pos: int) -> int:
    return hook.id * 37 + (layer + 1) * 53 + zlib.crc32(rid.encode()) % 97 + pos * 17


def rows_tensor(
    hook: Hook, layer: int, rows: Sequence[tuple[str, int]], padding: int = 0
) -> torch.Tensor:
    """The tensor a capture point sees for ``rows`` (then ``padding`` PAD rows)."""
    spec = SHAPE.row(hook)
    width = math.prod(spec.dims)
    codes = torch.tensor([_code(hook, layer, r, p) for r, p in rows] + [0] * padding)
    values = (codes[:, None] + torch.arange(width)[None, :]) % 199
    values[len(rows) :] = PAD
    return values.to(TORCH_DTYPES[spec.dtype]).reshape(len(codes), *spec.dims)


def stored_tensor(selection: Selection, hook: Hook, layer: int,
                  rows: Sequence[tuple[str, int]]) -> torch.Tensor:
    """What a capture of ``selection`` stores for ``rows``: the capture point's tensor
    (:func:`rows_tensor`, of ``final_logits`` for the topk captures) with the capture's
    payload applied."""
    payload = selection.payload_of(hook.name, layer)
    spec = SHAPE.capture_row(selection, hook, layer)
    if hook.derived:
        values, ids = torch.topk(rows_tensor(hook_by_name("final_logits"), -1, rows),
                                 payload.topk, dim=-1)
        out = ids if hook.is_integer else values
    else:
        out = rows_tensor(hook, layer, rows)
    return out.to(TORCH_DTYPES[spec.dtype])


def each_row(records: Sequence[CaptureRecord]) -> Iterator[tuple[CaptureRecord, int, bytes]]:
    """Every stored row, whatever the record boundaries: its record, position and bytes."""
    for r in records:
        width = len(r.payload) // r.rows
        for i in range(r.rows):
            yield r, r.start_token_idx + i, bytes(r.payload[i * width : (i + 1) * width])


def stored_rows(records: Sequence[CaptureRecord]) -> Counter[tuple[str, str, int, int, bytes]]:
    """``(request, hook, layer, position, row bytes)`` of every stored row, counted."""
    return Counter((r.request_id, r.act_name, r.layer_no, p, b) for r, p, b in each_row(records))


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a tensor, as a record stores them."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class TrackedReq:
    """What the capture session reads of SGLang's Req: ids, output ids, finished."""

    def __init__(self, rid: str, prompt: int) -> None:
        self.rid = rid
        self.origin_input_ids = list(range(prompt))
        self.output_ids: list[int] = []
        self.done = False

    def finished(self) -> bool:
        return self.done


class WrappedCapturer:
    """Stands in for a transport's capturer (``driver.t.capturer = Sub(driver.t.capturer)``):
    :meth:`capture` passes each capture on (a subclass changes what or what after),
    anything else goes to the wrapped capturer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def capture(self, hook_name: str, layer_no: int, tensor: torch.Tensor) -> None:
        self.inner.capture(hook_name, layer_no, tensor)


class Driver:
    """Runs simulated forwards through a transport and remembers what must arrive."""

    def __init__(self, transport: TorchCaptureTransport, selection: Selection) -> None:
        self.t = transport
        self.selection = selection
        self.step = 0
        self.expected: dict[Key, list[tuple[int, int]]] = defaultdict(list)
        self.capturing = False
        self.skip: frozenset[str] = frozenset()
        """Requests the plans leave out (request sampling)."""
        self.prompts: dict[str, int] = {}
        """Prompt lengths (for last_prompt rules)."""

    def plan(self, layout: BatchLayout, *, padded: bool = False, strip: bool = True) -> CommitPlan:
        return make_plan(layout, self.selection, SHAPE, padded=padded, strip=strip,
                         skip=self.skip, prompts=self.prompts.get)

    def fire(
        self, layout: BatchLayout, padding: int = 0, skip: set[tuple[str, int]] | None = None
    ) -> None:
        """Call every capture point as a forward over ``layout`` would."""
        try:
            for hook, layer in self.selection.capture_points():
                if skip and (hook.name, layer) in skip:
                    continue
                if hook.row_basis is RowBasis.REQUEST:
                    rows = [(r.request_id, r.end - 1) for r in layout.requests]
                else:
                    rows = layout.positions()
                self.t.capturer.capture(hook.name, layer,
                                        rows_tensor(hook, layer, rows, padding))
        finally:
            self.t.capturer.join()  # the forward's end, also when it raises (Capturer.join)

    def forward(
        self, layout: BatchLayout, *, padded: bool = False, strip: bool = True
    ) -> Decision:
        """preflight (graph steps), commit, fire, seal; records what must arrive."""
        self.step += 1
        plan = self.plan(layout, padded=padded, strip=strip)
        decision = Decision.FITS
        if padded:
            eager_layout = layout.with_padding(layout.raw_batch_size)
            eager = self.plan(eager_layout)
            decision = self.t.preflight(plan, lambda: eager).decision
            if decision is Decision.RUN_EAGER:
                layout, plan, padded = eager_layout, eager, False
        self.t.commit(plan, step=self.step)
        self.fire(layout, layout.padded_batch_size - layout.raw_batch_size)
        self.t.seal()
        for seg in plan.segments:
            for sl in plan.slices(seg):
                key = (sl.request_id, seg.hook.act_name, seg.layer_no)
                self.expected[key].append((sl.start, sl.end))
        return decision

    def graph_capture(self, bucket: int) -> None:
        """Simulate recording the decode graph of one bucket (dummy rows, no commit)."""
        self.capturing = True
        try:
            dummy = BatchLayout.decode([f"dummy{i}" for i in range(bucket)], [1] * bucket)
            self.fire(dummy)
        finally:
            self.capturing = False

    def verify(self, records: Sequence[CaptureRecord]) -> None:
        """Every planned row arrived exactly once, in position order, with its bytes."""
        got: dict[Key, list[tuple[int, int]]] = defaultdict(list)
        by_name = {h.act_name: h for h in CATALOG}
        for rec in records:
            key = (rec.request_id, rec.act_name, rec.layer_no)
            got[key].append((rec.start_token_idx, rec.end_token_idx))
            hook = by_name[rec.act_name]
            spec = SHAPE.capture_row(self.selection, hook, rec.layer_no)
            assert rec.model_id == self.t.run_id
            assert rec.shard_rank == 0
            assert rec.dtype == spec.dtype.value
            assert rec.shape == (rec.rows, *spec.dims)
            want = stored_tensor(
                self.selection, hook, rec.layer_no,
                [(rec.request_id, p) for p in range(rec.start_token_idx, rec.end_token_idx)],
            )
            assert rec.payload == raw_bytes(want), key
        assert set(got) == set(self.expected)
        for key, want_ranges in self.expected.items():
            want_positions = [p for a, b in want_ranges for p in range(a, b)]
            got_positions = [p for a, b in got[key] for p in range(a, b)]
            assert got_positions == want_positions, key


def arena_slot_reader(arena: Arena,
                      width: int) -> Callable[[int, tuple[str, int], int], torch.Tensor]:
    """``slot(k, key, rows)``: the first ``rows`` bf16 rows of ``width`` values that
    ``arena``'s slot ``k`` holds in ``key``'s place."""
    def slot(k: int, key: tuple[str, int], rows: int) -> torch.Tensor:
        start = k * arena.slot_bytes + arena.offsets[key]
        raw = arena.buffer[start : start + rows * width * 2]
        return raw.view(torch.bfloat16).view(rows, width)

    return slot


def monitor_of(d: Driver, sink: MemorySink, **kw: Any) -> SchedulerMonitor:
    """The capture session of run ``run-1`` over ``d``'s transport and selection."""
    run = RunInfo("run-1", "toy", (), (), "2026-01-01T00:00:00+00:00")
    return SchedulerMonitor(run=run, selection=d.selection, shape=SHAPE, transport=d.t,
                            sink=sink, strip=True, **kw)


def captured_forward(mon: SchedulerMonitor, d: Driver, layout: BatchLayout,
                     reqs: Sequence[TrackedReq]) -> None:
    """One captured eager forward of ``reqs``, as the runtime hooks drive it."""
    mon.add_requests(reqs, frozenset())
    mon.begin_forward()
    mon.commit_eager(layout)
    d.fire(layout)
    mon.end_forward()
    d.step += 1


def two_requests(d: Driver, *, padded: bool) -> None:
    """A prefill of requests a (5 tokens) and b (3), then 4 decode steps of both (padded
    replays of a recorded bucket of 4 when ``padded``)."""
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    if padded:
        d.graph_capture(4)
    for n in range(4):
        d.forward(BatchLayout.decode(["a", "b"], [6 + n, 4 + n],
                                     padded_batch_size=4 if padded else None), padded=padded)


@pytest.fixture(autouse=True)
def _deferred_device_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain stream's work runs only when waited for, as on a GPU at the earliest:
    a host read of an unwaited copy, or a ring region or arena slot reused before its
    copy ran, gives wrong bytes (see ``DeviceOps.defer_on_cpu``)."""
    monkeypatch.setattr(DeviceOps, "defer_on_cpu", True)


@pytest.fixture(params=["slots", "one-slot"])
def make_driver(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., tuple[Driver, MemorySink]]]:
    """Factory: ``make_driver(selection_text, payload_bytes=..., ...) -> (driver, sink)``.

    Every test using it runs twice: with the arena's slots (decode graph steps copied
    out by the drain) and with one slot (copied out at seal, as large arenas are); a
    test parametrizes it indirectly with ``["slots"]`` to run with slots only."""
    made: list[TorchCaptureTransport] = []
    slots_bytes = ARENA_SLOTS_BUDGET if request.param == "slots" else 0

    def factory(
        text: str = "resid_pre,final_logits",
        *,
        payload_bytes: int = 1 << 16,
        entries: int = 1024,
        max_graph_batch: int = 8,
        sink: MemorySink | None = None,
        shape: ModelShape = SHAPE,
        **options: object,
    ) -> tuple[Driver, MemorySink]:
        sink = sink if sink is not None else MemorySink()
        options.setdefault("arena_slots_bytes", slots_bytes)
        options.setdefault("topk_kernel", "none")  # not the host's FlashInfer: ask for auto
        selection = select(text)
        holder: list[Driver] = []
        transport = TorchCaptureTransport(
            capacity=RingCapacity(payload_bytes, payload_bytes, entries),
            selection=selection,
            shape=shape,
            max_graph_batch=max_graph_batch,
            sink=sink,
            run_id="run-1",
            device="cpu",
            options=TransportOptions(**options),  # type: ignore[arg-type]
            capture_probe=lambda: holder[0].capturing,
        )
        made.append(transport)
        driver = Driver(transport, selection)
        holder.append(driver)
        return driver, sink

    yield factory
    for t in made:
        with contextlib.suppress(Exception):  # a test about failures already checked them
            t.stop()


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""This pytest process runs Triton kernels in Triton's interpreter (on CPU tensors)."""


def run_interpreted_tests(test_file: str, *, timeout_s: int) -> None:
    """Run ``test_file``'s ``test_interpreted_*`` tests in a pytest process of its own
    with Triton's interpreter chosen before Triton is imported; every one must pass, none
    be skipped (skipped here, from within such a process, or without Triton)."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("runs the interpreted tests: not from within them")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(Path(test_file).resolve()), "-k", "test_interpreted_"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[2],
        capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary, summary
    assert "skipped" not in summary, summary


def assert_topk3_of(full: Sequence[CaptureRecord], topk: Sequence[CaptureRecord]) -> None:
    """The ``final_logits:topk(3)`` records ``topk`` hold ``torch.topk`` of the 10 logits
    a row that the ``final_logits`` records ``full`` hold, values and int32 ids, every
    row of both."""
    logits = {(r.request_id, r.start_token_idx + i): row
              for r in full
              for i, row in enumerate(torch.frombuffer(bytearray(r.payload),
                                                       dtype=torch.float32).view(-1, 10))}
    stored = 0
    for r in topk:
        rows = torch.frombuffer(bytearray(r.payload), dtype=torch.uint8).view(-1, 12)
        for i, row in enumerate(rows):
            top = torch.topk(logits[r.request_id, r.start_token_idx + i], 3)
            want = (top.values if r.act_name == "logits_topk_values"
                    else top.indices.to(torch.int32))
            assert bytes(row.numpy()) == raw_bytes(want)
            stored += 1
    assert stored == 2 * len(logits)
