"""The ``last`` rule on the capture path: every forward writes the rows that decide a
token into per-request device slots, and a finished request's row of the position that
decided its last token is read out once; the overlap scheduler's extra forward, earlier
positions and requests left out never leave the device."""

from __future__ import annotations

import pytest

from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.errors import CaptureError

from .conftest import raw_bytes, stored_rows, stored_tensor


def _serve(d, *, padded: bool) -> None:
    """a (prompt 5) generates 3 tokens, b (prompt 3) 5, c (prompt 2) 2 and reuses a's slot;
    each finishes after the overlap scheduler's extra forward."""
    pad = 4 if padded else None
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))  # decides a's token 1 (pos 4)
    if padded:
        d.graph_capture(4)
    for n in range(3):  # a: positions 5, 6 decide tokens 2, 3; position 7 is the extra one
        d.forward(BatchLayout.decode(["a", "b"], [6 + n, 4 + n], padded_batch_size=pad),
                  padded=padded)
    d.t.finish_request("a", 5 + 3 - 1)
    d.forward(BatchLayout.extend(["c"], [0], [2]))
    for n in range(2):
        d.forward(BatchLayout.decode(["b", "c"], [7 + n, 3 + n], padded_batch_size=pad),
                  padded=padded)
    d.t.finish_request("b", 3 + 5 - 1)  # b's position 7 was its extra forward
    d.t.finish_request("c", 2 + 2 - 1)  # c's position 3 too


LAST = {"a": 6, "b": 6, "c": 2}


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("coalesce", [True, False], ids=["window", "per-step"])
def test_last_stores_the_row_of_a_full_capture_that_decided_the_last_token(
        make_driver, padded: bool, coalesce: bool) -> None:
    full, full_sink = make_driver("resid_pre,final_ln,final_logits", coalesce_decode=coalesce)
    some, some_sink = make_driver("resid_pre:last,final_ln,final_logits:last",
                                  coalesce_decode=coalesce)
    for d in (full, some):
        _serve(d, padded=padded)
    full_stats, some_stats = full.t.stop(), some.t.stop()

    everything = stored_rows(full_sink.records)
    want = {row for row in everything
            if "final_ln" in row[1] or row[3] == LAST[row[0]]}
    got = stored_rows(some_sink.records)
    assert set(got) == want
    assert all(n == 1 for n in got.values())
    last = {(r[0], r[1], r[2]) for r in want if "final_ln" not in r[1]}
    assert len(last) == 3 * (3 + 1)  # every request: each resid_pre layer and final_logits
    moved_less = sum(len(r[4]) * n for r, n in everything.items()
                     if r not in want)
    assert full_stats.bytes - some_stats.bytes == moved_less  # never copied to the host


def test_a_selection_of_last_alone_reads_rows_out_with_empty_forward_plans(make_driver):
    d, sink = make_driver("resid_pre@1:last")
    _serve(d, padded=True)
    d.t.stop()
    assert sorted((r.request_id, r.start_token_idx, r.end_token_idx) for r in sink.records) == [
        ("a", 6, 7), ("b", 6, 7), ("c", 2, 3)]


def test_finish_notices_wait_for_the_next_commit_or_stop(make_driver) -> None:
    d, sink = make_driver("resid_pre@0:last,final_logits", flush_timeout_s=0.01)
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.forward(BatchLayout.decode(["a"], [4]))  # decides token 2 from position 3
    d.forward(BatchLayout.decode(["a"], [5]))  # the extra forward
    d.t.finish_request("a", 3 + 2 - 1)
    d.t.stop()  # no commit after the notice: stop reads it
    rows = sorted((r.act_name, r.start_token_idx) for r in sink.records)
    assert rows == [("blocks.hook_resid_pre", 3), ("final_logits", 2), ("final_logits", 3)]


def test_requests_left_out_or_unfinished_or_without_a_token_store_no_last_row(make_driver):
    d, sink = make_driver("resid_pre@0:last")
    d.skip = frozenset({"x"})
    d.forward(BatchLayout.extend(["x", "u", "z"], [0, 0, 0], [3, 2, 4], seq_lens=[3, 2, 5]))
    d.forward(BatchLayout.decode(["x", "u"], [4, 3]))
    d.t.finish_request("z", 4 - 1)  # z's prompt was cut short: it generated no token
    d.forward(BatchLayout.decode(["u"], [4]))
    d.t.stop()  # u never finished
    assert sink.records == []
    assert d.t._last_slots._slot_of == {"u": d.t._last_slots._slot_of["u"]}  # x has none


def test_a_request_that_finds_no_free_slot_gets_no_last_row_and_is_counted(make_driver):
    d, sink = make_driver("resid_pre@0:last", max_graph_batch=2, max_requests=1)
    # 2 * max(1 request, batch 2) = 4 slots: a fifth live request has none
    d.forward(BatchLayout.extend([f"r{i}" for i in range(4)], [0] * 4, [2] * 4))
    d.forward(BatchLayout.extend(["r4"], [0], [2]))
    d.forward(BatchLayout.decode(["r0", "r4"], [3, 3]))
    assert d.t._last_slots.slotless == 1
    d.t.finish_request("r0", 3)  # its decode (position 2) decided its second token
    for i in range(1, 5):
        d.t.finish_request(f"r{i}", 2)  # one token each, decided by position 1
    d.t.stop()  # the run goes on; r4 reads as incomplete (no last row)
    assert sorted((r.request_id, r.start_token_idx) for r in sink.records) == [
        ("r0", 2), ("r1", 1), ("r2", 1), ("r3", 1)]


def test_slots_are_given_back_when_requests_finish(make_driver) -> None:
    d, sink = make_driver("resid_pre@0:last", max_graph_batch=1, max_requests=1)
    for i in range(10):  # 2 slots serve 10 requests one after the other
        d.forward(BatchLayout.extend([f"r{i}"], [0], [3]))
        d.t.finish_request(f"r{i}", 3)
    d.t.stop()
    assert sorted(r.request_id for r in sink.records) == sorted(f"r{i}" for i in range(10))
    assert {r.start_token_idx for r in sink.records} == {2}


def test_last_with_a_storage_dtype_reads_the_cast_row(make_driver) -> None:
    import torch

    from dmi_sglang.domain.hooks import hook_by_name

    from .conftest import raw_bytes, rows_tensor

    d, sink = make_driver("resid_pre@2:last:fp16")
    d.forward(BatchLayout.extend(["a"], [0], [4]))
    d.forward(BatchLayout.decode(["a"], [5]))
    d.t.finish_request("a", 4 + 2 - 1)
    d.t.stop()
    (rec,) = sink.records
    assert (rec.dtype, rec.start_token_idx) == ("torch.float16", 4)
    want = rows_tensor(hook_by_name("resid_pre"), 2, [("a", 4)]).to(torch.float16)
    assert rec.payload == raw_bytes(want)


def test_a_last_read_confirms_no_held_row_of_another_capture(make_driver) -> None:
    d, sink = make_driver("final_logits:last,final_logits:topk(2)")
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.forward(BatchLayout.decode(["a"], [4]))  # position 3 decides token 2
    d.forward(BatchLayout.decode(["a"], [5]))  # the extra forward: its topk row is held
    d.t.finish_request("a", 3 + 2 - 1)
    d.forward(BatchLayout.extend(["b"], [0], [2]))  # the read happens at this commit
    stats = d.t.stop()
    rows = sorted((r.request_id, r.act_name, r.start_token_idx) for r in sink.records)
    assert rows == [("a", "final_logits", 3),
                    ("a", "logits_topk_ids", 2), ("a", "logits_topk_ids", 3),
                    ("a", "logits_topk_values", 2), ("a", "logits_topk_values", 3),
                    ("b", "logits_topk_ids", 1), ("b", "logits_topk_values", 1)]
    assert stats.discarded_logit_rows == 2  # the extra forward's two topk rows


def test_a_request_forwarded_after_its_finish_notice_takes_no_slot(make_driver) -> None:
    # SGLang still prefills a request aborted from its grammar queue once, after the
    # session reported it finished
    d, _ = make_driver("resid_pre@0:last", max_graph_batch=1, max_requests=1)  # 2 slots
    for i in range(3):
        d.t.finish_request(f"g{i}", 0)
        d.forward(BatchLayout.extend([f"g{i}"], [0], [1]))
    assert d.t._last_slots._slot_of == {}
    assert d.t._last_slots.slotless == 0


def test_reads_of_many_finished_requests_are_cut_to_fit_the_ring(make_driver) -> None:
    # 64 requests x 3 layers x 16 bytes = 3,072 bytes to read, the ring holds 2,048
    d, sink = make_driver("resid_pre:last", payload_bytes=2048, max_graph_batch=64,
                          max_requests=64, max_prefill_tokens=128)
    rids = [f"r{i}" for i in range(64)]
    d.forward(BatchLayout.extend(rids, [0] * 64, [2] * 64))
    for rid in rids:
        d.t.finish_request(rid, 2)
    d.forward(BatchLayout.extend(["next"], [0], [2]))
    d.t.stop()
    assert sorted((r.request_id, r.layer_no) for r in sink.records) == sorted(
        (rid, layer) for rid in rids for layer in range(3))


def test_one_requests_last_rows_larger_than_the_ring_are_refused_at_creation(make_driver):
    from dmi_sglang.errors import CapacityError

    with pytest.raises(CapacityError, match="rows under the last rule take 48 bytes"):
        make_driver("resid_pre:last", payload_bytes=32, max_graph_batch=1, max_requests=1,
                    max_prefill_tokens=1)


def _commit_b_after_a_finished(d) -> BatchLayout:
    """a (4 tokens) finishes; the prefill of b, which would reuse a's slot row, is
    committed, not fired."""
    d.forward(BatchLayout.extend(["a"], [0], [4]))
    d.t.finish_request("a", 4)
    step = BatchLayout.extend(["b"], [0], [2])
    d.step += 1
    d.t.commit(d.plan(step), step=d.step)
    return step


def test_a_last_capture_point_that_never_ran_fails_the_step(make_driver) -> None:
    d, _ = make_driver("resid_pre@0:last,final_ln")
    step = _commit_b_after_a_finished(d)
    d.fire(step, skip={("resid_pre", 0)})
    with pytest.raises(CaptureError, match=r"last capture points never ran.*resid_pre"):
        d.t.seal()
    with pytest.raises(CaptureError):
        d.t.stop()  # the run failed: nothing of b is called complete


def test_an_aborted_forward_leaves_no_row_to_read(make_driver) -> None:
    d, sink = make_driver("resid_pre@0:last")
    _commit_b_after_a_finished(d)
    d.t.abort()  # the forward raised before any capture point ran
    d.t.finish_request("b", 2)
    d.t.stop()
    assert [r.request_id for r in sink.records] == ["a"]


def test_stop_with_an_open_step_of_last_rows_fails_the_run(make_driver) -> None:
    d, _ = make_driver("resid_pre@0:last")
    d.forward(BatchLayout.extend(["a"], [0], [4]))
    d.step += 1
    d.t.commit(d.plan(BatchLayout.extend(["b"], [0], [2])), step=d.step)  # never sealed
    d.t.finish_request("a", 4)
    with pytest.raises(CaptureError, match="never sealed"):
        d.t.stop()


def test_a_request_without_a_slot_takes_one_freed_later(make_driver) -> None:
    d, sink = make_driver("resid_pre@0:last", max_graph_batch=2, max_requests=1)  # 4 slots
    d.forward(BatchLayout.extend([f"r{i}" for i in range(4)], [0] * 4, [2] * 4))
    d.forward(BatchLayout.extend(["late"], [0], [2]))  # no free slot: position 1 lost
    for i in range(4):
        d.t.finish_request(f"r{i}", 2)
    for n in range(5):  # positions 2..6: the slot freed by the notices is taken at once
        d.forward(BatchLayout.decode(["late"], [3 + n]))
    d.t.finish_request("late", 2 + 6 - 1)  # six tokens, the last decided by position 6
    d.t.stop()
    assert ("late", 6) in {(r.request_id, r.start_token_idx) for r in sink.records}
    assert d.t._last_slots.slotless == 1


def test_an_aborted_step_that_started_a_run_leaves_no_position_behind(make_driver) -> None:
    d, sink = make_driver("resid_pre@0:last")
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.graph_capture(4)
    step = BatchLayout.decode(["a"], [4], padded_batch_size=4)  # would write position 3
    d.step += 1
    d.t.commit(d.plan(step, padded=True), step=d.step)
    d.t.abort()
    slots = d.t._last_slots
    slots._end_run()  # what the next commit or notice does first
    assert slots._newest == {"a": 2}  # not the aborted step's position 3
    d.t.finish_request("a", 3)  # one token, decided by position 2
    d.t.stop()
    assert [(r.request_id, r.start_token_idx) for r in sink.records] == [("a", 2)]


def test_an_abort_before_the_step_committed_keeps_the_decode_runs_positions(make_driver):
    """A forward that raised before its commit (SGLang code before ``load_batch``) undoes
    nothing of the steps before it: the run of decode graph steps keeps its positions, so
    the finished request's row is read."""
    d, sink = make_driver("resid_pre@0:last")
    d.forward(BatchLayout.extend(["a"], [0], [3]))  # decides token 1 (position 2)
    d.graph_capture(4)
    for n in range(3):  # positions 3, 4 decide tokens 2, 3; 5 is the extra forward
        d.forward(BatchLayout.decode(["a"], [4 + n], padded_batch_size=4), padded=True)
    d.t.abort()
    d.t.finish_request("a", 3 + 3 - 1)
    d.t.stop()
    assert [(r.request_id, r.start_token_idx) for r in sink.records] == [("a", 4)]


def test_a_steady_decode_batch_costs_no_device_operation_a_step(make_driver) -> None:
    """Consecutive decode graph steps of the same requests find their slot index on the
    device: the replay before flipped it (a step of the graph). Committing and sealing
    such a step runs no device operation, no pass over the batch, no upload."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    d, sink = make_driver("resid_pre@0:last,final_logits:last")
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [3, 3]))
    d.graph_capture(4)
    for n in range(2):  # the run's first step uploads its index
        d.forward(BatchLayout.decode(["a", "b"], [4 + n, 4 + n], padded_batch_size=4),
                  padded=True)
    rids = d.t._last_slots._run.batch.request_ids  # the adapter passes an unchanged tuple
    layout = BatchLayout.decode(rids, [6, 6], padded_batch_size=4)
    d.step += 1
    with Ops() as ops:
        d.t.commit(d.plan(layout, padded=True), step=d.step)
    assert ops.names == []
    d.fire(layout, 2)  # what the replay runs: its copies, then one flip
    with ops:
        d.t.seal()
    assert ops.names == []
    d.t.finish_request("a", 3 + 4 - 1)  # positions 3, 4, 5 decided tokens 2, 3, 4
    d.t.finish_request("b", 3 + 4 - 1)
    d.t.stop()
    assert sorted((r.request_id, r.act_name, r.start_token_idx) for r in sink.records) == [
        ("a", "blocks.hook_resid_pre", 5), ("a", "final_logits", 5),
        ("b", "blocks.hook_resid_pre", 5), ("b", "final_logits", 5)]


def test_a_replay_nobody_committed_writes_no_slot_of_a_run(make_driver) -> None:
    """A decode graph replayed between two steps of a run without a commit (the adapter
    announces it from the graph runner's ``load_batch``) writes the spare row, and the
    run's next step uploads its index again."""
    import torch

    d, sink = make_driver("resid_pre@0:last")
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.graph_capture(4)
    for n in range(2):  # positions 3, 4
        d.forward(BatchLayout.decode(["a"], [4 + n], padded_batch_size=4), padded=True)
    d.t.uncommitted_replay()
    slots = d.t._last_slots
    assert torch.equal(slots._control, slots._idle)
    d.graph_capture(4)  # on the CPU a recording runs its ops: what such a replay writes
    assert torch.equal(slots._control, slots._idle)  # a zero flip: still the spare row
    d.forward(BatchLayout.decode(["a"], [6], padded_batch_size=4), padded=True)  # 5: extra
    d.t.finish_request("a", 3 + 3 - 1)  # the last token was decided by position 4
    d.t.stop()
    (rec,) = sink.records
    assert (rec.request_id, rec.start_token_idx) == ("a", 4)
    want = stored_tensor(d.selection, hook_by_name("resid_pre"), 0, [("a", 4)])
    assert rec.payload == raw_bytes(want)  # a's own row, not a dummy's


def test_a_decode_graph_recorded_without_a_last_capture_point_fails_loudly(make_driver):
    """A graph missing a ``last`` capture point holds no flip (its replays would write the
    wrong slot rows): the next recording, or the first graph step, raises."""
    d, _ = make_driver("resid_pre@0:last,final_logits:last")
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.capturing = True
    try:
        dummy = BatchLayout.decode(["x"], [1])
        d.fire(dummy, skip={("final_logits", -1)})  # this bucket's graph lacks one point
        with pytest.raises(CaptureError, match="recorded without the last capture points"):
            d.fire(dummy)  # the next recording begins
    finally:
        d.capturing = False
    d2, _ = make_driver("resid_pre@0:last,final_logits:last")
    d2.forward(BatchLayout.extend(["a"], [0], [3]))
    d2.capturing = True
    d2.fire(BatchLayout.decode(["x"], [1]), skip={("final_logits", -1)})
    d2.capturing = False
    with pytest.raises(CaptureError, match="recorded without the last capture points"):
        d2.forward(BatchLayout.decode(["a"], [4], padded_batch_size=4), padded=True)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_a_position_never_written_is_not_read_under_its_label(make_driver, padded: bool):
    """A step aborted before its capture points ran leaves a hole in the positions its
    slot received: the row of a position in the hole is not read (it would be the row of
    the position two before, by parity)."""
    d, sink = make_driver("resid_pre@0:last")
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    if padded:
        d.graph_capture(4)
    pad = 4 if padded else None
    d.forward(BatchLayout.decode(["a"], [4], padded_batch_size=pad), padded=padded)  # 3
    hole = BatchLayout.decode(["a"], [5], padded_batch_size=pad)  # 4: aborted unrun
    d.step += 1
    d.t.commit(d.plan(hole, padded=padded), step=d.step)
    d.t.abort()
    d.forward(BatchLayout.decode(["a"], [6], padded_batch_size=pad), padded=padded)  # 5
    d.t.finish_request("a", 5)  # its last token was decided by position 4: never written
    d.t.stop()
    assert sink.records == []


def test_an_aborted_step_after_a_hole_gives_back_the_positions_before_it(make_driver):
    """A step that finds a hole in a request's positions, then raises, puts back what
    the steps before it left: the row of the newest position written is still read."""
    d, sink = make_driver("resid_pre@0:last")
    d.forward(BatchLayout.extend(["a"], [0], [3]))  # position 2
    d.forward(BatchLayout.decode(["a"], [4]))  # 3
    jumped = BatchLayout.decode(["a"], [6])  # 5: position 4 never forwarded
    d.step += 1
    d.t.commit(d.plan(jumped), step=d.step)
    d.t.abort()
    d.t.finish_request("a", 4)  # its last token was decided by position 3
    d.t.stop()
    assert [(r.request_id, r.start_token_idx) for r in sink.records] == [("a", 3)]


def test_last_capture_points_of_one_graph_step_with_other_row_counts_fail_loudly(make_driver):
    """A decode graph's ``last`` capture points land their rows first and one move per
    group takes them into the slots: a capture point that wrote another row count than
    the others of its step is refused, not moved with rows of another step."""
    import torch

    d, _ = make_driver("resid_pre:last,final_ln:last")  # one group of 4 equal rows
    d.forward(BatchLayout.extend(["a"], [0], [3]))
    d.capturing = True
    try:
        d.t.capturer.capture("resid_pre", 0, torch.zeros(4, 8, dtype=torch.bfloat16))
        with pytest.raises(CaptureError, match=r"2 rows, where the step's landing holds 4"):
            d.t.capturer.capture("resid_pre", 1, torch.zeros(2, 8, dtype=torch.bfloat16))
    finally:
        d.capturing = False


def test_last_slots_count_the_landing_rows_of_the_largest_decode_graph(make_driver):
    """A group of three equal rows or more lands (its landing rows counted); a smaller
    one is written in place."""
    d, _ = make_driver("resid_pre:last,final_logits:last")
    slots = d.t._last_slots
    per_row, logits_row = 8 * 2, 10 * 4  # bf16 resid_pre and fp32 final_logits of SHAPE
    landing = d.t._arena.max_rows
    rows = 2 * slots.requests + 1
    assert slots.nbytes == (rows + landing) * per_row * 3 + rows * logits_row  # 3 layers
    (moved, landed), = slots._moves
    allocated = moved.numel() * moved.element_size() + landed.numel() * landed.element_size()
    logits = slots._buffers[("final_logits", -1)]
    assert allocated + logits.numel() * logits.element_size() == slots.nbytes
    assert ("final_logits", -1) not in slots._lands
    # each capture point's landing rows are contiguous (its copy a plain one), and the
    # move sees them row by row: row r of layer k is landing row r of capture k
    assert all(view.is_contiguous() for view in slots._lands.values())
    assert landed.shape == (landing, 3, 8)
    for k, layer in enumerate(sorted(layer for name, layer in slots._lands)):
        view = slots._lands[("resid_pre", layer)]
        assert view.data_ptr() == landed[0, k].data_ptr()
        assert view[1].data_ptr() == landed[1, k].data_ptr()


def test_a_read_takes_a_group_at_once_only_where_its_rows_follow_one_another(make_driver):
    """A group of captures whose read regions follow one another in the group's order is
    read with one indexed copy; any other placement is read capture by capture, with
    the same bytes in the same places."""
    import torch

    d, _ = make_driver("resid_pre:last,final_logits:last")
    slots = d.t._last_slots
    for buffer in slots._buffers.values():
        buffer.copy_(torch.randn(buffer.shape).to(buffer.dtype))
    keys = [("resid_pre", layer) for layer in range(3)]
    size, logits = 2 * 8 * 2, 2 * 10 * 4  # two rows each
    follow = {key: (k * size, size) for k, key in enumerate(keys)}
    apart = {keys[0]: (2 * size, size), keys[1]: (0, size), keys[2]: (size, size)}
    rows = torch.tensor([3, 0])
    regions = []
    for placed, grouped in ((follow, 1), (apart, 0)):
        layout = slots.read_layout({**placed, ("final_logits", -1): (3 * size, logits)}, 2)
        assert len(layout.groups) == grouped
        assert len(layout.single) == 4 - 3 * grouped
        region = torch.zeros(3 * size + logits, dtype=torch.uint8)
        slots.read_into(layout, rows, region)
        regions.append(region)
        for key, (offset, nbytes) in {**placed, ("final_logits", -1): (3 * size, logits)}.items():
            buffer = slots._buffers[key]
            got = region[offset : offset + nbytes].view(buffer.dtype).view(2, -1)
            assert torch.equal(got, buffer[rows])
    assert not torch.equal(regions[0], regions[1])  # the two placements differ


@pytest.mark.parametrize("finish_after", ["prefill", "decode"])
def test_eager_forwards_keep_the_row_that_decided_each_requests_last_token(
        make_driver, finish_after: str) -> None:
    """An eager prefill's rows that decide tokens are the last prompt row of each
    request (token rows, not request rows): a request that finishes on its first token
    gets that row; one that finishes after a decode step gets the decode step's."""
    rids = [f"r{i}" for i in range(4)]
    prompts = [3 + 2 * i for i in range(4)]
    full, full_sink = make_driver("resid_pre,q,final_logits")
    some, some_sink = make_driver("resid_pre:last,q:last,final_logits:last")
    for d in (full, some):
        d.forward(BatchLayout.extend(rids, [0] * 4, prompts))
        if finish_after == "decode":
            d.forward(BatchLayout.decode(rids, [p + 1 for p in prompts]))
        for rid, p in zip(rids, prompts, strict=True):
            d.t.finish_request(rid, p + (finish_after == "decode"))
    full.t.stop()
    some.t.stop()
    decided = {rid: p - 1 + (finish_after == "decode") for rid, p in zip(rids, prompts,
                                                                         strict=True)}
    want = {row for row in stored_rows(full_sink.records) if row[3] == decided[row[0]]}
    got = stored_rows(some_sink.records)
    assert set(got) == want
    assert len(want) == 4 * 7  # three resid_pre and three q layers, and final_logits


def test_a_read_planned_with_other_row_counts_is_refused(make_driver) -> None:
    """The read copies ``rows`` whole rows per capture: a plan whose bytes for a capture
    hold another count is refused, never copied into a wrongly shaped view."""
    d, _ = make_driver("resid_pre:last")
    size = 2 * 8 * 2
    placed = {("resid_pre", layer): (layer * size, size) for layer in range(3)}
    assert len(d.t._last_slots.read_layout(placed, 2).groups) == 1
    with pytest.raises(CaptureError, match="a read of 3 rows"):
        d.t._last_slots.read_layout(placed, 3)
