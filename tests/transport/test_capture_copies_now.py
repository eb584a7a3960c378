"""The capturer's contract (``tensor_ports.Capturer.capture``): the rows are copied
before ``capture`` returns, so the model may overwrite the tensor in place right after
(SGLang's RoPE rotates q and k in place, its sampler the logits, its fused norms the
residual). The capture points hand over the model's own tensors, never clones."""

from __future__ import annotations

import pytest
import torch

from dmi_sglang.domain.layout import BatchLayout

from .conftest import WrappedCapturer, stored_rows
from .test_last_rule import LAST, _serve


class Scribbling(WrappedCapturer):
    """Captures, then overwrites the tensor."""

    scribbled = 0

    def capture(self, hook_name: str, layer_no: int, tensor: torch.Tensor) -> None:
        super().capture(hook_name, layer_no, tensor)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        else:
            tensor.fill_(-7)
        self.scribbled += 1


def _scribbled(d) -> Scribbling:
    d.t.capturer = Scribbling(d.t.capturer)
    return d.t.capturer


@pytest.mark.parametrize("coalesce", [True, False], ids=["window", "per-step"])
def test_rows_overwritten_after_their_capture_arrive_as_captured(make_driver, coalesce):
    # eager prefill into the ring, a prefill larger than the ring (piecewise), decode
    # graph steps through the arena (its slots and landing), padded and plain decodes
    # (every(2): the ring keeps every other row of a forward, an index_select at capture)
    d, sink = make_driver("resid_pre,q:every(2),final_logits", payload_bytes=4096,
                          max_prefill_tokens=64, coalesce_decode=coalesce)
    scribbling = _scribbled(d)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    d.forward(BatchLayout.extend(["long"], [0], [60]))  # > the 4 KiB ring: piecewise
    d.graph_capture(4)
    for n in range(4):
        d.forward(BatchLayout.decode(["a", "b", "long"], [6 + n, 4 + n, 61 + n],
                                     padded_batch_size=4), padded=True)
        d.forward(BatchLayout.decode(["a", "b"], [10 + n, 8 + n]))
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.piecewise_steps >= 1
    assert scribbling.scribbled > 0


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_last_rows_overwritten_after_their_capture_arrive_as_captured(make_driver, padded):
    full, full_sink = make_driver("resid_pre,final_logits")
    some, some_sink = make_driver("resid_pre:last,final_logits:last")
    scribbling = _scribbled(some)
    for d in (full, some):
        _serve(d, padded=padded)
        d.t.stop()
    want = {row for row in stored_rows(full_sink.records) if row[3] == LAST[row[0]]}
    assert set(stored_rows(some_sink.records)) == want
    assert scribbling.scribbled > 0
