"""A decode graph's residual-stream copies and landing moves on a second stream.

On CPU the side stream holds its work until the next ``join`` (``_side``): what the
tests below see before a join is what a device that ran the branch as late as allowed
would hold, so they show which copies wait for a join and which are made at once.
"""

from __future__ import annotations

import pytest
import torch

from dmi_sglang.adapters.transport._arena import Arena
from dmi_sglang.adapters.transport._device import DeviceOps
from dmi_sglang.adapters.transport._side import SideStream
from dmi_sglang.domain.hooks import RESIDUAL_STREAM, hook_by_name
from dmi_sglang.domain.layout import BatchLayout

from .conftest import SHAPE, WrappedCapturer, arena_slot_reader, rows_tensor, select


def test_work_waits_for_the_join_and_runs_in_order():
    side = SideStream(torch.device("cpu"))
    done: list[int] = []
    side.join()  # nothing pending: nothing to do
    assert (side.forked, side.joined, side.pending) == (0, 0, False)
    side.run(lambda: done.append(1))
    side.run(lambda: done.append(2))
    assert done == []
    assert side.pending
    side.join()
    assert done == [1, 2]
    assert not side.pending
    side.join()
    assert (side.forked, side.joined, done) == (2, 1, [1, 2])


def test_a_recorded_residual_copy_reads_its_source_at_the_join():
    """While a graph is recorded the residual stream's copies and the landing move wait
    for the join; a copy of another hook is made at once. So the model must join before
    it changes a captured residual in place (here it changes it after the join: the
    slot keeps the values of the capture)."""
    selection = select("resid_pre,ln1")
    arena = Arena(selection, SHAPE, 4, DeviceOps("cpu"), slots=4)
    assert arena.landing
    side = SideStream(torch.device("cpu"))
    pre, ln1 = hook_by_name("resid_pre"), hook_by_name("ln1")
    rows = [("a", 1), ("b", 2)]
    tensors = {(h.name, layer): rows_tensor(h, layer, rows)
               for layer in range(3) for h in (pre, ln1)}
    want = {k: t.clone() for k, t in tensors.items()}
    slot = arena_slot_reader(arena, tensors["resid_pre", 0][0].numel())
    arena.select(1)
    for layer in range(3):
        arena.write(("resid_pre", layer), tensors["resid_pre", layer], side=side)
        arena.write(("ln1", layer), tensors["ln1", layer], side=side)
        tensors["ln1", layer].fill_(0)  # the model reuses it at once: copied already
    assert side.pending
    assert not any(torch.equal(slot(1, k, 2), want[k]) for k in want)  # not moved yet
    tensors["resid_pre", 2].add_(1)  # changed in place before the join: copied changed
    side.join()
    for key, value in want.items():
        expected = tensors[key] if key == ("resid_pre", 2) else value
        assert torch.equal(slot(1, key, 2), expected), key
    tensors["resid_pre", 0].add_(1)  # after the join: the slot is not affected
    assert torch.equal(slot(1, ("resid_pre", 0), 2), want["resid_pre", 0])


def test_eager_arena_writes_do_not_use_the_side_stream():
    """Without ``side`` (an eager padded step) every copy and the move are made at once."""
    selection = select("resid_pre")
    arena = Arena(selection, SHAPE, 4, DeviceOps("cpu"), slots=4)
    hook = hook_by_name("resid_pre")
    tensors = {layer: rows_tensor(hook, layer, [("a", 1)]) for layer in range(3)}
    slot = arena_slot_reader(arena, tensors[0][0].numel())
    arena.select(2)
    for layer in range(3):
        arena.write(("resid_pre", layer), tensors[layer])
    assert all(torch.equal(slot(2, ("resid_pre", layer), 1), tensors[layer])
               for layer in range(3))


def test_a_recorded_forward_forks_its_residual_copies_and_the_model_joins_them(make_driver):
    """Through the transport: recording a decode graph of ``resid_pre`` forks its copies
    (and, with a landing slot, the move) onto the side stream and the forward's end joins
    them; an eager forward forks nothing; the stored rows are complete and exact."""
    d, sink = make_driver("resid_pre,final_logits", side_stream=True)
    side = d.t._writer.side
    assert side is not None
    assert d.t.capturer.joins  # the capture points install the joins
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [3, 2]))
    assert side.forked == 0
    d.graph_capture(4)
    assert side.forked == 3 + (1 if d.t._arena.landing else 0)
    assert side.joined == 1
    assert not side.pending
    for n in range(3):
        d.forward(BatchLayout.decode(["a", "b"], [4 + n, 3 + n], padded_batch_size=4),
                  padded=True)
    d.t.stop()
    d.verify(sink.records)


def test_without_the_setting_recorded_copies_stay_on_the_forward_stream(make_driver):
    """``DMX_GRAPH_SIDE_STREAM=0``: nothing forks, a join does nothing, and the stored
    rows are the same."""
    d, sink = make_driver("resid_pre,final_logits", side_stream=False)
    assert d.t._writer.side is None
    assert not d.t.capturer.joins  # the capture points install no joins
    d.forward(BatchLayout.extend(["a"], [0], [2]))
    d.graph_capture(4)
    d.forward(BatchLayout.decode(["a"], [3], padded_batch_size=4), padded=True)
    d.t.stop()
    d.verify(sink.records)


class _Reusing(WrappedCapturer):
    """The model writes other hooks' tensors again right after their capture point (only
    the residual stream is kept until the join)."""

    def capture(self, hook_name: str, layer_no: int, tensor: torch.Tensor) -> None:
        super().capture(hook_name, layer_no, tensor)
        if hook_name not in RESIDUAL_STREAM:
            tensor.fill_(0)


def _recorded_replays(d) -> None:
    """Make ``d``'s padded forwards run their capture points as a decode graph's
    recording does (``capturing``), with the step's own rows: on CPU a recording's copies
    run as they are queued, so this stores what a replay of that recording would."""
    forward, fire = d.forward, d.fire
    padded_now = [False]
    d.t.capturer = _Reusing(d.t.capturer)

    def recorded_fire(layout, padding=0, skip=None):
        d.capturing = padded_now[0]
        try:
            fire(layout, padding, skip)
        finally:
            d.capturing = False

    def padded_forward(layout, *, padded=False, strip=True):
        padded_now[0] = padded
        try:
            return forward(layout, padded=padded, strip=strip)
        finally:
            padded_now[0] = False

    d.fire, d.forward = recorded_fire, padded_forward


def _serve(make_driver, text: str, mode: str):
    d, sink = make_driver(text, side_stream=mode == "recorded, side stream",
                          max_requests=8, payload_bytes=1 << 20)
    if mode != "eager":
        _recorded_replays(d)
    rids = ["a", "b", "c"]
    d.forward(BatchLayout.extend(rids, [0, 0, 0], [4, 2, 3]))
    seq = {"a": 5, "b": 3, "c": 4}
    for _ in range(5):
        live = sorted(seq)
        graph = mode != "eager"
        d.forward(BatchLayout.decode(live, [seq[r] for r in live],
                                     padded_batch_size=4 if graph else None), padded=graph)
        for r in live:
            seq[r] += 1
        if len(seq) == 3:
            d.t.finish_request("b", seq.pop("b") - 1)
    for rid in sorted(seq):
        d.t.finish_request(rid, seq[rid] - 1)
    d.t.stop()
    side = d.t._writer.side
    forks = side.forked if side is not None else 0
    return sorted((r.request_id, r.act_name, r.layer_no, r.start_token_idx, r.end_token_idx,
                   bytes(r.payload)) for r in sink.records), forks, d, sink


@pytest.mark.parametrize("text", ["resid_pre,ln1@1,resid_mid@2,final_logits",
                                  "resid_pre:last,ln1@1:last,resid_mid@0:last,final_logits:last"],
                         ids=["arena", "last"])
def test_recorded_steps_store_the_same_rows_with_the_side_stream(make_driver, text: str):
    """The same serving history stored through eager forwards, through padded steps whose
    capture points run as recorded (in line), and the same with the side stream: equal
    records. With the side stream the residual copies, the landing moves and (``last``)
    the slots' moves and index flip wait for the join, while the other hooks' copies
    are made at once (their tensors are written again right after the capture point
    here): a move made before the copies it moves, a flip before the copies that read
    the index, or another hook's copy made late stores other rows."""
    eager, _, d, sink = _serve(make_driver, text, "eager")
    if ":last" not in text:
        d.verify(sink.records)
    inline, no_forks, _, _ = _serve(make_driver, text, "recorded")
    side, forks, _, _ = _serve(make_driver, text, "recorded, side stream")
    assert eager
    assert no_forks == 0
    assert forks > 0
    assert inline == eager
    assert side == eager
