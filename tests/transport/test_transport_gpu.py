"""GPU tests of the capture transport: a toy model under eager forwards and CUDA graphs.

Run on the H200 machine: ``python -m pytest tests/transport/test_transport_gpu.py -m gpu -v``.
Every record is compared byte for byte with a reference clone taken in the same forward
(under graph capture the clone is part of the graph, so it is refreshed by every replay).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from dmi_sglang.adapters.transport import Capturer, TorchCaptureTransport, TransportOptions
from dmi_sglang.adapters.transport._device import DeviceOps, copy_rows
from dmi_sglang.domain.capacity import ARENA_SLOTS_MAX, RingCapacity
from dmi_sglang.domain.hooks import ModelHooks, RowBasis, Selection, parse_selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import CommitPlan, make_plan
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.testing import MemorySink

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = ModelShape(
    num_layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=96
)
HOOKS = (
    "token_ids", "embed", "resid_pre", "ln1", "attn_out", "resid_mid", "ln2", "mlp_in",
    "mlp_post", "mlp_out", "resid_final", "final_ln", "final_logits",
)
SELECTION: Selection = parse_selection(",".join(HOOKS)).resolve(
    ModelHooks("ToyForCausalLM", frozenset(HOOKS), SHAPE.num_layers)
)
DENSE: Selection = parse_selection(",".join(h for h in HOOKS if h != "final_logits")).resolve(
    ModelHooks("ToyForCausalLM", frozenset(HOOKS), SHAPE.num_layers)
)
"""Without request rows: every uncoalesced step is copied ring -> payload memory directly."""
Key = tuple[str, int]
Ref = dict[Key, torch.Tensor]


class ToyModel(nn.Module):
    """A row-independent decoder-shaped model whose forward calls capture points."""

    def __init__(self, capturer: Capturer) -> None:
        super().__init__()
        h, i = SHAPE.hidden, SHAPE.intermediate
        self.cap = capturer
        self.embed = nn.Embedding(SHAPE.vocab, h)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({
                "ln1": nn.LayerNorm(h), "attn": nn.Linear(h, h), "ln2": nn.LayerNorm(h),
                "up": nn.Linear(h, i), "down": nn.Linear(i, h),
            })
            for _ in range(SHAPE.num_layers)
        )
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, SHAPE.vocab)
        self.ref: Ref | None = None

    def _c(self, name: str, layer: int, t: torch.Tensor) -> None:
        if self.cap.wants(name, layer):
            self.cap.capture(name, layer, t)
        if self.ref is not None:
            self.ref[(name, layer)] = t.detach().clone()

    def forward(self, ids: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        self._c("token_ids", -1, ids)
        x = self.embed(ids)
        self._c("embed", -1, x)
        for n, b in enumerate(self.blocks):
            self._c("resid_pre", n, x)
            h = b["ln1"](x)
            self._c("ln1", n, h)
            a = b["attn"](h)
            self._c("attn_out", n, a)
            x = x + a
            self._c("resid_mid", n, x)
            h = b["ln2"](x)
            self._c("ln2", n, h)
            self._c("mlp_in", n, h)
            p = torch.nn.functional.gelu(b["up"](h))
            self._c("mlp_post", n, p)
            m = b["down"](p)
            self._c("mlp_out", n, m)
            x = x + m
        self._c("resid_final", -1, x)
        f = self.norm(x)
        self._c("final_ln", -1, f)
        logits = self.head(f if last is None else f[last]).float()
        self._c("final_logits", -1, logits)
        self.cap.join()  # the forward's end (its residuals are never changed in place)
        return logits


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy().tobytes()


class Expected:
    """What the records must hold, from reference clones and the plans."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, int], list[tuple[int, int, bytes]]] = defaultdict(list)

    def add(self, plan: CommitPlan, ref: Ref) -> None:
        for seg in plan.segments:
            t = ref[(seg.hook.name, seg.layer_no)].reshape(seg.source_rows, -1)
            kept = t[list(seg.source_index)] if seg.source_index else t[: seg.kept_rows]
            for sl in plan.slices(seg):
                data = _bytes(kept[sl.row_offset : sl.row_offset + sl.rows])
                self.rows[(sl.request_id, seg.hook.act_name, seg.layer_no)].append(
                    (sl.start, sl.end, data)
                )

    def verify(self, records: list[CaptureRecord]) -> int:
        got: dict[tuple[str, str, int], list[CaptureRecord]] = defaultdict(list)
        for r in records:
            got[(r.request_id, r.act_name, r.layer_no)].append(r)
        assert set(got) == set(self.rows), set(got) ^ set(self.rows)
        for key, want in self.rows.items():
            want_pos = [p for a, b, _ in want for p in range(a, b)]
            got_pos = [p for r in got[key] for p in range(r.start_token_idx, r.end_token_idx)]
            assert got_pos == want_pos, key
            assert b"".join(r.payload for r in got[key]) == b"".join(d for _, _, d in want), key
        return sum(r.rows for r in records)


def _transport(sink: MemorySink, payload: int = 64 << 20, selection: Selection = SELECTION,
               **opts: object) -> TorchCaptureTransport:
    # the selection the tests compare with torch.topk, whatever FlashInfer this host has
    # (and no compile of it within a test); FlashInfer's own tests are below
    opts.setdefault("topk_kernel", "none")
    return TorchCaptureTransport(
        capacity=RingCapacity(payload, payload, 65536), selection=selection, shape=SHAPE,
        max_graph_batch=8, sink=sink, run_id="gpu-run", device="cuda",
        options=TransportOptions(max_prefill_tokens=256, **opts),  # type: ignore[arg-type]
    )


def _model(t: TorchCaptureTransport) -> ToyModel:
    torch.manual_seed(0)
    return ToyModel(t.capturer).cuda().to(torch.bfloat16)


def _eager_step(t, model, expected, layout, step, ids, last=None, selection=SELECTION) -> None:
    plan = make_plan(layout, selection, SHAPE, padded=False)
    t.commit(plan, step=step)
    model.ref = {}
    with torch.no_grad():
        model(ids, last)
    t.seal()
    expected.add(plan, model.ref)
    model.ref = None


def _run_eager(t: TorchCaptureTransport, steps: int = 6, prompt: tuple[int, ...] = (5, 17, 3),
               selection: Selection = SELECTION):
    model = _model(t)
    expected = Expected()
    rids = [f"req{i}" for i in range(len(prompt))]
    total = sum(prompt)
    ids = torch.randint(0, SHAPE.vocab, (total,), device="cuda")
    last = torch.tensor([sum(prompt[: i + 1]) - 1 for i in range(len(prompt))], device="cuda")
    _eager_step(t, model, expected, BatchLayout.extend(rids, [0] * len(prompt), list(prompt)),
                1, ids, last, selection)
    for s in range(steps):
        ids = torch.randint(0, SHAPE.vocab, (len(rids),), device="cuda")
        layout = BatchLayout.decode(rids, [p + s + 1 for p in prompt])
        _eager_step(t, model, expected, layout, s + 2, ids, selection=selection)
    return expected


def test_eager_capture_equals_reference():
    sink = MemorySink()
    t = _transport(sink)
    expected = _run_eager(t)
    stats = t.stop()
    rows = expected.verify(sink.records)
    assert stats.rows == rows
    assert stats.stalls == 0


def test_direct_copies_into_page_locked_payloads_equal_reference():
    sink = MemorySink()
    t = _transport(sink, selection=DENSE, coalesce_decode=False)
    expected = _run_eager(t, selection=DENSE)
    stats = t.stop()
    assert expected.verify(sink.records) == stats.rows
    counters = t.drain_counters()
    assert counters["direct_items"] == 7  # the prefill and 6 decode steps
    assert counters["d2h_bytes"] == stats.bytes
    assert counters["pinned_buffers_reused"] >= 1  # reserved at startup, reused since
    assert t._drain.direct_pool._buffer(64).is_pinned()  # page-locked: async DMA into them


def _record_graph(model: ToyModel, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Ref]:
    """The model's decode graph for ``bucket`` rows, as SGLang records one: two warm-up
    passes on a side stream (no step committed, nothing stored), then the capture. Returns
    the graph, its static input ids and the reference clones it refreshes at each replay."""
    static_ids = torch.zeros(bucket, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model(static_ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.ref = {}
    with torch.cuda.graph(graph), torch.no_grad():
        model(static_ids)
    ref, model.ref = model.ref, None
    return graph, static_ids, ref


def test_strided_rows_are_copied_as_wide_elements_and_exact_on_the_device():
    # q, k and v reach the capture as column slices of SGLang's qkv
    qkv = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    for lo, hi, element in ((0, 2048, 8), (2048, 3072, 8), (3072, 4096, 8), (1, 2049, 2)):
        dst = torch.zeros(64, hi - lo, device="cuda", dtype=torch.bfloat16)
        assert copy_rows(dst, qkv[:, lo:hi]) == element
        assert torch.equal(dst, qkv[:, lo:hi])


def test_copies_in_pieces_with_a_limit_ahead_equal_reference():
    # window flushes, staging spans and direct chunks cut into 4 KiB pieces, at most two
    # queued on the drain's stream: the waits for the oldest piece run on real events
    for selection, coalesce in ((SELECTION, True), (DENSE, False)):
        sink = MemorySink()
        t = _transport(sink, selection=selection, coalesce_decode=coalesce,
                       copy_piece_bytes=4096, copies_ahead=2)
        expected = _run_eager(t, selection=selection)
        stats = t.stop()
        assert expected.verify(sink.records) == stats.rows
        counters = t.drain_counters()
        assert counters["d2h_pieces"] > 2
        assert 0 <= counters["d2h_ahead_waits"] <= counters["d2h_pieces"] - 2


def test_the_copy_kernel_leaves_pageable_destinations_to_the_copy_engine():
    ops = DeviceOps("cuda", copy_kernel_programs=8)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    pageable = torch.zeros(1 << 20, dtype=torch.uint8)
    ops.to_host(pinned, src)
    ops.to_host(pageable, src)
    torch.cuda.synchronize()
    assert torch.equal(pinned, src.cpu())
    assert torch.equal(pageable, src.cpu())
    assert (ops.copy_pieces, ops.kernel_copies, ops.kernel_declined) == (2, 1, 1)


def test_copies_with_gaps_between_pieces_equal_reference():
    # DMX_DRAIN_COPY_GAPS: a tiny kernel after each piece on the drain's stream
    sink = MemorySink()
    t = _transport(sink, copy_piece_bytes=4096, copy_gaps=True)
    expected = _run_eager(t)
    stats = t.stop()
    assert expected.verify(sink.records) == stats.rows
    counters = t.drain_counters()
    assert counters["d2h_gaps"] == counters["d2h_pieces"] > 2
    assert t._ops._gap is not None
    assert t._ops._gap[0].tolist() == [1, 1]  # the gaps ran


def test_all_pieces_and_gaps_go_in_one_call_and_each_gap_is_a_kernel():
    # to_host_all: torch._foreach_copy_ over device-to-host pieces and device gaps (mixed
    # devices: its one-copy-at-a-time path), in order on the drain's stream
    ops = DeviceOps("cuda", copy_piece_bytes=4096, copy_gaps=True)
    src = torch.randint(0, 256, (3, 4096), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(3, 4096, dtype=torch.uint8, pin_memory=True)
    other = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        ops.on_drain_stream([], lambda: ops.to_host_all([(dst, src), (other, src[1])]))
        ops.wait(ops.fence())
    assert torch.equal(dst, src.cpu())
    assert torch.equal(other, src[1].cpu())
    assert (ops.copy_pieces, ops.gaps) == (4, 4)
    on_device = sorted((e for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA),
                       key=lambda e: e.time_range.start)
    kinds = ["copy engine" if "Memcpy DtoH" in e.name else "kernel" if "copy" in e.name
             else e.name for e in on_device]
    assert kinds == ["copy engine", "kernel"] * 4, [e.name for e in on_device]


def test_copies_by_the_copy_kernel_equal_reference():
    # DMX_DRAIN_COPY_KERNEL: window flushes, staging spans and direct chunks stored into
    # page-locked memory by the GPU's cores, in pieces (unaligned offsets among them)
    for selection, coalesce in ((SELECTION, True), (DENSE, False)):
        sink = MemorySink()
        t = _transport(sink, selection=selection, coalesce_decode=coalesce,
                       copy_piece_bytes=4100, copies_ahead=2, copy_kernel_programs=16)
        expected = _run_eager(t, selection=selection)
        stats = t.stop()
        assert expected.verify(sink.records) == stats.rows
        counters = t.drain_counters()
        # every copy of the drain lands in page-locked memory: the kernel made them all
        assert counters["d2h_kernel_copies"] == counters["d2h_pieces"] > 2
        assert counters["d2h_kernel_declined"] == 0


@pytest.mark.parametrize("side", [False, True], ids=["in-line", "side-stream"])
def test_graph_replay_with_padding_stores_only_real_rows(side: bool) -> None:
    for strip in (True, False):
        sink = MemorySink()
        t = _transport(sink, strip=strip, side_stream=side)
        model = _model(t)
        bucket = 8
        graph, static_ids, ref = _record_graph(model, bucket)
        expected = Expected()
        for step, raw in enumerate((3, 4, 5, 6, 7, 8, 3, 8), start=1):
            rids = [f"r{i}" for i in range(raw)]
            # Padding rows hold other ids: they must never reach a record.
            static_ids.copy_(torch.randint(0, SHAPE.vocab, (bucket,), device="cuda"))
            layout = BatchLayout.decode(rids, [10 + step] * raw, padded_batch_size=bucket)
            plan = make_plan(layout, SELECTION, SHAPE, padded=True, strip=strip)
            t.commit(plan, step=step)
            graph.replay()
            t.seal()
            expected.add(plan, ref)  # reads the graph's clones before the next replay
        stats = t.stop()
        rows = expected.verify(sink.records)
        assert rows == stats.rows
        assert {r.request_id for r in sink.records} == {f"r{i}" for i in range(8)}
        print(f"strip={strip}: {stats}")


@pytest.mark.parametrize("side", [False, True], ids=["in-line", "side-stream"])
def test_graph_steps_waiting_in_arena_slots_arrive_exact(side: bool) -> None:
    """A lingering drain lets decode graph steps pile up in the arena's slots (the
    replays write the slot their commit selected; nothing is copied on the scheduler
    thread), and it takes several at once into its window, across the slots' wrap. The
    device runs behind the host (a matmul before each replay, nothing waits for it), so
    a copy that is not ordered after its replay, or a slot reused too early, shows."""
    sink = MemorySink()
    t = _transport(sink, linger_s=30.0, flush_timeout_s=60.0, side_stream=side)
    model = _model(t)
    bucket = 8
    graph, static_ids, ref = _record_graph(model, bucket)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    rids = [f"s{i}" for i in range(6)]
    steps: list[tuple[CommitPlan, Ref]] = []
    steps_run = ARENA_SLOTS_MAX + 24  # past the slots' wrap
    for step in range(1, steps_run + 1):
        for _ in range(8):
            torch.mm(a, a, out=b)
        static_ids.copy_(torch.randint(0, SHAPE.vocab, (bucket,), device="cuda"))
        layout = BatchLayout.decode(rids, [20 + step] * len(rids), padded_batch_size=bucket)
        plan = make_plan(layout, SELECTION, SHAPE, padded=True)
        t.commit(plan, step=step)
        graph.replay()
        t.seal()
        steps.append((plan, {k: v.clone() for k, v in ref.items()}))
    behind = not torch.cuda.current_stream().query()
    stats = t.stop()
    expected = Expected()
    for plan, snapshot in steps:
        expected.add(plan, snapshot)
    assert expected.verify(sink.records) == stats.rows
    counters = t.drain_counters()
    assert behind  # the host had queued replays the device had not run yet
    assert counters["slot_items"] + counters["slots_missed"] == steps_run
    assert counters["slot_items"] >= ARENA_SLOTS_MAX // 2
    print(f"{stats}; {counters}")


def test_ring_wraps_around_on_gpu():
    sink = MemorySink()
    t = _transport(sink, payload=1 << 20)  # steps of 0.2-0.6 MB
    expected = Expected()
    model = _model(t)
    for s in range(12):
        rid, n = f"w{s}", 40 + 7 * s
        ids = torch.randint(0, SHAPE.vocab, (n,), device="cuda")
        _eager_step(t, model, expected, BatchLayout.extend([rid], [0], [n]), s + 1, ids,
                    torch.tensor([n - 1], device="cuda"))
    stats = t.stop()
    expected.verify(sink.records)
    assert stats.bytes > 3 * (1 << 20)
    assert stats.ring_high_water <= 1 << 20


class GateSink(MemorySink):
    """A stuck store: every ``put`` blocks until the gate opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def put(self, records):
        self.blocked.set()
        self.gate.wait()
        super().put(records)


def _open_once_full(t: TorchCaptureTransport, sink: GateSink, hold_s: float) -> None:
    """Open the gate ``hold_s`` after the drain is stuck and the ring is nearly full."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sink.blocked.is_set() and t._alloc.usage().free_bytes < 32 << 10:
            break
        time.sleep(0.002)
    time.sleep(hold_s)
    sink.gate.set()


def test_slow_sink_forces_backpressure_without_loss():
    # The drain frees a step's ring space before it calls put; stuck in a put it frees
    # nothing more, so once the 128 KiB ring is full the producer has to wait (or go
    # piecewise, waiting between pieces) until the store moves again: 41 steps of ~15 KB
    # cannot all fit. Deterministic however fast the drain is (with a merely slow sink
    # the H200's drain kept up: no stall).
    sink = GateSink()
    t = _transport(sink, payload=128 << 10, coalesce_decode=False)  # ~15 KB per decode step
    opener = threading.Thread(target=_open_once_full, args=(t, sink, 0.5), daemon=True)
    opener.start()
    expected = _run_eager(t, steps=40)
    stats = t.stop()
    opener.join()
    expected.verify(sink.records)
    assert stats.stalls + stats.piecewise_steps > 0, stats
    assert stats.stall_seconds > 0.3, stats  # the producer waited out most of the hold
    assert stats.ring_high_water <= 128 << 10
    print(stats)


def test_prefill_larger_than_the_free_ring_is_committed_piecewise():
    sink = MemorySink(delay_s=0.005)
    t = _transport(sink, payload=1 << 20)
    expected = _run_eager(t, steps=2, prompt=(250,))  # ~1.25 MB in one step
    stats = t.stop()
    expected.verify(sink.records)
    assert stats.piecewise_steps == 1, stats


RULED: Selection = parse_selection(
    "resid_pre:positions(12-14),mlp_out:every(2),final_ln:positions(0-13),final_logits").resolve(
    ModelHooks("ToyForCausalLM", frozenset(HOOKS), SHAPE.num_layers))


def _replays(t: TorchCaptureTransport, selection: Selection,
             seq_lens: Callable[[int, int], list[int]],
             stored: Callable[[Ref], Ref] = lambda ref: ref, **plan_args: Any) -> Expected:
    """Decode graph replays of 3, 5, 8, 8, 6 and 8 requests in a bucket of 8 (random ids
    in the padding rows), ``seq_lens(step, requests)`` long; what the records must hold,
    from the reference clones each replay refreshes (``stored``: as the capture stores
    them)."""
    bucket = 8
    graph, static_ids, ref = _record_graph(_model(t), bucket)
    expected = Expected()
    for step, raw in enumerate((3, 5, 8, 8, 6, 8), start=1):
        static_ids.copy_(torch.randint(0, SHAPE.vocab, (bucket,), device="cuda"))
        layout = BatchLayout.decode([f"r{i}" for i in range(raw)], seq_lens(step, raw),
                                    padded_batch_size=bucket)
        plan = make_plan(layout, selection, SHAPE, padded=True, **plan_args)
        t.commit(plan, step=step)
        graph.replay()
        t.seal()
        expected.add(plan, stored(ref))  # reads the clones before the next replay
    return expected


def test_graph_replay_drops_left_out_requests_and_positions_on_the_device():
    sink = MemorySink()
    t = _transport(sink, selection=RULED)
    skip = frozenset({"r1", "r4"})
    expected = _replays(t, RULED, lambda step, raw: [10 + step + i for i in range(raw)],
                        skip=skip)
    stats = t.stop()
    assert expected.verify(sink.records) == stats.rows
    assert not skip & {r.request_id for r in sink.records}
    resid = {(r.start_token_idx, r.end_token_idx) for r in sink.records
             if r.act_name.endswith("resid_pre")}
    assert resid
    assert all(a >= 12 and b <= 15 for a, b in resid)


MODIFIED: Selection = parse_selection(
    "resid_pre:fp16,mlp_out@1:bf16,final_ln:bf16,final_logits:generated:topk(5)").resolve(
    ModelHooks("ToyForCausalLM", frozenset(HOOKS), SHAPE.num_layers))


def _as_stored(ref: Ref, selection: Selection) -> Ref:
    """The reference clones with the selection's payloads applied (casts, top K)."""
    out: Ref = {}
    for hook, layer in selection.captures():
        payload = selection.payload_of(hook.name, layer)
        if hook.derived:
            top = torch.topk(ref[("final_logits", -1)], payload.topk, dim=-1)
            out[(hook.name, layer)] = (top.indices.to(torch.int32) if hook.is_integer
                                       else top.values)
            continue
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
            payload.dtype.value if payload.dtype else "", ref[(hook.name, layer)].dtype)
        out[(hook.name, layer)] = ref[(hook.name, layer)].to(dtype)
    return out


def test_graph_replay_stores_cast_rows_and_the_top_logits():
    sink = MemorySink()
    t = _transport(sink, selection=MODIFIED)
    prompts = {f"r{i}": 10 for i in range(8)}
    overflows = [0]  # what each replay's fp16 casts overflowed, padding rows included

    def stored(ref: Ref) -> Ref:
        for (name, layer), tensor in ref.items():
            dtype = MODIFIED.payload_of(name, layer).dtype
            if dtype is not None and dtype.value == "fp16":
                half = tensor.to(torch.float16)
                overflows[0] += int((half.isinf() & ~tensor.isinf()).sum())
        return _as_stored(ref, MODIFIED)

    expected = _replays(t, MODIFIED, lambda step, raw: [10 + step] * raw, stored,
                        prompts=prompts.get)
    stats = t.stop()
    assert expected.verify(sink.records) == stats.rows
    dtypes = {r.act_name: r.dtype for r in sink.records}
    assert dtypes == {"blocks.hook_resid_pre": "torch.float16",
                      "blocks.hook_mlp_out": "torch.bfloat16",
                      "hook_final_ln": "torch.bfloat16",
                      "logits_topk_values": "torch.float32",
                      "logits_topk_ids": "torch.int32"}
    assert stats.fp16_overflows == overflows[0]  # the reference's count, to the value


LASTING: Selection = parse_selection(
    "resid_pre:last,mlp_out@2,final_logits:last:topk(4)").resolve(
    ModelHooks("ToyForCausalLM", frozenset(HOOKS), SHAPE.num_layers))


@pytest.mark.parametrize("side", [False, True], ids=["in-line", "side-stream"])
def test_graph_replay_keeps_the_last_rows_in_device_slots_until_requests_finish(
        side: bool) -> None:
    """Decode graphs of two buckets (sharing the slot index) replay a batch that
    shrinks from 6 requests to 4; each replay moves every request to its next slot row by
    itself; replays nobody committed write the spare row."""
    sink = MemorySink()
    t = _transport(sink, selection=LASTING, side_stream=side)
    model = _model(t)
    graphs = {b: _record_graph(model, b) for b in (8, 4)}
    seen: dict[tuple[str, str, int, int], bytes] = {}
    live = {f"r{i}": 20 + i for i in range(6)}  # request -> its next position
    finished: dict[str, int] = {}
    for step in range(1, 11):
        rids = sorted(live)
        bucket = 4 if len(rids) <= 4 else 8
        graph, static_ids, ref = graphs[bucket]
        static_ids.copy_(torch.randint(0, SHAPE.vocab, (bucket,), device="cuda"))
        layout = BatchLayout.decode(rids, [live[r] + 1 for r in rids], padded_batch_size=bucket)
        plan = make_plan(layout, LASTING, SHAPE, padded=True)
        t.commit(plan, step=step)
        graph.replay()
        t.seal()
        stored = _as_stored(ref, LASTING)
        for i, rid in enumerate(rids):
            for hook, layer in LASTING.captures():
                seen[(rid, hook.act_name, layer, live[rid])] = _bytes(
                    stored[(hook.name, layer)][i])
        for rid in rids:
            live[rid] += 1
        if step in (2, 6):  # a replay nobody committed, within a run: writes the spare row
            t.uncommitted_replay()
            static_ids.copy_(torch.randint(0, SHAPE.vocab, (bucket,), device="cuda"))
            graph.replay()
        if step in (3, 5, 7):  # one request finishes; this step was its extra forward
            rid = sorted(live)[0]
            end = live.pop(rid) - 1
            t.finish_request(rid, end)
            finished[rid] = end
            if step == 3:
                live[f"n{step}"] = 40  # a new request takes its slot
    stats = t.stop()
    last_rows = {(r.request_id, r.act_name, r.layer_no, r.start_token_idx): r.payload
                 for r in sink.records if not r.act_name.endswith("mlp_out")}
    want = {(rid, hook.act_name, layer, end - 1): seen[(rid, hook.act_name, layer, end - 1)]
            for rid, end in finished.items() for hook, layer in LASTING.captures()
            if hook.name != "mlp_out"}
    assert last_rows == want
    assert stats.fp16_overflows == 0


@pytest.mark.parametrize("decodes", [0, 2], ids=["decided-by-the-prefill", "by-a-decode"])
def test_eager_forwards_keep_the_last_rows_in_device_slots(decodes: int) -> None:
    """Eager forwards (a prefill, then ``decodes`` decode steps) write the rows that decide
    tokens into the slots (a prefill's: each request's last prompt row); a finished
    request's rows are read out one group at a time. Each equals the reference's row."""
    sink = MemorySink()
    t = _transport(sink, selection=LASTING)
    model = _model(t)
    requests = 5
    prompt = [3 + i for i in range(requests)]
    rids = [f"r{i}" for i in range(requests)]
    seen: dict[tuple[str, str, int, int], bytes] = {}

    def step(n: int, layout: BatchLayout, ids: torch.Tensor, last: torch.Tensor | None,
             rows: list[int]) -> None:
        t.commit(make_plan(layout, LASTING, SHAPE, padded=False), step=n)
        model.ref = {}
        with torch.no_grad():
            model(ids, last)
        t.seal()
        stored = _as_stored(model.ref, LASTING)
        for i, rid in enumerate(rids):
            position = layout.starts[i] + layout.counts[i] - 1
            for hook, layer in LASTING.captures_kept_by(PositionRule.LAST):
                tensor = stored[(hook.name, layer)]
                row = tensor[i] if hook.row_basis is RowBasis.REQUEST else tensor[rows[i]]
                seen[(rid, hook.act_name, layer, position)] = _bytes(row)
        model.ref = None

    ends = [sum(prompt[: i + 1]) - 1 for i in range(requests)]
    step(1, BatchLayout.extend(rids, [0] * requests, prompt),
         torch.randint(0, SHAPE.vocab, (sum(prompt),), device="cuda"),
         torch.tensor(ends, device="cuda"), ends)
    for s in range(decodes):
        step(s + 2, BatchLayout.decode(rids, [p + s + 1 for p in prompt]),
             torch.randint(0, SHAPE.vocab, (requests,), device="cuda"), None,
             list(range(requests)))
    for rid, p in zip(rids, prompt, strict=True):
        t.finish_request(rid, p + decodes)  # its last token decided by p - 1 + decodes
    t.stop()
    got = {(r.request_id, r.act_name, r.layer_no, r.start_token_idx): r.payload
           for r in sink.records if not r.act_name.endswith("mlp_out")}
    decided = {rid: p - 1 + decodes for rid, p in zip(rids, prompt, strict=True)}
    assert got == {(rid, hook.act_name, layer, decided[rid]):
                   seen[(rid, hook.act_name, layer, decided[rid])]
                   for rid in rids for hook, layer in LASTING.captures_kept_by(PositionRule.LAST)}
    assert len(got) == requests * len(LASTING.captures_kept_by(PositionRule.LAST))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_topk_kernel_warms_up_on_the_gpu(dtype: torch.dtype) -> None:
    """The start-up check of ``DMX_TOPK_KERNEL`` passes on the GPU for topk(64) over
    Qwen3's logits in each float dtype (its rows hold ties, NaN and infinities)."""
    from dmi_sglang.adapters.transport.topk_kernel import warm_up

    assert warm_up(torch.device("cuda"), 151936, 64, 128, dtype=dtype, batches=(3, 64)) is None
    assert warm_up(torch.device("cuda"), 151936, 64, 64, dtype=dtype, batches=(3, 64)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flashinfer_topk_warms_up_on_the_gpu(dtype: torch.dtype) -> None:
    """The start-up check of ``DMX_TOPK_KERNEL=flashinfer`` passes on the GPU for
    topk(64) over Qwen3's logits (float32 in SGLang; ties, NaN and infinities). Over
    bfloat16 rows FlashInfer's selection differed from ``torch.topk``'s on an H100, and
    the check refuses it there (docs/settings.md)."""
    from dmi_sglang.adapters.transport.topk_flashinfer import warm_up

    assert warm_up(torch.device("cuda"), 151936, 64, dtype=dtype,
                   batches=(1, 3, 8, 16, 64)) is None


def test_flashinfer_topk_over_bfloat16_is_checked_before_it_is_used() -> None:
    """Over bfloat16 logits FlashInfer's selection may differ from ``torch.topk``'s (it
    did on an H100): where the start-up check finds a difference, the transport refuses
    ``DMX_TOPK_KERNEL=flashinfer`` naming the setting, instead of recording it."""
    from dmi_sglang.adapters.transport._transport import _check_topk_kernel
    from dmi_sglang.adapters.transport.topk_flashinfer import warm_up
    from dmi_sglang.errors import UnsupportedConfigurationError

    device = torch.device("cuda")
    differs = warm_up(device, 151936, 64, dtype=torch.bfloat16, batches=(3, 64)) is not None
    refused = pytest.raises(UnsupportedConfigurationError, match="DMX_TOPK_KERNEL=flashinfer")
    with refused if differs else contextlib.nullcontext():  # else: selects as torch.topk
        _check_topk_kernel("flashinfer", device, 151936, 64, chunk=0, dtype=torch.bfloat16,
                           batches=(3, 64))


@pytest.mark.parametrize(("kernel", "chunk"), [
    ("none", 0), ("none", 128), ("none", 100), ("triton", 128), ("triton", 64),
    ("flashinfer", 0)])
def test_chunked_topk_replayed_in_a_graph_finds_torch_topk_values(kernel: str,
                                                                  chunk: int) -> None:
    """The top-k selection as a decode graph records it (``chunked_topk``, or with
    ``DMX_TOPK_KERNEL`` ``fused_topk`` or ``flashinfer_topk``): every replay over new
    logits in the same buffer finds torch.topk's values, and its indices name them."""
    from dmi_sglang.adapters.transport._capturer import SELECTIONS

    select = SELECTIONS[kernel]
    logits = torch.zeros(64, 151936, device="cuda")
    select(logits, 64, chunk)  # warm-up outside the recording (compiled)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, ids = select(logits, 64, chunk)
    for seed in range(3):
        logits.copy_(torch.randn(64, 151936, device="cuda",
                                 generator=torch.Generator("cuda").manual_seed(seed)))
        logits[seed, -10:] = 1e6  # the largest in the last columns (the tail, for 100)
        graph.replay()
        expected, _ = torch.topk(logits, 64, dim=-1)
        assert torch.equal(values, expected)
        assert torch.equal(torch.gather(logits, 1, ids), values)
