"""The export's rows, on the real embedded store: whatever the chunking, retractions and
piece size, the exported tensor is the latest copy of each position (what the handle
reads); rows that lie as one run of records are sent as one slice of the store's answer,
without one object per record."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_safetensors

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.app import export
from dmi_sglang.app.export import StoreReads
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.store_config import StoreConfig

from ._support import RESID, embedded, handle, manifest, records_of, run_info

PROMPT = 4


@st.composite
def stored_rows(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[int, int]], int]:
    """Positions, the forwards' bounds, retracted-and-forwarded-again spans, piece bytes."""
    positions = draw(st.integers(PROMPT + 1, 24))
    cuts = draw(st.sets(st.integers(1, positions - 1), max_size=8))
    bounds = [0, *sorted(cuts), positions]
    again = draw(st.lists(st.tuples(st.integers(0, positions - 1), st.integers(1, 6)),
                          max_size=2))
    spans = [(lo, min(positions, lo + n)) for lo, n in again]
    piece = draw(st.sampled_from([8, 24, 100, 1 << 20]))  # rows are 8 bytes
    return positions, bounds, spans, piece


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> StoreConfig:
    """One store for every example (a run each): opening a new one costs seconds."""
    return embedded(str(tmp_path_factory.mktemp("export-rows") / "store"))


_RUNS = itertools.count()


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=stored_rows())
def test_the_export_is_the_latest_copy_of_each_position(
        case: tuple[int, list[int], list[tuple[int, int]], int],
        shared_store: StoreConfig) -> None:
    positions, bounds, spans, piece = case
    config, run = shared_store, f"run-{next(_RUNS)}"
    want = torch.arange(positions * 2, dtype=torch.float32).reshape(positions, 2)
    plain = want + 0.5  # layer 1: the same forwards, no retraction (one piece holds both)
    sink = ClickHouseSink(config)
    try:
        sink.start_run(run_info(run, [(RESID, 0), (RESID, 1)]))
        records = records_of(run, "r", RESID, 1, plain, bounds)
        records += records_of(run, "r", RESID, 0, want, bounds)
        seq = len(records) + 1
        for lo, hi in spans:  # a retraction: the span forwarded again, later, new values
            fresh = torch.randn(hi - lo, 2)
            want[lo:hi] = fresh
            records += records_of(run, "r", RESID, 0, fresh, [lo, hi], base=lo, seq=seq)
            seq += 1
        sink.put(RecordBatch.from_records(records))
        sink.commit_requests([manifest(run, "r", PROMPT, positions - PROMPT + 1)])
        sink.flush()
    finally:
        sink.close()
    reads = StoreReads(lambda: ClickHouseReader(config), piece_bytes=piece)
    tensors = load_safetensors(b"".join(reads.safetensors(run, "r")[1]))
    got = tensors[export.tensor_name(RESID, 0)]
    assert torch.equal(got, want)
    assert torch.equal(got, handle(config, run, "r").get(RESID, 0))
    assert torch.equal(tensors[export.tensor_name(RESID, 1)], plain)


def test_rows_in_one_run_of_records_are_one_slice_of_the_answer(
        open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sink = open_sink()
    sink.start_run(run_info("run", [(RESID, 0), (RESID, 1)]))
    rows = torch.randn(9, 2)
    for layer in (0, 1):
        sink.put(RecordBatch.from_records(
            records_of("run", "r", RESID, layer, rows + layer, [0, 4, 5, 9])))
    sink.commit_requests([manifest("run", "r", PROMPT, 9 - PROMPT + 1)])
    sink.flush()
    spans: list[tuple[str, bool]] = []
    real = export._one_span

    def seen(held: list[object], t: export._Tensor) -> object:
        span = real(held, t)  # type: ignore[arg-type]
        spans.append((t.name, span is not None))
        return span

    monkeypatch.setattr(export, "_one_span", seen)
    reads = StoreReads(lambda: ClickHouseReader(store), piece_bytes=48)  # 3 rows of each
    got = load_safetensors(b"".join(reads.safetensors("run", "r")[1]))
    assert torch.equal(got[f"{RESID}.0"], rows)
    assert torch.equal(got[f"{RESID}.1"], rows + 1)
    assert spans
    assert all(one for _, one in spans)  # every piece: slices, no record objects
    spans.clear()
    sink.put(RecordBatch.from_records(  # layer 0's positions 2..5 forwarded again
        records_of("run", "r", RESID, 0, rows[2:6], [2, 6], base=2, seq=9)))
    sink.flush()
    got = load_safetensors(b"".join(reads.safetensors("run", "r")[1]))
    assert torch.equal(got[f"{RESID}.0"], rows)
    assert torch.equal(got[f"{RESID}.1"], rows + 1)
    assert {one for name, one in spans if name.endswith(".1")} == {True}  # still slices
    assert not all(one for name, one in spans if name.endswith(".0"))  # record by record
