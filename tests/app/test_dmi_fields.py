"""The capture handle answers to DMI's readback field names (per request, no padding)."""

from __future__ import annotations

import struct

import attrs
import pytest
import torch

from dmi_sglang.app.handle import DMI_GLOBAL_FIELDS, DMI_LAYER_FIELDS, CaptureHandle
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.errors import IncompleteCaptureError
from dmi_sglang.testing import MemoryReader, MemorySink

CAPTURES = (("blocks.hook_resid_mid", 0), ("blocks.hook_resid_mid", 1), ("hook_final_ln", -1),
            ("blocks.hook_ln1", 1))


def _record(act: str, layer: int, value: float) -> CaptureRecord:
    payload = struct.pack("<6f", *([value] * 6))
    return CaptureRecord(model_id="run", request_id="r", act_name=act, layer_no=layer,
                         shard_rank=0, start_token_idx=0, end_token_idx=3,
                         dtype="torch.float32", shape=(3, 2), payload=payload, seq=1)


def _handle() -> CaptureHandle:
    sink = MemorySink()
    run = RunInfo("run", "/m", (), CAPTURES, "2026-12-01T10:00:00+00:00")
    sink.start_run(run)
    sink.put(RecordBatch.from_records(
        [_record(act, layer, 10 * layer + i) for i, (act, layer) in enumerate(CAPTURES)]))
    sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED),
                    [RequestManifest("run", "r", 3, 1, committed=True)])
    return CaptureHandle("run", "r", lambda: MemoryReader(sink))


def test_dmi_field_names_read_the_same_rows_as_our_hook_names() -> None:
    handle = _handle()
    middle = handle.middle_residual
    assert isinstance(middle, tuple)
    assert len(middle) == 2
    for layer, tensor in enumerate(middle):
        assert torch.equal(tensor, handle.get("resid_mid", layer))
    assert float(middle[1][0, 0]) == 11.0
    assert torch.equal(handle.final_hidden, handle.get("final_ln"))  # type: ignore[arg-type]
    assert set(DMI_LAYER_FIELDS) >= {"attention_output", "attention_values", "mlp_activation"}
    assert set(DMI_GLOBAL_FIELDS) == {"embeddings", "final_hidden", "final_residual"}


def test_a_field_without_every_layer_or_not_captured_says_so() -> None:
    handle = _handle()
    with pytest.raises(IncompleteCaptureError, match=r"layers 0\.\.L-1; captured: \[1\]"):
        _ = handle.ln1  # only layer 1 was captured
    with pytest.raises(IncompleteCaptureError, match="was not captured"):
        _ = handle.embeddings
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        _ = handle.bogus
