"""Faults on the capture transport's own threads (the drain and its copy workers).

Each test's docstring is one row of docs/reliability.md. The transport runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmi_sglang.adapters.transport import create_transport
from dmi_sglang.domain.hooks import CATALOG, ModelHooks, parse_selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import make_plan
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.errors import CaptureError
from dmi_sglang.testing import MemorySink

from ._faults import within

SHAPE = ModelShape(num_layers=1, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=8,
                   vocab=10)


class _BuggySink(MemorySink):
    """A sink with a bug: ``put`` raises a plain RuntimeError (not a StoreError)."""

    def put(self, records: Sequence[CaptureRecord]) -> None:
        msg = "bug in the sink"
        raise RuntimeError(msg)


def test_fault_an_unexpected_exception_on_the_drain_thread() -> None:
    """Any exception on the drain thread (here a sink bug raising RuntimeError) -> stop
    raises CaptureError with it as the cause, again on every later stop; nothing hangs."""
    selection = parse_selection("resid_pre").resolve(
        ModelHooks("Toy", frozenset(h.name for h in CATALOG), 1))
    transport = create_transport(
        payload_mb=1, pinned_mb=1, task_entries=64, padding_strip=True, flush_timeout_us=1000,
        selection=selection, shape=SHAPE, max_graph_batch=1,
        sink=_BuggySink(), run_id="run", device="cpu", max_prefill_tokens=16, max_requests=1)
    layout = BatchLayout.extend(["a"], [0], [4])
    transport.commit(make_plan(layout, selection, SHAPE, padded=False), step=1)
    transport.capturer.capture("resid_pre", 0, torch.ones(4, 8, dtype=torch.bfloat16))
    transport.seal()
    first = within(transport.stop)
    assert isinstance(first, CaptureError), first
    assert isinstance(first.__cause__, RuntimeError)
    again = within(transport.stop)
    assert isinstance(again, CaptureError)
    assert "bug in the sink" in str(again)
