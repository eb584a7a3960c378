"""The RecordSink and RecordReader contracts, run against every store backend.

Add a backend in ``conftest.py`` and these run against it unchanged.
"""

from __future__ import annotations

import pytest
import torch

from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.columns import RecordBatchReader, RecordSink
from dmi_sglang.domain.ports import HookTotal, RecordReader, RequestSummary
from dmi_sglang.domain.records import CaptureRecord, RunInfo, RunStatus
from dmi_sglang.errors import StoreError

from . import _data as d
from .conftest import Backend


def _write_run(backend: Backend) -> None:
    """Two complete requests; request ``a`` also has a superseded copy of one range."""
    sink = backend.sink
    run = d.run_info()
    sink.start_run(run)
    sink.put(d.batch(d.request_records("a", 4, 3)))
    sink.put(d.batch([d.record(d.RESID, 0, "a", 0, 2, seq=0)]))  # older, superseded by seq 1
    sink.put(d.batch(d.request_records("b", 2, 2)))
    sink.flush()
    sink.finish_run(d.committed(run), [d.manifest("a", 4, 3), d.manifest("b", 2, 2)])


# -- every sink ---------------------------------------------------------------------------
def test_a_sink_conforms_to_the_port(sink: RecordSink) -> None:
    assert isinstance(sink, RecordSink)


def test_a_sink_takes_a_whole_run_lifecycle(sink: RecordSink) -> None:
    run = d.run_info()
    sink.start_run(run)
    sink.put(d.empty_batch())
    sink.put(d.batch(d.request_records("a", 4, 3)))
    sink.flush()
    sink.finish_run(d.committed(run), [d.manifest("a", 4, 3)])
    sink.close()


# -- store backends: what was put reads back ----------------------------------------------
def test_a_reader_conforms_to_the_port(backend: Backend) -> None:
    assert isinstance(backend.reader(), RecordReader)
    assert isinstance(backend.reader(), RecordBatchReader)


def test_runs_read_back_newest_first_in_their_latest_state(backend: Backend) -> None:
    _write_run(backend)
    older = d.run_info("older-run", started_at="2026-11-30T10:00:00+00:00")
    backend.sink.start_run(older)
    backend.sink.flush()
    reader = backend.reader()
    with reader.session(), reader.session():  # re-entrant
        runs = reader.runs()
        assert [r.run_id for r in runs] == [d.RUN, "older-run"]
        assert [r.status for r in runs] == [RunStatus.COMMITTED, RunStatus.RUNNING]
        run = reader.run(d.RUN)
        assert run is not None
        assert run.captures == d.CAPTURES
        assert reader.run("no-such-run") is None


def test_requests_manifests_and_totals(backend: Backend) -> None:
    _write_run(backend)
    reader = backend.reader()
    a_records = [*d.request_records("a", 4, 3), d.record(d.RESID, 0, "a", 0, 2, seq=0)]
    assert list(reader.requests(d.RUN)) == [
        RequestSummary(d.RUN, "a", len(a_records), sum(len(r.payload) for r in a_records)),
        RequestSummary(d.RUN, "b", 5, sum(len(r.payload) for r in d.request_records("b", 2, 2))),
    ]
    assert reader.manifest(d.RUN, "a") == d.manifest("a", 4, 3)
    assert reader.manifest(d.RUN, "zz") is None
    totals = {t.act_name: t for t in reader.hook_totals(d.RUN)}
    assert totals[d.LOGITS] == HookTotal(d.LOGITS, 1, 2, 3 + 2, (3 + 2) * d.WIDTH * 4)
    assert totals[d.RESID].layers == 2
    assert totals[d.RESID].rows == 2 * 6 + 2 + 2 * 3


def test_records_filter_by_hook_layer_and_overlap(backend: Backend) -> None:
    _write_run(backend)
    reader = backend.reader()
    every = reader.records(d.RUN, "a")
    assert len(every) == 6  # superseded copies included
    layer0 = reader.records(d.RUN, "a", act_name=d.RESID, layer_no=0)
    assert sorted((r.start_token_idx, r.end_token_idx, r.seq) for r in layer0) == [
        (0, 2, 0), (0, 4, 1), (4, 6, 2)]
    late = reader.records(d.RUN, "a", act_name=d.RESID, layer_no=0, start=4, end=5)
    assert [(r.start_token_idx, r.end_token_idx) for r in late] == [(4, 6)]
    want = {(r.act_name, r.layer_no, r.start_token_idx, r.end_token_idx): r.payload
            for r in d.request_records("a", 4, 3)}
    for r in every:
        if r.seq:
            assert r.payload == want[(r.act_name, r.layer_no, r.start_token_idx,
                                      r.end_token_idx)]
    assert sorted(reader.ranges(d.RUN, "b")) == [
        (d.RESID, 0, 0, 0, 2), (d.RESID, 0, 0, 2, 3), (d.RESID, 1, 0, 0, 2),
        (d.RESID, 1, 0, 2, 3), (d.LOGITS, -1, 0, 1, 3)]


def test_a_capture_handle_reads_any_backend(backend: Backend) -> None:
    _write_run(backend)
    handle = CaptureHandle(d.RUN, "a", backend.reader)
    assert handle.missing == ()
    resid0 = handle.get("resid_pre", 0)
    assert resid0.shape == (6, d.WIDTH)
    want = torch.frombuffer(bytearray(b"".join(
        d.row_bytes(d.RESID, 0, "a", p, 1 if p < 4 else 2) for p in range(6))),
        dtype=torch.float32).reshape(6, d.WIDTH)
    assert torch.equal(resid0, want)
    assert handle.logits.shape == (3, d.WIDTH)
    assert not CaptureHandle(d.RUN, "zz", backend.reader).available


def test_delete_run_removes_the_run_and_counts_its_records(backend: Backend) -> None:
    _write_run(backend)
    reader = backend.reader()
    if not backend.deletes:
        with pytest.raises(StoreError, match="cannot be deleted"):
            reader.delete_run(d.RUN)
        assert reader.run(d.RUN) is not None
        return
    assert reader.delete_run(d.RUN) == 6 + 5
    assert reader.run(d.RUN) is None
    assert list(reader.requests(d.RUN)) == []


@pytest.mark.parametrize("name", ["a", "b"])
def test_manifests_are_per_request(backend: Backend, name: str) -> None:
    _write_run(backend)
    got = backend.reader().manifest(d.RUN, name)
    assert got is not None
    assert (got.request_id, got.committed) == (name, True)


def _commit_a(sink: RecordSink) -> RunInfo:
    """A running run whose request ``a`` is committed while it runs."""
    run = d.run_info()
    sink.start_run(run)
    sink.put(d.batch(d.request_records("a", 4, 3)))
    sink.commit_requests([d.manifest("a", 4, 3)])
    return run


def test_a_committed_request_reads_back_while_its_run_runs(backend: Backend) -> None:
    sink = backend.sink
    _commit_a(sink)
    sink.put(d.batch(d.request_records("b", 2, 2)))  # not finished
    sink.flush()
    reader = backend.reader()
    assert reader.run(d.RUN).status is RunStatus.RUNNING  # type: ignore[union-attr]
    assert reader.manifest(d.RUN, "a") == d.manifest("a", 4, 3)
    assert [m.request_id for m in reader.manifests(d.RUN)] == ["a"]
    assert CaptureHandle(d.RUN, "a", backend.reader).missing == ()
    assert not CaptureHandle(d.RUN, "b", backend.reader).available


def _within(backend: Backend, captures: list[tuple[str, int]], start: int,
            end: int) -> list[CaptureRecord]:
    """``batches_within``'s records, one object each, in the answer's order."""
    batches = backend.reader().batches_within(d.RUN, "a", captures=captures, start=start,
                                               end=end)
    return [r for b in batches for r in b.records()]


def test_batches_within_hold_the_records_cut_to_the_range(backend: Backend) -> None:
    _write_run(backend)
    cut = _within(backend, [(d.RESID, 0)], 1, 5)
    got = sorted((r.start_token_idx, r.end_token_idx, r.seq, r.shape) for r in cut)
    assert got == [(1, 2, 0, (1, d.WIDTH)), (1, 4, 1, (3, d.WIDTH)), (4, 5, 2, (1, d.WIDTH))]
    for r in cut:
        assert r.payload == b"".join(d.row_bytes(d.RESID, 0, "a", p, r.seq)
                                     for p in range(r.start_token_idx, r.end_token_idx))
        assert (r.model_id, r.request_id, r.shard_rank, r.dtype) == (
            d.RUN, "a", 0, "torch.float32")
    for empty in ((2, 2), (3, 1)):
        assert _within(backend, [(d.RESID, 0)], *empty) == []
    assert _within(backend, [], 0, 5) == []


def test_batches_within_read_several_captures_at_once_in_their_order(
        backend: Backend) -> None:
    _write_run(backend)
    one = {c: _within(backend, [c], 0, 9) for c in [(d.RESID, 0), (d.RESID, 1)]}
    both = _within(backend, [(d.RESID, 1), (d.RESID, 0), ("no_such_hook", 0)], 0, 9)
    assert one[(d.RESID, 0)]
    assert one[(d.RESID, 1)]
    key = [(r.act_name, r.layer_no, r.start_token_idx, r.seq, bytes(r.payload)) for r in both]
    assert key == [(r.act_name, r.layer_no, r.start_token_idx, r.seq, bytes(r.payload))
                   for r in one[(d.RESID, 0)] + one[(d.RESID, 1)]]  # by layer, start, seq


def test_the_latest_manifest_of_each_request_is_listed(backend: Backend) -> None:
    sink = backend.sink
    run = _commit_a(sink)
    sink.flush()
    sink.finish_run(d.committed(run), [d.manifest("b", 2, 2), d.manifest("a", 4, 2)])
    got = {m.request_id: m for m in backend.reader().manifests(d.RUN)}
    assert got == {"a": d.manifest("a", 4, 2), "b": d.manifest("b", 2, 2)}  # a's newest


def test_extents_name_each_hooks_dtype_and_row_shape_and_its_ranges(
        backend: Backend) -> None:
    _write_run(backend)
    reader = backend.reader()
    extents = reader.extents(d.RUN, "b")
    assert [(x.act_name, x.layer_no, x.dtype, x.row_shape) for x in extents.layouts] == [
        (d.RESID, 0, "torch.float32", (d.WIDTH,)), (d.RESID, 1, "torch.float32", (d.WIDTH,)),
        (d.LOGITS, -1, "torch.float32", (d.WIDTH,))]  # by act_name, then layer
    assert list(extents.ranges) == sorted(reader.ranges(d.RUN, "b"))
    assert extents.ranges  # the request has records
    assert reader.extents(d.RUN, "no-such-request") == type(extents)((), ())
