"""Payload modifiers on the capture path: a storage dtype casts rows on the device and
``final_logits:topk(K)`` keeps the K largest logits of each row, before the rows reach
the ring (fewer bytes moved), in graph replays, eager forwards and piecewise steps."""

from __future__ import annotations

import pytest
import torch

from dmi_sglang.domain.layout import BatchLayout

from .conftest import raw_bytes, rows_tensor, stored_rows, two_requests


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("coalesce", [True, False], ids=["window", "per-step"])
@pytest.mark.parametrize("topk_chunk", [0, 1], ids=["torch-topk", "chunk-maxima"])
def test_modified_captures_store_the_transformed_rows_of_a_full_capture(
        make_driver, padded: bool, coalesce: bool, topk_chunk: int) -> None:
    """(``DMX_TOPK_CHUNK=1``: the 10 logits of a row as 10 chunks, more than twice K=3, so
    the chunk maxima pick the 3 chunks searched.)"""
    full, full_sink = make_driver("resid_pre,q,final_logits", coalesce_decode=coalesce)
    some, some_sink = make_driver("resid_pre:fp16,q:bf16,final_logits:topk(3)",
                                  coalesce_decode=coalesce, topk_chunk=topk_chunk)
    for d in (full, some):
        two_requests(d, padded=padded)
    full_stats, some_stats = full.t.stop(), some.t.stop()
    some.verify(some_sink.records)  # every row once, its bytes the transformed rows

    by_row = _rows_by_key(full_sink)
    for (rid, act, layer, pos), data in _rows_by_key(some_sink).items():
        source = "final_logits" if act.startswith("logits_topk") else act
        full_row = torch.frombuffer(bytearray(by_row[rid, source, layer, pos]),
                                    dtype=_dtype(full_sink, source))
        if act == "logits_topk_values":
            assert data == raw_bytes(torch.topk(full_row, 3).values)
        elif act == "logits_topk_ids":
            assert data == raw_bytes(torch.topk(full_row, 3).indices.to(torch.int32))
        elif act == "blocks.hook_resid_pre":
            assert data == raw_bytes(full_row.to(torch.float16))
        else:  # q is computed in bf16 already: stored as is
            assert data == bytes(by_row[rid, source, layer, pos])
    # resid_pre rows: bf16 -> fp16, same size; logits rows: 10 fp32 -> 3 fp32 + 3 int32
    logit_rows = sum(1 for k in _rows_by_key(full_sink) if k[1] == "final_logits")
    assert full_stats.bytes - some_stats.bytes == logit_rows * (40 - 24)
    assert some_stats.fp16_overflows == 0


def test_topk_logits_alone_install_the_logits_point_and_store_no_full_row(make_driver):
    d, sink = make_driver("final_logits:generated:topk(2)")
    assert d.t.capturer.wants("final_logits", -1)
    d.prompts = {"a": 5, "b": 3}
    two_requests(d, padded=True)
    d.t.stop()
    d.verify(sink.records)
    assert {r.act_name for r in sink.records} == {"logits_topk_values", "logits_topk_ids"}
    assert all(r.shape[1:] == (2,) for r in sink.records)


def test_values_beyond_fp16_are_counted_as_overflows(make_driver) -> None:
    d, _ = make_driver("resid_pre@0:fp16")
    layout = BatchLayout.extend(["a"], [0], [3])
    d.t.commit(d.plan(layout), step=1)
    big = torch.full((3, 8), 1.0, dtype=torch.bfloat16)
    big[0, :5] = 7e4  # beyond fp16's 65504: five values become inf
    big[1, 0] = -1e5
    big[2, 0] = float("inf")  # already infinite: not an overflow
    d.t.capturer.capture("resid_pre", 0, big)
    d.t.seal()
    assert d.t.stop().fp16_overflows == 6


def test_a_transform_runs_only_when_its_rows_are_used(make_driver) -> None:
    d, _ = make_driver("resid_pre@0:fp16")
    big = torch.full((3, 8), 1e5, dtype=torch.bfloat16)
    d.t.capturer.capture("resid_pre", 0, big)  # a warm-up forward: no step committed
    assert d.t.stop().fp16_overflows == 0


def test_sink_payloads_cover_the_stored_dtype(make_driver) -> None:
    d, sink = make_driver("resid_pre@1:fp16")
    layout = BatchLayout.extend(["a"], [0], [4])
    d.forward(layout)
    d.t.stop()
    (rec,) = sink.records
    assert rec.dtype == "torch.float16"
    from dmi_sglang.domain.hooks import hook_by_name

    want = rows_tensor(hook_by_name("resid_pre"), 1, [("a", p) for p in range(4)])
    assert rec.payload == raw_bytes(want.to(torch.float16))


def _rows(sink):
    return list(stored_rows(sink.records))


def _rows_by_key(sink) -> dict[tuple[str, str, int, int], bytes]:
    return {(rid, act, layer, pos): data for rid, act, layer, pos, data in _rows(sink)}


def _dtype(sink, act: str) -> torch.dtype:
    name = next(r.dtype for r in sink.records if r.act_name == act)
    return getattr(torch, name.removeprefix("torch."))


def test_a_cast_capture_still_refuses_a_tensor_of_another_dtype(make_driver) -> None:
    from dmi_sglang.domain.hooks import hook_by_name
    from dmi_sglang.errors import CaptureError

    d, _ = make_driver("final_ln:fp16,final_logits:topk(2)")
    layout = BatchLayout.extend(["a"], [0], [2])
    d.t.commit(d.plan(layout), step=1)
    wrong = rows_tensor(hook_by_name("final_ln"), -1, layout.positions()).to(torch.float64)
    with pytest.raises(CaptureError, match=r"dtype torch\.float64 differs"):
        d.t.capturer.capture("final_ln", -1, wrong)
    logits = rows_tensor(hook_by_name("final_logits"), -1, [("a", 1)]).to(torch.float16)
    with pytest.raises(CaptureError, match=r"dtype torch\.float16 differs"):
        d.t.capturer.capture("final_logits", -1, logits)
