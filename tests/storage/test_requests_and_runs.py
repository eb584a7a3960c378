"""Many requests and layers, two runs of one model, token ranges, retraction dedupe."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError

from ._support import (
    RESID,
    batch_of,
    commit,
    handle,
    manifest,
    records_of,
    run_info,
    same_bits,
)

LAYERS = 3
HIDDEN = 8
VOCAB = 11
CAPTURES = [(RESID, n) for n in range(LAYERS)] + [("token_ids", -1), ("final_logits", -1)]


def _capture_request(
    run_id: str, request_id: str, prompt: int, completion: int, gen: torch.Generator
) -> tuple[list[CaptureRecord], dict[str, torch.Tensor]]:
    """Records of one request as SGLang forwards it: a prefill chunk, then one row per
    decode step; logits one row per generated token."""
    positions = prompt + completion - 1
    bounds = [0, prompt, *range(prompt + 1, positions + 1)]
    data = {
        f"layer{n}": torch.randn(positions, HIDDEN, generator=gen).to(torch.bfloat16)
        for n in range(LAYERS)
    }
    data["token_ids"] = torch.randint(0, 1000, (positions,), generator=gen)
    data["logits"] = torch.randn(completion, VOCAB, generator=gen)
    recs = []
    for n in range(LAYERS):
        recs += records_of(run_id, request_id, RESID, n, data[f"layer{n}"], bounds)
    recs += records_of(run_id, request_id, "token_ids", -1, data["token_ids"], bounds)
    logit_bounds = [prompt - 1, *range(prompt, positions + 1)]
    recs += records_of(
        run_id, request_id, "final_logits", -1, data["logits"], logit_bounds, base=prompt - 1
    )
    return recs, data


def test_many_requests_layers_and_two_runs_of_one_model_do_not_collide(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    gen = torch.Generator().manual_seed(0)
    expected: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    starts = (("tiny-a", "2026-11-29T10:00:00Z"), ("tiny-b", "2026-11-29T11:00:00Z"))
    for run_id, started in starts:
        run = run_info(run_id, CAPTURES, started_at=started)
        sink.start_run(run)
        manifests = []
        for i in range(12):  # same request ids in both runs
            prompt, completion = 3 + i % 4, 1 + i % 5
            recs, data = _capture_request(run_id, f"req-{i}", prompt, completion, gen)
            sink.put(RecordBatch.from_records(recs))
            expected[(run_id, f"req-{i}")] = data
            manifests.append(manifest(run_id, f"req-{i}", prompt, completion))
        commit(sink, run, manifests)
    sink.close()

    reader = ClickHouseReader(store)
    assert [r.run_id for r in reader.runs()] == ["tiny-b", "tiny-a"]
    assert len(reader.requests("tiny-a")) == 12
    with reader.session():  # handles sharing an open reader: one store open in all
        for (run_id, req), data in expected.items():
            h = CaptureHandle(run_id, req, lambda: reader)
            _check_request(h, data)


def _check_request(h: CaptureHandle, data: dict[str, torch.Tensor]) -> None:
    assert h.available, h.missing
    hs = h.hidden_states
    assert len(hs) == LAYERS
    for n in range(LAYERS):
        assert same_bits(hs[n], data[f"layer{n}"])
    assert same_bits(h.token_ids, data["token_ids"])
    assert same_bits(h.logits, data["logits"])
    again = h.hidden_states[0]  # read again: a tensor of its own, the same bits
    assert again is not hs[0]
    assert same_bits(again, hs[0])


def test_token_range_readback(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    recs, data = _capture_request("run", "r", prompt=6, completion=5, gen=torch.Generator())
    sink.put(RecordBatch.from_records(recs))
    commit(sink, run, [manifest("run", "r", 6, 5)])
    h = handle(store, "run", "r")
    # [4, 8) spans the end of the prefill chunk and three decode rows
    assert same_bits(h.get("resid_pre", 1, start=4, end=8), data["layer1"][4:8])
    assert same_bits(h.get("blocks.hook_resid_pre", 2, start=9), data["layer2"][9:])
    assert same_bits(h.get("token_ids", end=2), data["token_ids"][:2])
    # logits rows sit at positions [prompt - 1, prompt + completion - 1)
    assert same_bits(h.get("final_logits", start=6, end=8), data["logits"][1:3])
    assert h.get("resid_pre", 0, start=3, end=3).numel() == 0
    with pytest.raises(ValueError, match=r"outside resid_pre's captured \[0, 10\)"):
        h.get("resid_pre", 0, start=5, end=11)
    with pytest.raises(ValueError, match="per layer"):
        h.get("resid_pre")


@pytest.mark.parametrize(
    ("first", "second", "second_base"),
    [
        pytest.param([0, 4, 8, 9, 10], [0, 10, 11, 12], 0, id="recomputed-in-one-chunk"),
        pytest.param([0, 12], [0, 3, 5, 10, 11, 12], 0, id="recomputed-in-more-chunks"),
        pytest.param([0, 12], [3, 7], 3, id="only-a-middle-range-again"),
    ],
)
def test_retraction_keeps_the_latest_row_per_position(
    first: list[int],
    second: list[int],
    second_base: int,
    open_sink: Callable[..., ClickHouseSink],
    store: StoreConfig,
) -> None:
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    old = torch.randn(first[-1], HIDDEN).to(torch.bfloat16)
    new = torch.randn(second[-1] - second_base, HIDDEN).to(torch.bfloat16)
    sink.put(batch_of("run", "r", RESID, 0, old, first, seq=1))
    sink.put(batch_of("run", "r", RESID, 0, new, second, base=second_base, seq=100))
    commit(sink, run, [manifest("run", "r", prompt=5, completion=8)])  # positions [0, 12)
    expected = torch.empty(12, HIDDEN, dtype=torch.bfloat16)
    expected[: first[-1]] = old
    expected[second_base : second[-1]] = new
    out = handle(store, "run", "r").get("resid_pre", 0)
    assert same_bits(out, expected)
    assert len(ClickHouseReader(store).records("run", "r")) == len(first) + len(second) - 2


def test_deleting_while_this_process_captures_is_refused_at_once(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    # Found in review: the capture holds the records table's merges, and a delete (a
    # mutation) waited for them until that run finished
    sink = open_sink(writers=1)
    old = run_info("old", [(RESID, 0)])
    sink.start_run(old)
    sink.put(batch_of("old", "r", RESID, 0, torch.randn(3, 8), [0, 1, 2, 3]))
    commit(sink, old, [manifest("old", "r", 3, 0)])
    new = run_info("new", [(RESID, 0)])
    sink.start_run(new)
    reader = ClickHouseReader(store)
    with pytest.raises(StoreError, match="while this process captures run 'new'"):
        reader.delete_run("old")
    commit(sink, new, [])
    assert reader.delete_run("old") == 3
    assert [r.run_id for r in reader.runs()] == ["new"]


def test_delete_run_removes_only_that_run(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    for run_id in ("a", "b"):
        run = run_info(run_id, CAPTURES)
        sink.start_run(run)
        recs, _ = _capture_request(run_id, "r", 4, 2, torch.Generator())
        sink.put(RecordBatch.from_records(recs))
        commit(sink, run, [manifest(run_id, "r", 4, 2)])
    sink.close()
    reader = ClickHouseReader(store)
    deleted = reader.delete_run("a")
    assert deleted == (LAYERS + 1) * 2 + 2
    assert [r.run_id for r in reader.runs()] == ["b"]
    assert reader.manifest("a", "r") is None
    assert not handle(store, "a", "r").available
    assert handle(store, "b", "r").available


def test_an_empty_range_reads_as_no_rows_of_the_captures_shape_and_dtype(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    # Found in review: it read as a float32 tensor of shape (0,)
    sink = open_sink(writers=1)
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    sink.put(batch_of("run", "r", RESID, 0, torch.randn(4, 32, dtype=torch.bfloat16), [0, 4]))
    commit(sink, run, [manifest("run", "r", 4, 1)])
    sink.close()
    h = handle(store, "run", "r")
    assert h.get(RESID, 0, start=1, end=3).shape == (2, 32)
    empty = h.get(RESID, 0, start=2, end=2)
    assert (tuple(empty.shape), empty.dtype) == ((0, 32), torch.bfloat16)
