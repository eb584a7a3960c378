"""Captured bytes equal the inputs, for eager, padded and mixed steps."""

from __future__ import annotations

import threading
import time

import pytest

from dmi_sglang.domain.layout import BatchLayout, ForwardKind

ALL = "sglang-full"


def test_eager_extend_then_decode_exact_bytes(make_driver):
    d, sink = make_driver(ALL, payload_bytes=1 << 20)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    for n in range(4):
        d.forward(BatchLayout.decode(["a", "b"], [6 + n, 4 + n]))
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.steps == 5
    assert stats.tensors == 5 * len(d.selection.captures())
    assert stats.rows == sum(r.rows for r in sink.records)
    assert stats.bytes == sum(len(r.payload) for r in sink.records)
    assert sink.flushes == 1


def test_decode_rows_are_coalesced_per_request_and_capture(make_driver):
    d, sink = make_driver("resid_pre,final_logits", payload_bytes=1 << 20)
    for n in range(10):
        d.forward(BatchLayout.decode(["a", "b", "c"], [4 + n, 8 + n, 2 + n]))
    d.t.stop()
    d.verify(sink.records)
    # one record per (request, hook, layer): 3 requests x (3 layers + logits)
    assert len(sink.records) == 3 * 4
    assert {r.rows for r in sink.records} == {10}
    assert {r.seq for r in sink.records} == {1}


def test_no_coalescing_gives_one_record_per_step(make_driver):
    d, sink = make_driver("resid_pre", payload_bytes=1 << 20, coalesce_decode=False)
    for n in range(4):
        d.forward(BatchLayout.decode(["a"], [3 + n]))
    d.t.stop()
    d.verify(sink.records)
    assert [r.seq for r in sink.records if r.layer_no == 0] == [1, 2, 3, 4]


@pytest.mark.parametrize("strip", [True, False])
def test_padded_steps_never_store_padding(make_driver, strip):
    d, sink = make_driver(ALL, payload_bytes=1 << 20, max_graph_batch=8, strip=strip)
    for bucket in (8, 4):
        d.graph_capture(bucket)
    rids = [f"r{i}" for i in range(8)]
    for raw in range(3, 9):
        layout = BatchLayout.decode(rids[:raw], [10 + raw] * raw, padded_batch_size=8)
        d.forward(layout, padded=True, strip=strip)
    d.forward(BatchLayout.decode(rids[:2], [30, 31], padded_batch_size=4), padded=True,
              strip=strip)
    d.t.stop()
    d.verify(sink.records)
    assert not any(r.request_id.startswith("dummy") for r in sink.records)


def test_mixed_step_with_intermediate_chunk_keeps_only_emitting_logits(make_driver):
    d, sink = make_driver("resid_pre,final_logits,token_ids", payload_bytes=1 << 20)
    layout = BatchLayout.extend(
        ["long", "short", "dec"], [0, 0, 9], [6, 2, 1], seq_lens=[20, 2, 10],
        kind=ForwardKind.MIXED,
    )
    d.forward(layout)
    d.t.stop()
    d.verify(sink.records)
    logits = [r for r in sink.records if r.act_name == "final_logits"]
    assert sorted((r.request_id, r.start_token_idx) for r in logits) == [("dec", 9), ("short", 1)]


def test_warmup_forwards_without_commit_reach_nothing(make_driver):
    d, sink = make_driver(ALL, payload_bytes=1 << 20)
    d.fire(BatchLayout.decode(["w"], [3]))
    d.graph_capture(8)
    d.t.stop()
    assert sink.records == []
    assert d.t.stats().steps == 0


def test_empty_plan_is_committed_and_sealed(make_driver):
    d, sink = make_driver("final_logits", payload_bytes=1 << 20)
    d.forward(BatchLayout.extend(["a"], [0], [4], seq_lens=[9]))  # chunk emits nothing
    d.t.stop()
    assert sink.records == []
    assert d.t.stats().steps == 0


@pytest.mark.parametrize("strip", [True, False])
def test_padded_step_with_a_non_emitting_request_gathers_logit_rows(make_driver, strip):
    d, sink = make_driver("resid_pre,final_logits", payload_bytes=1 << 20, strip=strip)
    d.graph_capture(8)
    layout = BatchLayout(ForwardKind.DECODE, ("a", "b", "c"), (4, 7, 2), (1, 1, 1),
                         (True, False, True), 8, 3)
    d.forward(layout, padded=True, strip=strip)
    d.t.stop()
    d.verify(sink.records)
    logits = sorted(r.request_id for r in sink.records if r.act_name == "final_logits")
    assert logits == ["a", "c"]


def test_dense_steps_go_from_the_ring_straight_into_payload_memory(make_driver):
    # resid_pre + mlp_post: two groups (row sizes differ), both dense, no request rows
    d, sink = make_driver("resid_pre,mlp_post", coalesce_decode=False)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    d.forward(BatchLayout.decode(["a", "b"], [6, 4]))
    d.forward(BatchLayout.decode(["a", "b"], [7, 5]), padded=True)  # padding stripped: dense
    stats = d.t.stop()
    counters = d.t.drain_counters()
    assert counters["direct_items"] == 3
    assert counters["d2h_bytes"] == stats.bytes  # nothing but the kept rows crossed
    # the copies' calls and the waits for them are parts of the device-to-host time
    assert counters["d2h_call_seconds"] > 0
    assert (counters["d2h_call_seconds"] + counters["d2h_wait_seconds"]
            <= counters["d2h_seconds"])
    assert counters["oversized_direct_payloads"] == 0
    d.verify(sink.records)


def test_request_rows_of_a_direct_step_still_pass_through_staging(make_driver):
    d, sink = make_driver("resid_pre,mlp_post,final_logits", coalesce_decode=False)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [4, 6]))
    d.forward(BatchLayout.decode(["a", "b"], [5, 7]))
    d.forward(BatchLayout.decode(["a", "b"], [6, 8]))
    d.t.stop()
    assert d.t.drain_counters()["direct_items"] == 3
    d.verify(sink.records)  # the logits rows held back and confirmed, bytes exact


def test_coalesced_decode_steps_go_through_the_device_window_only(make_driver):
    d2, sink2 = make_driver("resid_pre")  # decode steps join the window on the device
    d2.forward(BatchLayout.extend(["a"], [0], [4]))
    d2.forward(BatchLayout.decode(["a"], [5]))
    d2.forward(BatchLayout.decode(["a"], [6]))
    d2.t.stop()
    counters = d2.t.drain_counters()
    assert counters["direct_items"] == 1  # the prefill only
    outside = {k: v for k, v in counters.items() if k.startswith("outside_window_")}
    assert outside == {"outside_window_not_decode": 1, "outside_window_rows": 0,
                       "outside_window_too_large": 0, "outside_window_discarded": 0,
                       "outside_window_no_window": 0}
    assert counters["d2h_bytes"] == 3 * 4 * 16  # its rows; the decode rows: window flush
    assert counters["window_bytes"] == 3 * 2 * 16
    assert counters["host_copied_bytes"] == 0
    d2.verify(sink2.records)


def test_single_segment_groups_and_piecewise_pieces_are_direct(make_driver):
    # token_ids and final_ln are groups of one segment each: still one contiguous span
    d, sink = make_driver("token_ids,resid_pre,final_ln,final_logits", coalesce_decode=False)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [4, 6]))
    d.forward(BatchLayout.decode(["a", "b"], [5, 7]))
    d.t.stop()
    assert d.t.drain_counters()["direct_items"] == 2
    assert d.t.drain_counters()["outside_window_no_window"] == 2  # coalescing off
    d.verify(sink.records)
    # a prefill larger than the ring goes in parts (one capture point each: a part takes
    # a quarter of the ring at most): every part is direct
    d2, sink2 = make_driver("resid_pre", payload_bytes=1024, coalesce_decode=False)
    d2.forward(BatchLayout.extend(["a"], [0], [40]))  # 3 layers x 40 rows x 16 B > 1 KiB
    stats = d2.t.stop()
    assert stats.piecewise_steps == 1
    assert d2.t.drain_counters()["direct_items"] == 3
    d2.verify(sink2.records)


@pytest.mark.parametrize("direct_copies", [True, False])
def test_segments_wider_than_a_slab_go_out_in_row_runs(make_driver, monkeypatch,
                                                       direct_copies):
    """A prefill segment larger than a payload slab is not given memory of its own
    (pageable: the device copy into it would wait for itself): its rows go out in runs
    that fit a slab, a request's rows split into several records where a run ends."""
    from dmi_sglang.adapters.transport._pool import PayloadPool

    monkeypatch.setattr(PayloadPool, "SLAB_BYTES", 128)  # 8 resid_pre rows, 5 mlp_post rows
    d, sink = make_driver("resid_pre,mlp_post", coalesce_decode=False,
                          direct_copies=direct_copies)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [9, 7]))  # 16 rows a segment
    d.forward(BatchLayout.decode(["a", "b"], [10, 8]))
    d.t.stop()
    counters = d.t.drain_counters()
    assert counters["oversized_direct_payloads"] == 0
    assert counters["direct_items"] == (2 if direct_copies else 0)
    d.verify(sink.records)  # every row once, in position order, with its bytes
    prefill_a = [(r.start_token_idx, r.end_token_idx) for r in sink.records
                 if (r.request_id, r.act_name, r.layer_no) == ("a", "blocks.hook_resid_pre", 0)
                 and r.start_token_idx < 9]
    assert prefill_a == [(0, 8), (8, 9)]


def test_direct_items_of_one_round_share_one_wait_before_release_and_hand_over(
        make_driver, monkeypatch):
    """Consecutive direct items are not waited for one by one: their copies are queued
    as their records are built, and one wait covers them before any of their ring
    regions is released or any batch goes to the sink; their request rows are held
    after it, in order."""
    from dmi_sglang.adapters.transport import _drain
    from dmi_sglang.adapters.transport._device import DeviceOps

    events: list[str] = []
    real_queue, real_wait = DeviceOps.queue_to_host, DeviceOps.wait

    def queue_to_host(self, markers, pairs):
        events.append("queue")
        return real_queue(self, markers, pairs)

    def wait(self, fence):
        events.append("wait")
        real_wait(self, fence)

    go = threading.Event()
    real_linger = _drain.Drain._linger

    def linger(self, item):
        go.wait(30)  # every item below is queued before the drain takes the first
        real_linger(self, item)

    monkeypatch.setattr(DeviceOps, "queue_to_host", queue_to_host)
    monkeypatch.setattr(DeviceOps, "wait", wait)
    monkeypatch.setattr(_drain.Drain, "_linger", linger)
    d, sink = make_driver("resid_pre,final_logits", payload_bytes=1 << 20,
                          coalesce_decode=False)
    real_release, real_put = d.t._alloc.release, sink.put
    monkeypatch.setattr(d.t._alloc, "release", lambda: (events.append("release"),
                                                        real_release())[1])
    monkeypatch.setattr(sink, "put", lambda batch: (events.append("put"), real_put(batch)))
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    d.forward(BatchLayout.extend(["c"], [0], [4]))
    d.forward(BatchLayout.decode(["a", "b", "c"], [6, 4, 5]))
    go.set()
    d.t.stop()
    assert d.t.drain_counters()["direct_items"] == 3
    first = events.index("queue")
    round_ = events[first : events.index("put")]
    assert round_ == ["queue", "queue", "queue", "wait", "release", "release", "release"]
    d.verify(sink.records)  # the logits rows held after the wait, confirmed in order


def test_direct_items_are_handed_over_one_behind_and_only_after_their_copies(
        make_driver, monkeypatch):
    """Batches handed over in the middle of a round (every ``_EMIT_BYTES``) go to the
    sink only after a wait for a fence behind the copies that filled them, and one item
    behind: the next item's copies are queued before the previous item's batches go
    (its copies run while the next records are built)."""
    from dmi_sglang.adapters.transport import _drain
    from dmi_sglang.adapters.transport._device import DeviceOps

    events: list[tuple[str, object]] = []
    real_queue, real_wait = DeviceOps.queue_to_host, DeviceOps.wait

    def queue_to_host(self, markers, pairs):
        spent = real_queue(self, markers, pairs)
        events.append(("queue", self._queued))  # work queued so far, this copy included
        return spent

    def wait(self, fence):
        events.append(("wait", fence.upto))
        real_wait(self, fence)

    monkeypatch.setattr(DeviceOps, "queue_to_host", queue_to_host)
    monkeypatch.setattr(DeviceOps, "wait", wait)
    monkeypatch.setattr(_drain, "_EMIT_BYTES", 1)  # a hand-over after every item
    go = threading.Event()
    real_linger = _drain.Drain._linger
    monkeypatch.setattr(_drain.Drain, "_linger",
                        lambda self, item: (go.wait(30), real_linger(self, item))[1])
    d, sink = make_driver("resid_pre", payload_bytes=1 << 20, coalesce_decode=False)
    real_put = sink.put
    monkeypatch.setattr(sink, "put", lambda batch: (events.append(("put", batch.request_ids)),
                                                    real_put(batch)))
    for rid in ("a", "b", "c"):
        d.forward(BatchLayout.extend([rid], [0], [4]))
    go.set()
    d.t.stop()
    queued = [n for kind, n in events if kind == "queue"]
    assert len(queued) == 3
    filled = dict(zip(("a", "b", "c"), queued, strict=True))  # work that fills each
    waited = 0
    puts = {}
    for i, (kind, value) in enumerate(events):
        if kind == "wait":
            waited = max(waited, value)
        elif kind == "put":
            (rid,) = value
            assert waited >= filled[rid], events  # its copies were waited for
            puts.setdefault(rid, i)
    assert set(puts) == {"a", "b", "c"}
    second_queue = next(i for i, (kind, n) in enumerate(events)
                        if kind == "queue" and n == filled["b"])
    assert second_queue < puts["a"], events  # b's copies queued before a's batches go
    d.verify(sink.records)


def test_an_idle_drain_lands_what_it_left_in_flight(make_driver, monkeypatch):
    """A wake-up with more items queued behind it leaves its last flight in flight (its
    copies run while the next items are built). Once nothing is queued, the drain lands
    it before it waits for more: the ring is free again and every batch reached the
    sink, with no further step and no stop (the scheduler may be waiting for that
    space, and would never send another item)."""
    from dmi_sglang.adapters.transport import _drain

    monkeypatch.setattr(_drain, "_BATCH", 1)  # one item a wake-up: more queued behind it
    go = threading.Event()
    real_linger = _drain.Drain._linger
    monkeypatch.setattr(_drain.Drain, "_linger",
                        lambda self, item: (go.wait(30), real_linger(self, item))[1])
    d, sink = make_driver("resid_pre", payload_bytes=1 << 20, coalesce_decode=False)
    for rid in ("a", "b", "c"):
        d.forward(BatchLayout.extend([rid], [0], [4]))
    go.set()
    deadline = time.monotonic() + 10
    while (d.t._alloc.live_regions or len({r.request_id for r in sink.records}) < 3) and (
            time.monotonic() < deadline):
        time.sleep(0.01)
    assert d.t._alloc.live_regions == 0
    assert {r.request_id for r in sink.records} == {"a", "b", "c"}
    d.t.stop()
    d.verify(sink.records)
