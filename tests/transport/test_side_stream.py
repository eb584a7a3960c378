"""A decode graph's residual-stream copies and landing moves on a second stream.

On CPU the side stream holds its work until the next ``join`` (``_side``): what the
tests below see before a join is what a device that ran the branch as late as allowed
would hold, so they show which copies wait for a join and which are made at once.
"""

from __future__ import annotations

import torch

from dmi_sglang.adapters.transport._arena import Arena
from dmi_sglang.adapters.transport._device import DeviceOps
from dmi_sglang.adapters.transport._side import SideStream
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.layout import BatchLayout

from .conftest import SHAPE, rows_tensor, select


def test_work_waits_for_the_join_and_runs_in_order():
    side = SideStream(torch.device("cpu"))
    done: list[int] = []
    side.join()  # nothing pending: nothing to do
    assert (side.forks, side.joins, side.pending) == (0, 0, False)
    side.run(lambda: done.append(1))
    side.run(lambda: done.append(2))
    assert done == []
    assert side.pending
    side.join()
    assert done == [1, 2]
    assert not side.pending
    side.join()
    assert (side.forks, side.joins, done) == (2, 1, [1, 2])


def _slot_reader(arena: Arena, width: int):
    def slot(k: int, key: tuple[str, int], rows: int) -> torch.Tensor:
        start = k * arena.slot_bytes + arena.offsets[key]
        raw = arena.buffer[start : start + rows * width * 2]
        return raw.view(torch.bfloat16).view(rows, width)

    return slot


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
    slot = _slot_reader(arena, tensors["resid_pre", 0][0].numel())
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
    slot = _slot_reader(arena, tensors[0][0].numel())
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
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [3, 2]))
    assert side.forks == 0
    d.graph_capture(4)
    assert side.forks == 3 + (1 if d.t._arena.landing else 0)
    assert side.joins == 1
    assert not side.pending
    for n in range(3):
        d.forward(BatchLayout.decode(["a", "b"], [4 + n, 3 + n], padded_batch_size=4),
                  padded=True)
    d.t.stop()
    d.verify(sink.records)


def test_without_the_setting_recorded_copies_stay_on_the_forward_stream(make_driver):
    """``DMX_GRAPH_SIDE_STREAM`` off (the default): nothing forks, a join does nothing,
    and the stored rows are the same."""
    d, sink = make_driver("resid_pre,final_logits")
    assert d.t._writer.side is None
    d.forward(BatchLayout.extend(["a"], [0], [2]))
    d.graph_capture(4)
    d.forward(BatchLayout.decode(["a"], [3], padded_batch_size=4), padded=True)
    d.t.stop()
    d.verify(sink.records)
