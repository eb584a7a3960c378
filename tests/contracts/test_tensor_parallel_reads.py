"""A TP=2 run read back on every store backend (``_tp_data``): the handle and the export
return the whole tensors (the shapes a TP=1 run has), and a missing or stray part is
reported."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load as load_safetensors

from dmi_sglang.app.export import StoreReads
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.errors import IncompleteCaptureError, StoreError

from ._tp_data import PROMPT, RUN, RUN_INFO, finish, stored, whole_tensors, write
from .conftest import Backend


def test_a_tp2_capture_reads_back_whole_through_the_handle(backend: Backend) -> None:
    wholes = write(backend.sink)
    handle = CaptureHandle(RUN, "r", backend.reader)
    assert handle.missing == ()
    for name, whole in wholes.items():
        got = handle.get(name, 0)
        assert got.shape == whole.shape, name
        assert torch.equal(got, whole), name
    assert torch.equal(handle.get("q", 0, start=1, end=4), wholes["q"][1:4])
    assert torch.equal(handle.hidden_states[0], wholes["resid_pre"])


def test_a_tp2_capture_exports_whole_tensors(backend: Backend) -> None:
    wholes = write(backend.sink)
    reads = StoreReads(backend.reader)
    listing = reads.listing(RUN, "r")
    assert listing["complete"]
    shapes = {t["hook"]: t["shape"] for t in listing["tensors"]}  # type: ignore[attr-defined]
    assert shapes == {hook_by_name(n).act_name: list(w.shape) for n, w in wholes.items()}
    tensors = load_safetensors(b"".join(reads.safetensors(RUN, "r")[1]))
    for name, whole in wholes.items():
        assert torch.equal(tensors[f"{hook_by_name(name).act_name}.0"], whole), name


@pytest.mark.parametrize(("hook", "shard"), [("q", 1), ("attn_out", 0)])
def test_a_missing_part_makes_the_capture_incomplete(backend: Backend, hook: str,
                                                     shard: int) -> None:
    write(backend.sink, drop={(hook, shard, 1)})  # the part's decode step is lost
    handle = CaptureHandle(RUN, "r", backend.reader)
    act = hook_by_name(hook).act_name
    assert handle.missing == (f"{act} layer 0 shard_rank {shard}: positions [3, 4) missing",)
    with pytest.raises(IncompleteCaptureError, match=f"shard_rank {shard}"):
        handle.get(hook, 0)
    assert StoreReads(backend.reader).listing(RUN, "r")["complete"] is False
    # what an interrupted run's reader may take: the positions every part holds
    partial = CaptureHandle(RUN, "r", backend.reader, partial=True)
    assert partial.partial_positions(hook, 0) == range(0, PROMPT)
    assert torch.equal(partial.get(hook, 0), whole_tensors()[hook][:PROMPT])


def test_a_partial_read_takes_the_positions_every_part_holds(backend: Backend) -> None:
    write(backend.sink, drop={("q", 1, 0)})  # shard 1 holds only the decode step [3, 4)
    partial = CaptureHandle(RUN, "r", backend.reader, partial=True)
    assert partial.partial_positions("q", 0) == range(PROMPT, PROMPT + 1)
    assert torch.equal(partial.get("q", 0), whole_tensors()["q"][PROMPT:])


def test_parts_that_share_no_position_read_nothing(backend: Backend) -> None:
    write(backend.sink, drop={("q", 0, 1), ("q", 1, 0)})  # shard 0 [0, 3), shard 1 [3, 4)
    partial = CaptureHandle(RUN, "r", backend.reader, partial=True)
    with pytest.raises(IncompleteCaptureError, match="share no position from 3"):
        partial.get("q", 0)


def test_a_part_the_plan_does_not_store_is_a_damaged_store(backend: Backend) -> None:
    write(backend.sink, stray=True)
    handle = CaptureHandle(RUN, "r", backend.reader)
    reason = ("blocks.hook_resid_pre layer 0: records of shard_rank [1], but the run stores "
              "1 part(s) of it")
    assert handle.missing == (reason,)
    reads = StoreReads(backend.reader)
    assert reads.listing(RUN, "r")["missing"] == [reason]
    with pytest.raises(IncompleteCaptureError, match=re.escape(reason)):
        reads.safetensors(RUN, "r")  # refused before any byte is sent
    with pytest.raises(StoreError, match="shard_rank 1, but the run stores 1 part"):
        CaptureHandle(RUN, "r", backend.reader, partial=True).get("resid_pre", 0)


def test_batches_within_answer_one_batch_per_part_in_shard_order(backend: Backend) -> None:
    write(backend.sink)
    batches = backend.reader().batches_within(
        RUN, "r", captures=[(hook_by_name(n).act_name, 0) for n in ("q", "resid_pre")],
        start=0, end=PROMPT + 1)
    assert [b.shard_rank for b in batches] == [0, 1]
    assert all(r.shard_rank == b.shard_rank for b in batches for r in b.records())
    acts = [[r.act_name for r in b.records()] for b in batches]
    assert acts == [["blocks.attn.hook_q"] * 2 + ["blocks.hook_resid_pre"] * 2,
                    ["blocks.attn.hook_q"] * 2]


def _write_with_negative_stray(backend: Backend) -> None:
    """The TP=2 run of ``_tp_data`` plus one record of resid_pre as ``shard_rank -1``, a
    part no plan has (the Int32 column and RecordBatch both take it)."""
    wholes = whole_tensors()
    backend.sink.start_run(RUN_INFO)
    for batch in stored(wholes):
        backend.sink.put(batch)
    rows = (wholes["resid_pre"][:PROMPT] * 0 + 999).contiguous()
    backend.sink.put(RecordBatch.from_records([CaptureRecord(
        model_id=RUN, request_id="r", act_name=hook_by_name("resid_pre").act_name,
        layer_no=0, shard_rank=-1, start_token_idx=0, end_token_idx=PROMPT,
        dtype="torch.float32", shape=tuple(rows.shape), payload=rows.numpy().tobytes(),
        seq=5)]))
    finish(backend.sink)


def _write_with_uneven_q(backend: Backend) -> None:
    """The TP=2 run of ``_tp_data``, but shard_rank 1 of q holds one head where shard 0
    holds two: parts that cannot be joined (SGLang splits heads evenly)."""
    wholes = whole_tensors()
    backend.sink.start_run(RUN_INFO)
    for batch in stored(wholes, drop={("q", 1, 0), ("q", 1, 1)}):
        backend.sink.put(batch)
    for seq, (start, end) in enumerate(((0, PROMPT), (PROMPT, PROMPT + 1))):
        rows = wholes["q"][start:end, 3:4].contiguous()
        backend.sink.put(RecordBatch.from_records([CaptureRecord(
            model_id=RUN, request_id="r", act_name=hook_by_name("q").act_name, layer_no=0,
            shard_rank=1, start_token_idx=start, end_token_idx=end, dtype="torch.float32",
            shape=tuple(rows.shape), payload=rows.numpy().tobytes(), seq=seq)]))
    finish(backend.sink)


@pytest.mark.parametrize("write_damaged", [_write_with_negative_stray, _write_with_uneven_q],
                         ids=["negative-shard-rank", "parts-of-two-shapes"])
def test_a_damaged_store_is_incomplete_and_its_export_is_refused_before_any_byte(
        backend: Backend, write_damaged: Callable[[Backend], None]) -> None:
    """A part no plan has, or parts whose rows cannot be joined: ``get()`` refuses them,
    so the capture is not reported available and an export sends nothing (it once sent
    its header, a 200 with its length, and then failed mid-stream)."""
    write_damaged(backend)
    assert CaptureHandle(RUN, "r", backend.reader).missing != ()
    reads = StoreReads(backend.reader)
    assert reads.listing(RUN, "r")["complete"] is False
    with pytest.raises(LookupError):
        reads.safetensors(RUN, "r")
