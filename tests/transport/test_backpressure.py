"""Backpressure: waits for the drain, piecewise commits, forced eager, wrap-around."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from dmi_sglang.domain.capacity import Decision
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.testing import MemorySink

from .conftest import rows_tensor  # type: ignore[import-not-found]

# resid_pre: 3 layers x 8 bf16 = 16 bytes per row and layer.


def _prefill(rid: str, n: int) -> BatchLayout:
    return BatchLayout.extend([rid], [0], [n])


def test_slow_sink_makes_steps_wait_and_loses_nothing(make_driver):
    sink = MemorySink(delay_s=0.02)
    d, _ = make_driver("resid_pre", payload_bytes=4096, sink=sink, max_prefill_tokens=40,
                       coalesce_decode=False)
    for i in range(8):
        d.forward(_prefill(f"r{i}", 40))  # 3 x 640 bytes: two steps fill the ring
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.stalls > 0
    assert stats.stall_seconds > 0
    assert stats.ring_high_water <= 4096


def test_prefill_larger_than_the_ring_is_committed_piecewise(make_driver):
    sink = MemorySink(delay_s=0.01)
    d, _ = make_driver("resid_pre,token_ids", payload_bytes=2048, sink=sink,
                       max_prefill_tokens=100)
    d.forward(_prefill("long", 100))  # 3 x 1600 + 800 bytes > 2048: one piece at a time
    d.forward(BatchLayout.decode(["long"], [101]))
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.piecewise_steps == 1
    assert stats.stalls >= 1
    # the parts' waits are the stalls' (the decode step fits the ring once they drained)
    assert 0 < stats.piecewise_stall_seconds <= stats.stall_seconds
    assert {r.seq for r in sink.records if r.start_token_idx == 0} == {1}


def test_padded_step_that_does_not_fit_runs_eager(make_driver):
    # With padding strip off the padded plan holds 64 rows per layer (3 x 1024 bytes).
    d, sink = make_driver("resid_pre", payload_bytes=2048, max_graph_batch=64, strip=False)
    d.graph_capture(64)
    layout = BatchLayout.decode(["a", "b", "c"], [5, 6, 7], padded_batch_size=64)
    assert d.forward(layout, padded=True, strip=False) is Decision.RUN_EAGER
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.forced_eager == 1


class GateSink(MemorySink):
    """Blocks every put until the gate opens (a stuck store)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def put(self, records):
        self.blocked.set()
        self.gate.wait()
        super().put(records)


def _open_once_full(d, sink: GateSink, step_bytes: int, hold_s: float) -> None:
    """Open the gate ``hold_s`` after the drain is stuck and a step no longer fits."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sink.blocked.is_set() and d.t._room().free_bytes < step_bytes:
            break
        time.sleep(0.002)
    time.sleep(hold_s)
    sink.gate.set()


def test_padded_step_waits_for_the_drain_when_it_fits_an_empty_ring(make_driver):
    # The drain frees a step's ring space before its put; stuck in a put it frees nothing
    # more, so the third step has to wait until the store moves (timed from that moment,
    # not from set-up, however slow the machine).
    sink = GateSink()
    d, _ = make_driver("resid_pre", payload_bytes=1024, max_graph_batch=8,
                       max_prefill_tokens=16, coalesce_decode=False, sink=sink)
    d.graph_capture(8)
    opener = threading.Thread(target=_open_once_full, args=(d, sink, 3 * 128, 0.2), daemon=True)
    opener.start()
    rids = [f"r{i}" for i in range(8)]
    decisions = []
    for n in range(5):  # 3 x 128 bytes each: at most two steps in the ring
        layout = BatchLayout.decode(rids, [5 + n] * 8, padded_batch_size=8)
        decisions.append(d.forward(layout, padded=True))
    stats = d.t.stop()
    opener.join()
    d.verify(sink.records)
    assert Decision.WAIT_FOR_DRAIN in decisions
    assert stats.stalls >= 1
    assert stats.stall_seconds > 0.1  # the producer waited out most of the hold
    assert stats.forced_eager == 0


def test_padded_commit_too_large_for_the_ring_is_moved_piecewise_at_seal(make_driver):
    d, sink = make_driver("resid_pre", payload_bytes=2048, max_graph_batch=64)
    d.graph_capture(64)
    layout = BatchLayout.decode(["a", "b"], [5, 6], padded_batch_size=64)
    plan = d.plan(layout, padded=True, strip=False)  # 3 x 1024 bytes > 2048
    d.t.commit(plan, step=1)
    d.fire(layout, padding=62)
    d.t.seal()
    stats = d.t.stop()
    assert stats.piecewise_steps == 1
    assert sorted((r.request_id, r.layer_no) for r in sink.records) == sorted(
        (rid, layer) for rid in "ab" for layer in range(3)
    )


def test_ring_wraps_around(make_driver):
    d, sink = make_driver("resid_pre,final_logits", payload_bytes=1024, max_prefill_tokens=16,
                          coalesce_decode=False)
    bases: list[int] = []
    put = d.t._drain.put

    def spy(item):
        bases.append(item.base)
        assert item.base + item.nbytes <= 1024
        put(item)

    d.t._drain.put = spy  # type: ignore[method-assign]
    d.t._writer._enqueue = spy
    for i in range(30):
        d.forward(_prefill(f"p{i}", 1 + i % 7))
    d.t.stop()
    d.verify(sink.records)
    wraps = sum(1 for a, b in itertools.pairwise(bases) if b < a)
    assert wraps >= 3


def test_task_entries_bound_tensors_in_flight(make_driver):
    sink = MemorySink(delay_s=0.01)
    d, _ = make_driver("resid_pre", payload_bytes=1 << 16, entries=4, sink=sink,
                       coalesce_decode=False)
    for i in range(5):
        d.forward(_prefill(f"r{i}", 3))  # 3 tensors per step, 4 entries: one step at a time
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.stalls >= 1


# resid_pre, attn_out and mlp_out: 9 capture points of 63 x 16 = 1,008 bytes; 9,072 bytes
# do not fit an 8,192-byte ring, whose parts take 2,048 bytes at most: two capture points.
_PARTS = "resid_pre,attn_out,mlp_out"


def _fire_in(d, layout: BatchLayout, order: list[tuple[str, int]]) -> None:
    """Commit ``layout`` and fire its capture points in ``order`` (then seal)."""
    d.step += 1
    plan = d.plan(layout)
    d.t.commit(plan, step=d.step)
    for name, layer in order:
        d.t.capturer.capture(name, layer, rows_tensor(hook_by_name(name), layer,
                                                      layout.positions()))
    d.t.seal()
    for seg in plan.segments:
        for sl in plan.slices(seg):
            d.expected[(sl.request_id, seg.hook.act_name, seg.layer_no)].append(
                (sl.start, sl.end))


def test_a_piecewise_prefill_moves_runs_of_capture_points_as_one_item(make_driver):
    d, sink = make_driver(_PARTS, payload_bytes=8192, max_prefill_tokens=63)
    d.forward(_prefill("long", 63))
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.piecewise_steps == 1
    # parts of 2, 2, 2, 2 and 1 capture points (an empty ring: room never runs short)
    assert d.t.drain_counters()["direct_items"] == 5


def _in_reservation_order(d) -> list[int]:
    """Track the transport: the ring offsets it reserves, and the bases of the items its
    steps hand to the drain, each in order (filled as it runs)."""
    reserved: list[int] = []
    handed: list[int] = []
    alloc, writer = d.t._alloc, d.t._writer
    reserve, enqueue = alloc.reserve, writer._enqueue

    def tracked_reserve(nbytes: int, entries: int = 1) -> int | None:
        base = reserve(nbytes, entries)
        if base is not None:
            reserved.append(base)
        return base

    def tracked_enqueue(item) -> None:
        handed.append(item.base)
        enqueue(item)

    alloc.reserve, writer._enqueue = tracked_reserve, tracked_enqueue
    return reserved, handed


@pytest.mark.parametrize("order", ["swapped", "reversed", "one late"])
def test_a_piecewise_prefill_fired_out_of_order_stores_every_row(make_driver, order):
    d, sink = make_driver(_PARTS, payload_bytes=8192, max_prefill_tokens=63,
                          stall_timeout_s=5)
    reserved, handed = _in_reservation_order(d)
    points = [(h.name, layer) for h, layer in d.selection.capture_points()]
    fired = {"swapped": [points[1], points[0], *points[2:]],
             "reversed": points[::-1],
             # the first part waits for its second point while the ring fills up
             "one late": [points[0], *points[2:], points[1]]}[order]
    _fire_in(d, _prefill("a", 63), fired)
    _fire_in(d, _prefill("b", 63), fired)
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.piecewise_steps == 2
    assert stats.stall_seconds < 1  # never waited out a reservation that waits itself
    assert handed == reserved  # the ring frees in order: items go in reservation order
    assert d.t._alloc.live_regions == 0


def test_an_aborted_piecewise_prefill_frees_its_parts(make_driver):
    d, sink = make_driver(_PARTS, payload_bytes=8192, max_prefill_tokens=63)
    points = [(h.name, layer) for h, layer in d.selection.capture_points()]
    layout = _prefill("gone", 63)
    d.t.commit(d.plan(layout), step=1)
    for name, layer in points[:3]:  # the first part is handed over, the second not
        d.t.capturer.capture(name, layer, rows_tensor(hook_by_name(name), layer,
                                                      layout.positions()))
    d.t.abort()
    d.step = 1
    d.forward(_prefill("next", 63))
    d.t.stop()
    assert d.t._alloc.live_regions == 0  # the open part's region was freed too
    kept = {(r.act_name, r.layer_no) for r in sink.records if r.request_id == "gone"}
    assert kept == {(hook_by_name(n).act_name, layer) for n, layer in points[:2]}
    d.verify([r for r in sink.records if r.request_id != "gone"])


def test_a_part_never_takes_more_task_entries_than_are_free(make_driver):
    d, sink = make_driver(_PARTS, payload_bytes=8192, entries=1, max_prefill_tokens=63)
    d.forward(_prefill("long", 63))  # one tensor in flight at a time: parts of one
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.piecewise_steps == 1
    assert d.t.drain_counters()["direct_items"] == 9
