"""The read-back handle at its edges: layer arguments, a layer keeping no position, the
handle of a run that stored nothing, and ``--partial`` reads of a run still writing."""

from __future__ import annotations

import copy
import pickle

import attrs
import pytest
import torch

from dmi_sglang.app.handle import CaptureHandle, NoStoreHandle
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.testing import MemoryReader, MemorySink

RESID = "blocks.hook_resid_pre"
EMBED = "hook_embed"


def _rec(act: str, layer: int, start: int, end: int, *, seq: int = 1) -> CaptureRecord:
    rows = torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, 4)
    rows = rows.to(torch.bfloat16)
    return CaptureRecord("r", "q", act, layer, 0, start, end, str(torch.bfloat16),
                         tuple(rows.shape), rows.view(torch.uint8).numpy().tobytes(), seq)


def _sink(selection: str, captures: list[tuple[str, int]], records: list[CaptureRecord], *,
          prompt: int, completion: int, status: RunStatus = RunStatus.COMMITTED,
          committed: bool = True, **manifest: object) -> MemorySink:
    sink = MemorySink()
    run = RunInfo("r", "/m", (("DMX_HOOK_SELECTION", selection),), tuple(captures), "2026")
    sink.start_run(run)
    if records:
        sink.put(RecordBatch.from_records(records))
    if status is not RunStatus.RUNNING:
        sink.finish_run(attrs.evolve(run, status=status, stopped_at="x"),
                        [RequestManifest("r", "q", prompt, completion, committed=committed,
                                         **manifest)])  # type: ignore[arg-type]
    return sink


def _handle(sink: MemorySink, *, partial: bool = False) -> CaptureHandle:
    return CaptureHandle("r", "q", lambda: MemoryReader(sink), partial=partial)


def test_a_layer_given_for_a_global_hook_is_refused() -> None:
    """It was dropped: ``get("embed", layer=1)`` returned the global tensor."""
    sink = _sink("embed,resid_pre", [(EMBED, -1), (RESID, 0), (RESID, 1)],
                 [_rec(EMBED, -1, 0, 5), _rec(RESID, 0, 0, 5), _rec(RESID, 1, 0, 5)],
                 prompt=3, completion=3)
    h = _handle(sink)
    assert h.get("embed").shape == (5, 4)
    with pytest.raises(ValueError, match="global"):
        h.get("embed", layer=1)
    with pytest.raises(ValueError, match="global"):
        h.positions("embed", layer=3)
    with pytest.raises(ValueError, match="global"):
        _handle(sink, partial=True).get("embed", layer=1)


def test_a_partial_handle_asks_for_the_layer_of_a_per_layer_hook() -> None:
    """It said "layer -1 was not captured" instead."""
    sink = _sink("resid_pre", [(RESID, 0), (RESID, 1)],
                 [_rec(RESID, 0, 0, 3), _rec(RESID, 1, 0, 3)],
                 prompt=3, completion=3, status=RunStatus.FAILED, committed=False)
    h = _handle(sink, partial=True)
    assert h.get("resid_pre", 0).shape == (3, 4)
    with pytest.raises(ValueError, match="pass layer="):
        h.get("resid_pre")
    with pytest.raises(ValueError, match="pass layer="):
        h.partial_positions("resid_pre")


def test_hidden_states_keep_row_shape_and_dtype_when_no_position_is_kept() -> None:
    """positions(8-9) on a request of 5 + 1 tokens keeps nothing: ``get`` gave
    ``[0, 4]`` bf16 and ``hidden_states`` ``[0]`` float32."""
    sink = _sink("resid_pre:positions(8-9)", [(RESID, 0), (RESID, 1)],
                 [_rec(RESID, 0, 0, 5), _rec(RESID, 1, 0, 5)], prompt=5, completion=1,
                 overlap_extra_forward=True)
    h = _handle(sink)
    assert h.available
    by_get = [h.get("resid_pre", n) for n in (0, 1)]
    assert [(t.shape, t.dtype) for t in by_get] == [(torch.Size([0, 4]), torch.bfloat16)] * 2
    assert [(t.shape, t.dtype) for t in h.hidden_states] == [
        (t.shape, t.dtype) for t in by_get]


def test_a_no_store_handle_can_be_probed_copied_and_pickled() -> None:
    """Every generate output holds one under DMX_DB_URL=none: ``hasattr``, ``deepcopy``
    of the output and ``pickle`` raised (or recursed) on it."""
    h = NoStoreHandle("r", "q")
    assert not hasattr(h, "_repr_html_")
    out = {"text": "hi", "meta_info": {"id": "q"}, "dmi_internal": h}
    assert copy.deepcopy(out)["dmi_internal"].request_id == "q"
    assert copy.copy(h).run_id == "r"
    assert pickle.loads(pickle.dumps(h)).request_id == "q"
    with pytest.raises(Exception, match="stored nothing"):
        _ = h.hidden_states


class _GrowingReader(MemoryReader):
    """A live run's store: a writer stores one more record right after each ranges()."""

    def __init__(self, sink: MemorySink, pending: list[CaptureRecord]) -> None:
        super().__init__(sink)
        self._pending = pending

    def ranges(self, run_id: str, request_id: str) -> list[tuple[str, int, int, int, int]]:
        out = list(super().ranges(run_id, request_id))
        if self._pending:
            self._sink.put(RecordBatch.from_records([self._pending.pop(0)]))
        return out


def test_partial_tensors_rows_match_the_positions_they_are_named_with() -> None:
    """``show`` / ``export --partial`` named positions 0-4 beside 6 rows when a record
    landed between reading the positions and the rows."""
    from dmi_sglang.app.cli_commands import _partial_tensors, _PartialRead

    sink = _sink("resid_pre", [(RESID, 0)], [_rec(RESID, 0, 0, 4)],
                 prompt=6, completion=4, status=RunStatus.RUNNING)
    reader = _GrowingReader(sink, [_rec(RESID, 0, 4, 6, seq=2), _rec(RESID, 0, 6, 7, seq=3)])

    class Store:
        def handle(self, run_id: str, request_id: str, *,
                   partial: bool = False) -> CaptureHandle:
            return CaptureHandle(run_id, request_id, lambda: reader, partial=partial)

    read = _PartialRead()
    [(name, kept, tensor)] = list(_partial_tensors(Store(), "r", "q", read))  # type: ignore[arg-type]
    assert tensor.shape[0] == len(kept), (name, kept, tensor.shape)
    assert not read.complete  # the run is still running
