"""Decode graph steps wait in arena slots for the drain, which copies them out.

The scheduler thread queues no copies for a replayed step: each replay writes the arena
slot its commit selected, and the drain thread moves the rows to the ring later. These
tests hold the drain back so several steps wait in their slots at once; they run with
the arena's slots only.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from dmi_sglang.adapters.transport._arena import Arena
from dmi_sglang.adapters.transport._device import DeviceOps
from dmi_sglang.domain.capacity import ARENA_SLOTS_BUDGET, ARENA_SLOTS_MAX, arena_slots
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.errors import CaptureError
from dmi_sglang.testing import MemorySink

from .conftest import SHAPE, Driver, arena_slot_reader, rows_tensor, select


def _start(d: Driver, bucket: int = 4) -> None:
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    d.graph_capture(bucket)


def _decode(d: Driver, n: int) -> None:
    d.forward(BatchLayout.decode(["a", "b"], [6 + n, 4 + n], padded_batch_size=4), padded=True)


SLOTTED = pytest.mark.parametrize("make_driver", ["slots"], indirect=True)
SLOTS = ARENA_SLOTS_MAX
"""The slots of the ``slots`` driver's arena (its steps are small: as many as allowed)."""


def _decode_steps(d: Driver, steps: int) -> None:
    for n in range(steps):
        _decode(d, n)


def test_the_slot_count_follows_the_arena_size():
    assert arena_slots(1 << 20) == ARENA_SLOTS_MAX == 32
    assert arena_slots(ARENA_SLOTS_BUDGET // 30) == 28  # and the spare and the landing slot
    assert arena_slots(ARENA_SLOTS_BUDGET // 7) == 5  # and the spare and the landing slot
    assert arena_slots(ARENA_SLOTS_BUDGET // 5) == 1  # too few to wait in: one slot
    assert arena_slots(ARENA_SLOTS_BUDGET // 7, budget_bytes=0) == 1
    assert arena_slots(0) == ARENA_SLOTS_MAX


def _forty_lingered_steps(make_driver, skip: frozenset[str] = frozenset(),
                          **options: object) -> dict[str, float]:
    """40 decode graph steps of requests a and b (less ``skip``) while the drain lingers
    30 s: every row exact, several steps per wake-up (half the slots waiting wakes the
    drain; a step that finds its slot still waiting, as these back-to-back ones may, is
    copied out at its seal). Returns the drain's counters."""
    d, sink = make_driver("resid_pre,final_logits", payload_bytes=1 << 20, linger_s=30.0,
                          **options)
    _start(d)
    d.skip = skip
    _decode_steps(d, 40)
    d.t.stop()
    d.verify(sink.records)
    counters = d.t.drain_counters()
    assert counters["slot_items"] + counters["slots_missed"] == 40
    assert counters["slot_items"] >= 16
    assert counters["slot_rounds"] <= 40 // 2
    return counters


@SLOTTED
def test_steps_wait_in_their_slots_while_the_drain_lingers_and_arrive_exact(make_driver):
    counters = _forty_lingered_steps(make_driver, flush_timeout_s=60.0)
    assert counters["window_appends"] <= 40 // 2  # one copy per group for several steps


@SLOTTED
def test_steps_staged_from_the_ring_wait_in_their_slots_too(make_driver):
    # no decode window, and a request left out (the device gathers the kept rows): each
    # step is copied from its slot to the ring, then to the host, several per wake-up
    counters = _forty_lingered_steps(make_driver, frozenset({"b"}), coalesce_decode=False)
    assert counters["window_appends"] == 0


class _HeldSink(MemorySink):
    """A sink whose first ``put`` blocks until released (the drain stops with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def put(self, batch: object) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30)
        super().put(batch)  # type: ignore[arg-type]


@SLOTTED
def test_a_step_whose_slot_still_waits_is_copied_out_at_seal_without_waiting(make_driver):
    sink = _HeldSink()
    d, _ = make_driver("resid_pre", payload_bytes=1 << 20, sink=sink, coalesce_decode=False)
    _start(d)
    assert sink.entered.wait(10)  # the drain holds the prefill's batch in put
    _decode_steps(d, SLOTS + 8)  # more steps than slots: the last 8 find them all waiting
    assert d.t.drain_counters()["slots_missed"] >= 8
    sink.release.set()
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.stalls == 0


def _prefill_drained(d: Driver) -> None:
    """Wait until the drain handed the prefill's records over (it lingers for nothing
    else then, so the next decode step waits in its slot)."""
    deadline = time.monotonic() + 10
    while d.t.drain_counters()["records"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _garbage(d: Driver) -> None:
    """What a graph replay records into the arena, whatever the slot it names."""
    hook = hook_by_name("resid_pre")
    for layer in range(SHAPE.num_layers):
        garbage = torch.full_like(rows_tensor(hook, layer, [("x", 0)] * 4), 77)
        d.t._arena.write(("resid_pre", layer), garbage)


@SLOTTED
def test_a_replay_no_step_committed_writes_the_spare_slot(make_driver):
    d, sink = make_driver("resid_pre", payload_bytes=1 << 20, linger_s=30.0,
                          flush_timeout_s=60.0)
    _start(d)
    _prefill_drained(d)
    _decode(d, 0)  # waits in its slot: the drain lingers
    assert d.t._turns.busy[0]
    d.t.uncommitted_replay()
    _garbage(d)
    d.t.stop()
    d.verify(sink.records)  # the waiting step's rows are intact


@SLOTTED
def test_missed_steps_spare_writers_and_an_abort_leave_every_row_exact(make_driver):
    sink = _HeldSink()
    d, _ = make_driver("resid_pre", payload_bytes=1 << 20, sink=sink)
    _start(d)
    assert sink.entered.wait(10)  # the drain holds the prefill's batch in put
    _decode_steps(d, SLOTS)  # every slot waits
    _decode(d, SLOTS)  # missed: writes the spare, copied out at its seal
    d.t.uncommitted_replay()
    _garbage(d)  # the spare overwritten after that copy
    d.skip = frozenset({"a", "b"})
    _decode(d, SLOTS + 1)  # stores nothing: the spare again
    d.skip = frozenset()
    _garbage(d)
    plan = d.plan(BatchLayout.decode(["a", "b"], [99, 99], padded_batch_size=4), padded=True)
    d.step += 1
    d.t.commit(plan, step=d.step)
    d.t.abort()  # a missed step aborted: nothing to free, no turn taken
    assert (d.t._turns.count, d.t._turns.next) == (SLOTS, 0)
    _decode(d, SLOTS + 2)
    assert d.t.drain_counters()["slots_missed"] == 3
    sink.release.set()
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.stalls == 0
    assert d.t._turns.count == 0


@SLOTTED
def test_a_padded_step_that_stores_nothing_writes_the_spare_slot(make_driver):
    d, sink = make_driver("resid_pre", payload_bytes=1 << 20, linger_s=30.0,
                          flush_timeout_s=60.0)
    _start(d)
    _decode(d, 0)
    d.skip = frozenset({"a", "b"})  # the next step's plan stores nothing
    _decode(d, 1)
    d.skip = frozenset()
    assert d.t._arena.spare == d.t._turns.selected
    d.t.stop()
    d.verify(sink.records)


def test_arena_writes_go_to_the_selected_slot():
    """Capture points write the landing slot; once every place was written, one copy
    moves it into the selected slot (a graph records it after its last capture point).
    An eager step that wrote only some places has them moved at ``settle``."""
    selection = select("resid_pre")
    arena = Arena(selection, SHAPE, 4, DeviceOps("cpu"), slots=4)
    hook = hook_by_name("resid_pre")
    keys = [("resid_pre", layer) for layer in range(3)]
    first = {k: rows_tensor(hook, k[1], [("a", 1), ("b", 2)]) for k in keys}
    second = {k: rows_tensor(hook, k[1], [("c", 3), ("d", 4), ("e", 5)]) for k in keys}
    slot = arena_slot_reader(arena, first[keys[0]][0].numel())
    arena.select(1)
    for key in keys[:2]:
        arena.write(key, first[key])
    assert not torch.equal(slot(1, keys[0], 2), first[keys[0]])  # still landed only
    arena.write(keys[2], first[keys[2]])  # the last place: the landing slot moves
    assert all(torch.equal(slot(1, k, 2), first[k]) for k in keys)
    arena.select(arena.spare)
    arena.write(keys[1], second[keys[1]])  # an eager step storing one capture
    arena.settle()
    assert torch.equal(slot(arena.spare, keys[1], 3), second[keys[1]])
    assert all(torch.equal(slot(1, k, 2), first[k]) for k in keys)  # slot 1 untouched
    assert arena.spare == 4
    assert arena.buffer.numel() == 5 * arena.slot_bytes
    assert arena.device_bytes == 6 * arena.slot_bytes  # and the landing slot


def test_a_graph_recorded_without_a_capture_point_fails_before_its_replays_store():
    """A decode graph whose recording missed a capture point holds no move of the
    landing slot: the next recording, or the next step, raises instead of storing rows
    its slot never received."""
    selection = select("resid_pre")
    arena = Arena(selection, SHAPE, 4, DeviceOps("cpu"), slots=4)
    hook = hook_by_name("resid_pre")
    rows = {layer: rows_tensor(hook, layer, [("a", 1)]) for layer in range(3)}
    arena.write(("resid_pre", 0), rows[0])
    arena.write(("resid_pre", 1), rows[1])  # layer 2 never recorded
    with pytest.raises(CaptureError,
                       match=r"recorded without the capture points \[\('resid_pre', 2\)\]"):
        arena.check_landing()
    arena.check_landing()  # reported once
    arena.write(("resid_pre", 0), rows[0])
    with pytest.raises(CaptureError, match=r"written twice before the arena's landing"):
        arena.write(("resid_pre", 0), rows[0])


def test_a_partly_recorded_decode_graph_fails_the_next_step_even_after_an_abort(make_driver):
    """A recording that missed a capture point leaves rows in the landing slot: the next
    padded commit raises (an abort of an unrelated step in between does not hide it)."""
    d, _ = make_driver()
    if not d.t._arena.landing:
        pytest.skip("one slot: the capture points write it directly")
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.capturing = True
    try:
        d.fire(BatchLayout.decode(["x"], [1]), skip={("resid_pre", 1)})
    finally:
        d.capturing = False
    d.t.abort()  # nothing open: not the eager step's own landing
    with pytest.raises(CaptureError, match=r"recorded without the capture points "
                                           r"\[\('resid_pre', 1\)\]"):
        d.forward(BatchLayout.decode(["a"], [4], padded_batch_size=4), padded=True)


def test_an_aborted_eager_arena_step_leaves_nothing_for_the_next_one(make_driver):
    """An eager padded step that landed some rows and raised: its rows are forgotten,
    and the next step stores its own rows exactly."""
    d, sink = make_driver()
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [3, 3]))
    layout = BatchLayout.decode(["a", "b"], [4, 4], padded_batch_size=4)
    d.step += 1
    d.t.commit(d.plan(layout, padded=True), step=d.step)
    hook = hook_by_name("resid_pre")
    d.t.capturer.capture("resid_pre", 0, rows_tensor(hook, 0, layout.positions(), 2))
    d.t.abort()
    d.forward(BatchLayout.decode(["a", "b"], [4, 4], padded_batch_size=4), padded=True)
    d.t.stop()
    d.verify(sink.records)


def test_a_capture_point_firing_twice_in_an_eager_arena_step_fails(make_driver):
    d, _ = make_driver()
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    layout = BatchLayout.decode(["a"], [4], padded_batch_size=4)
    d.step += 1
    d.t.commit(d.plan(layout, padded=True), step=d.step)
    hook = hook_by_name("resid_pre")
    d.t.capturer.capture("resid_pre", 0, rows_tensor(hook, 0, layout.positions(), 3))
    with pytest.raises(CaptureError, match=r"fired twice in step"):
        d.t.capturer.capture("resid_pre", 0, rows_tensor(hook, 0, layout.positions(), 3))


def test_a_replayed_step_leaves_its_slot_with_one_copy_call_for_its_whole_groups(
        make_driver, monkeypatch: pytest.MonkeyPatch) -> None:
    # each torch call of the scheduler thread at a step's end releases the GIL and may
    # wait to take it back: the groups copied whole from the arena to the ring go with
    # one call (a group the device gathers keeps its own index_select; a group alone
    # goes by copy_, one device memcpy when dense)
    real = torch._foreach_copy_
    from_arena: list[int] = []

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], **kw: bool) -> None:
        if sys._getframe(1).f_code.co_name == "copy_from_arena":
            from_arena.append(len(dsts))
        real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    d, sink = make_driver("resid_pre,q,mlp_post,final_logits", payload_bytes=1 << 20,
                          coalesce_decode=False)
    _start(d)
    layout = BatchLayout.decode(["a", "b"], [6, 4], padded_batch_size=4)
    program = d.t._program(d.plan(layout, padded=True))
    whole = sum(g.gather is None for g in program.groups)
    assert whole >= 2
    steps = 6
    _decode_steps(d, steps)
    d.t.stop()
    d.verify(sink.records)
    assert from_arena == [whole] * steps


def test_a_replayed_step_of_one_whole_group_copies_it_with_copy(
        make_driver, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = torch._foreach_copy_

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], **kw: bool) -> None:
        if sys._getframe(1).f_code.co_name == "copy_from_arena":
            calls.append("foreach")
        real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    d, sink = make_driver("resid_pre", payload_bytes=1 << 20, coalesce_decode=False)
    _start(d)
    layout = BatchLayout.decode(["a", "b"], [6, 4], padded_batch_size=4)
    program = d.t._program(d.plan(layout, padded=True))
    assert [g.gather is None for g in program.groups] == [True]
    _decode_steps(d, 4)
    d.t.stop()
    d.verify(sink.records)
    assert calls == []
