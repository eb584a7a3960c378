"""Strided capture sources (SGLang's q, k and v are column slices of its qkv tensor):
copied as the widest elements their layout allows, every byte as captured."""

from __future__ import annotations

import pytest
import torch

from dmi_sglang.adapters.transport._device import copy_rows, widest
from dmi_sglang.domain.layout import BatchLayout

from .conftest import WrappedCapturer, stored_rows
from .test_last_rule import LAST, _serve


def _slice_of_wider(t: torch.Tensor, before: int) -> torch.Tensor:
    """``t``'s values as a column slice of a wider tensor, ``before`` columns in."""
    rows = t.reshape(t.shape[0], -1)
    wide = torch.full((rows.shape[0], rows.shape[1] + before + 4), 7, dtype=t.dtype)
    wide[:, before : before + rows.shape[1]] = rows
    return wide[:, before : before + rows.shape[1]].view(t.shape)


@pytest.mark.parametrize(("before", "width", "dtype", "element"), [
    (0, 16, torch.bfloat16, 8),   # a qkv slice at column 0: 4 values an element
    (16, 8, torch.bfloat16, 8),   # k: further in
    (2, 16, torch.bfloat16, 4),   # two values in: 4-byte elements
    (1, 16, torch.bfloat16, 2),   # odd offset: as it is
    (4, 6, torch.bfloat16, 4),    # width 6: not a multiple of 4 values
    (2, 8, torch.float32, 8),
    (1, 8, torch.float32, 4),
])
def test_a_strided_source_is_copied_as_wide_elements_and_exact(before, width, dtype,
                                                              element) -> None:
    src = _slice_of_wider(torch.randn(5, width).to(dtype), before)
    assert not src.is_contiguous()
    dst = torch.zeros(5, width, dtype=dtype)
    assert copy_rows(dst, src) == element
    assert torch.equal(dst, src)


def test_indexed_copies_take_the_wide_views_too() -> None:
    src = _slice_of_wider(torch.randn(5, 16).to(torch.bfloat16), 4)
    slots = torch.zeros(3, 5, 16, dtype=torch.bfloat16)
    dst, wide_src = widest(slots, src.unsqueeze(0))
    assert (dst.dtype, wide_src.dtype) == (torch.int64, torch.int64)
    dst.index_copy_(0, torch.tensor([1]), wide_src)
    assert torch.equal(slots[1], src)
    assert not slots[0].any()
    assert not slots[2].any()


def test_a_contiguous_source_is_copied_as_it_is() -> None:
    src = torch.randn(4, 8).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    assert copy_rows(dst, src) == 2
    assert torch.equal(dst, src)


class Strided(WrappedCapturer):
    """Hands on every tensor as a column slice of a wider one, ``before`` columns in (as
    SGLang hands over q, k and v)."""

    def __init__(self, inner, before: int) -> None:
        super().__init__(inner)
        self.before = before

    def capture(self, hook_name: str, layer_no: int, tensor: torch.Tensor) -> None:
        super().capture(hook_name, layer_no,
                        _slice_of_wider(tensor, self.before) if tensor.dim() >= 2 else tensor)


@pytest.mark.parametrize("before", [0, 4, 1])
@pytest.mark.parametrize("selection", [
    "resid_pre,q:every(2),final_logits",  # arena landing slot; ring rows kept by index
    "q@1,final_logits",  # two places: arena slots written by index
])
def test_strided_captures_arrive_exact(make_driver, before, selection) -> None:
    d, sink = make_driver(selection, payload_bytes=4096, max_prefill_tokens=64)
    d.t.capturer = Strided(d.t.capturer, before)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    d.forward(BatchLayout.extend(["long"], [0], [60]))  # piecewise
    d.graph_capture(4)
    for n in range(3):
        d.forward(BatchLayout.decode(["a", "b", "long"], [6 + n, 4 + n, 61 + n],
                                     padded_batch_size=4), padded=True)
        d.forward(BatchLayout.decode(["a", "b"], [9 + n, 7 + n]))
    d.t.stop()
    d.verify(sink.records)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_strided_last_captures_arrive_exact(make_driver, padded) -> None:
    full, full_sink = make_driver("resid_pre,final_logits")
    some, some_sink = make_driver("resid_pre:last,final_logits:last")
    some.t.capturer = Strided(some.t.capturer, 4)
    for d in (full, some):
        _serve(d, padded=padded)
        d.t.stop()
    want = {row for row in stored_rows(full_sink.records) if row[3] == LAST[row[0]]}
    assert set(stored_rows(some_sink.records)) == want
