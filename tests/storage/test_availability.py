"""``available`` is honest: incomplete captures are reported, and never read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import RunStatus
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import IncompleteCaptureError

from ._support import RESID, commit, handle, manifest, records_of, run_info

CAPTURES = [(RESID, 0), (RESID, 1), ("final_logits", -1)]
PROMPT, COMPLETION = 4, 3  # token rows [0, 6), logits rows [3, 6)


def _put_request(sink: ClickHouseSink, *, skip: tuple[str, int, int] | None = None) -> None:
    """Rows of request "r": prefill [0, 4) then decode rows 4 and 5; ``skip`` =
    (act_name, layer, position) of one decode row left out."""
    for act, layer in CAPTURES:
        first = PROMPT - 1 if act == "final_logits" else 0
        bounds = [first, PROMPT, PROMPT + 1, PROMPT + 2]
        t = torch.randn(bounds[-1] - first, 5)
        recs = records_of("run", "r", act, layer, t, bounds, base=first)
        sink.put(RecordBatch.from_records(
            [r for r in recs if (act, layer, r.start_token_idx) != skip]))


def test_complete_capture_is_available(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    _put_request(sink)
    commit(sink, run, [manifest("run", "r", PROMPT, COMPLETION)])
    h = handle(store, "run", "r")
    assert h.available
    assert h.missing == ()
    assert h.get("resid_pre", 1).shape == (6, 5)
    assert h.logits.shape == (3, 5)


def test_a_missing_row_is_reported_and_never_read(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    _put_request(sink, skip=(RESID, 1, 5))
    commit(sink, run, [manifest("run", "r", PROMPT, COMPLETION)])
    h = handle(store, "run", "r")
    assert not h.available
    assert h.missing == ("blocks.hook_resid_pre layer 1: positions [5, 6) missing",)
    with pytest.raises(IncompleteCaptureError, match=r"layer 1: positions \[5, 6\) missing"):
        h.get("resid_pre", 0)  # no partial data, even of complete layers
    with pytest.raises(IncompleteCaptureError):
        _ = h.hidden_states


def test_a_run_that_is_not_committed_is_not_available(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    _put_request(sink)
    sink.flush()
    h = handle(store, "run", "r")  # every row is there, but the run is still running
    assert not h.available
    assert h.missing[0].startswith("run 'run' is running, not committed, and request 'r' "
                                   "is not committed yet")
    with pytest.raises(IncompleteCaptureError, match="running, not committed"):
        _ = h.logits
    sink.close()  # the process went away without finish_run
    assert not h.available


def test_a_failed_run_is_not_available_and_its_manifests_are_not_committed(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    _put_request(sink)
    failed = attrs.evolve(run, status=RunStatus.FAILED, error="scheduler died")
    sink.finish_run(failed, [manifest("run", "r", PROMPT, COMPLETION)])
    h = handle(store, "run", "r")
    assert h.missing == ("run 'run' is failed, not committed: scheduler died",)
    from dmi_sglang.adapters.clickhouse import ClickHouseReader

    stored = ClickHouseReader(store).manifest("run", "r")
    assert stored is not None
    assert not stored.committed


@pytest.mark.parametrize("manifests", ["none", "uncommitted", "other-request"])
def test_without_a_committed_manifest_nothing_is_available(
    manifests: str, open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    _put_request(sink)
    given = {
        "none": [],
        "uncommitted": [manifest("run", "r", PROMPT, COMPLETION, committed=False)],
        "other-request": [manifest("run", "r2", PROMPT, COMPLETION)],
    }[manifests]
    commit(sink, run, given)
    h = handle(store, "run", "r")
    assert not h.available
    expected = "is not committed" if manifests == "uncommitted" else "has no manifest"
    assert expected in h.missing[0]


def test_unknown_run_and_a_handle_made_before_the_commit(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    assert handle(store, "nope", "r").missing == ("run 'nope' is not in the store",)
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    early = handle(store, "run", "r")
    _put_request(sink)
    assert not early.available  # not cached: the verdict may change
    commit(sink, run, [manifest("run", "r", PROMPT, COMPLETION)])
    assert early.available
    with pytest.raises(IncompleteCaptureError, match="was not captured"):
        early.get("ln1", 0)


def test_the_handle_does_no_io_until_used(store: StoreConfig) -> None:
    calls: list[str] = []

    def factory() -> object:
        calls.append("reader")
        raise AssertionError("no reader expected")

    h = handle(store, "run", "r")
    h2 = type(h)("run", "r", factory)  # type: ignore[arg-type]
    assert repr(h2) == "CaptureHandle(run_id='run', request_id='r')"
    assert calls == []


def _ruled_run(open_sink: Callable[..., ClickHouseSink], run_id: str, rule: str,
               kept: range, *, skip: int | None = None) -> None:
    """Run ``run_id`` captured ``resid_pre:<rule>`` and final_logits for request "r"
    (prompt 4, completion 3: resid_pre computed at [0, 6)): the ``kept`` positions of
    resid_pre are stored, one record each holding the position's number (``skip``: that
    one left out)."""
    sink = open_sink()
    run = attrs.evolve(run_info(run_id, CAPTURES), settings=(
        ("DMX_HOOK_SELECTION", f"resid_pre:{rule},final_logits"),))
    sink.start_run(run)
    for act, layer in CAPTURES:
        logits = act == "final_logits"
        for p in range(PROMPT - 1, PROMPT + COMPLETION - 1) if logits else kept:
            if p == skip and not logits:
                continue
            recs = records_of(run_id, "r", act, layer, torch.full((1, 5), float(p)),
                              [p, p + 1], base=p)
            sink.put(RecordBatch.from_records(recs))
    commit(sink, run, [manifest(run_id, "r", PROMPT, COMPLETION)])


def _ranged_run(open_sink: Callable[..., ClickHouseSink], *, skip: int | None = None):
    """Run "ranged": ``resid_pre:positions(2-4)``, positions 2, 3 and 4 stored."""
    _ruled_run(open_sink, "ranged", "positions(2-4)", range(2, 5), skip=skip)

def test_a_position_range_is_complete_with_the_rows_of_the_range(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    _ranged_run(open_sink)
    h = handle(store, "ranged", "r")
    assert h.missing == ()
    assert h.get("resid_pre", 0).shape == (3, 5)  # positions 2, 3 and 4
    assert h.get("resid_pre", 1, start=3, end=5).shape == (2, 5)
    with pytest.raises(ValueError, match=r"outside resid_pre's captured \[2, 5\)"):
        h.get("resid_pre", 0, start=0, end=3)
    assert h.logits.shape == (3, 5)


def test_a_missing_row_inside_a_position_range_is_reported(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    _ranged_run(open_sink, skip=3)
    h = handle(store, "ranged", "r")
    assert not h.available
    assert h.missing == ("blocks.hook_resid_pre layer 0: positions [3, 4) missing",
                         "blocks.hook_resid_pre layer 1: positions [3, 4) missing")


def test_a_last_prompt_capture_is_complete_with_one_row_per_hook(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = attrs.evolve(run_info("lp", CAPTURES), settings=(
        ("DMX_HOOK_SELECTION", "resid_pre:last_prompt,final_logits:last_prompt"),))
    sink.start_run(run)
    for act, layer in CAPTURES:  # PROMPT - 1 = 3: the position that decided token one
        recs = records_of("lp", "r", act, layer, torch.randn(1, 5), [3, 4], base=3)
        sink.put(RecordBatch.from_records(recs))
    commit(sink, run, [manifest("lp", "r", PROMPT, COMPLETION)])
    h = handle(store, "lp", "r")
    assert h.missing == ()
    assert h.get("resid_pre", 1).shape == (1, 5)
    assert h.logits.shape == (1, 5)


def test_a_generated_capture_reads_the_positions_that_decided_the_tokens(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = attrs.evolve(run_info("gen", CAPTURES), settings=(
        ("DMX_HOOK_SELECTION", "resid_pre:generated,final_logits"),))
    sink.start_run(run)
    for act, layer in CAPTURES:  # resid_pre from 3, the extra forward's 6 included
        first, stop = (3, 6) if act == "final_logits" else (3, 7)
        recs = records_of("gen", "r", act, layer, torch.randn(stop - first, 5),
                          [first, stop], base=first)
        sink.put(RecordBatch.from_records(recs))
    commit(sink, run, [manifest("gen", "r", PROMPT, COMPLETION, overlap_extra_forward=True)])
    h = handle(store, "gen", "r")
    assert h.missing == ()
    assert h.positions("resid_pre", 0) == range(3, 6)  # never the extra forward's 6
    assert h.get("resid_pre", 0).shape == (3, 5)


def test_a_partial_read_keeps_to_what_the_rule_keeps(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    from dmi_sglang.adapters.clickhouse import ClickHouseReader
    from dmi_sglang.app.handle import CaptureHandle

    sink = open_sink()
    run = attrs.evolve(run_info("genp", CAPTURES), settings=(
        ("DMX_HOOK_SELECTION", "resid_pre:generated,final_logits"),))
    sink.start_run(run)
    for act, layer in CAPTURES:
        first, stop = (3, 6) if act == "final_logits" else (3, 7)  # 6: the extra forward
        recs = records_of("genp", "r", act, layer, torch.randn(stop - first, 5),
                          [first, stop], base=first)
        sink.put(RecordBatch.from_records(recs))
    commit(sink, run, [manifest("genp", "r", PROMPT, COMPLETION, overlap_extra_forward=True)])
    partial = CaptureHandle("genp", "r", lambda: ClickHouseReader(store), partial=True)
    assert partial.partial_positions("resid_pre", 0) == range(3, 6)  # never the extra one
    assert partial.get("resid_pre", 0).shape == (3, 5)


def _strided_run(open_sink: Callable[..., ClickHouseSink], *, skip: int | None = None):
    """Run "strided": ``resid_pre:every(2)``, positions 0, 2 and 4 stored."""
    _ruled_run(open_sink, "strided", "every(2)", range(0, 6, 2), skip=skip)

def test_every_k_positions_read_back_in_order_with_their_positions(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    _strided_run(open_sink)
    h = handle(store, "strided", "r")
    assert h.missing == ()
    assert h.positions("resid_pre", 0) == range(0, 6, 2)
    rows = h.get("resid_pre", 1)
    assert rows[:, 0].tolist() == [0.0, 2.0, 4.0]
    assert h.get("resid_pre", 0, start=1, end=5)[:, 0].tolist() == [2.0, 4.0]
    assert h.get("resid_pre", 0, start=3, end=4).numel() == 0  # no kept position there
    assert h.logits.shape == (3, 5)
    from dmi_sglang.adapters.clickhouse import ClickHouseReader
    from dmi_sglang.app.handle import CaptureHandle

    partial = CaptureHandle("strided", "r", lambda: ClickHouseReader(store), partial=True)
    assert partial.partial_positions("resid_pre", 0) == range(0, 6, 2)
    assert partial.get("resid_pre", 0)[:, 0].tolist() == [0.0, 2.0, 4.0]


def test_a_partial_read_keeps_to_the_positions_asked_for(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    """A failed run read with ``partial=True``: ``start``/``end`` select positions as they
    do on a complete capture, inside what was stored (outside it is an error)."""
    from dmi_sglang.adapters.clickhouse import ClickHouseReader
    from dmi_sglang.app.handle import CaptureHandle

    sink = open_sink()
    run = run_info("cut", [(RESID, 0)])
    sink.start_run(run)
    rows = torch.arange(8, dtype=torch.float32).repeat_interleave(2).reshape(8, 2)
    sink.put(RecordBatch.from_records(records_of("cut", "r", RESID, 0, rows, [0, 4, 8])))
    sink.finish_run(attrs.evolve(run, status=RunStatus.FAILED, error="boom"), [])
    partial = CaptureHandle("cut", "r", lambda: ClickHouseReader(store), partial=True)
    assert partial.partial_positions("resid_pre", 0) == range(0, 8)
    assert partial.get("resid_pre", 0, start=2, end=5)[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert partial.get("resid_pre", 0, start=6)[:, 0].tolist() == [6.0, 7.0]
    assert partial.get("resid_pre", 0).shape == (8, 2)
    with pytest.raises(ValueError, match=r"positions \[5, 9\) are outside .* \[0, 8\)"):
        partial.get("resid_pre", 0, start=5, end=9)


def test_a_tensor_changed_in_place_leaves_later_reads_as_stored(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("own", [(RESID, 0), (RESID, 1)])
    sink.start_run(run)
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    for layer in (0, 1):
        sink.put(RecordBatch.from_records(records_of("own", "r", RESID, layer, rows, [0, 6])))
    commit(sink, run, [manifest("own", "r", 4, 3)])
    h = handle(store, "own", "r")
    first = h.get("resid_pre", 0)
    first.sub_(first.mean(dim=0))  # centred in place by its caller
    assert torch.equal(h.get("resid_pre", 0), rows)
    layers = h.hidden_states
    layers[1].zero_()
    assert torch.equal(h.hidden_states[1], rows)
    assert torch.equal(h.get("resid_pre", 1), rows)


def test_a_missing_position_of_every_k_is_reported(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    _strided_run(open_sink, skip=2)
    h = handle(store, "strided", "r")
    assert h.missing == ("blocks.hook_resid_pre layer 0: positions 2 missing",
                         "blocks.hook_resid_pre layer 1: positions 2 missing")
    from dmi_sglang.adapters.clickhouse import ClickHouseReader
    from dmi_sglang.app.handle import CaptureHandle

    partial = CaptureHandle("strided", "r", lambda: ClickHouseReader(store), partial=True)
    assert partial.get("resid_pre", 0)[:, 0].tolist() == [0.0]  # up to the first gap



def _logits_every(open_sink: Callable[..., ClickHouseSink], run_id: str, k: int,
                  kept: list[int]) -> None:
    """Run ``run_id`` captured ``final_logits:every(k)`` of request "r" (prompt 4, 3
    tokens: logits rows cover [3, 6)), the rows of ``kept`` stored."""
    sink = open_sink()
    captures = (("final_logits", -1),)
    run = attrs.evolve(run_info(run_id, captures), settings=(
        ("DMX_HOOK_SELECTION", f"final_logits:every({k})"),))
    sink.start_run(run)
    for p in kept:
        recs = records_of(run_id, "r", "final_logits", -1, torch.full((1, 5), float(p)),
                          [p, p + 1], base=p)
        sink.put(RecordBatch.from_records(recs))
    commit(sink, run, [manifest(run_id, "r", PROMPT, COMPLETION)])


def test_every_k_on_the_logits_takes_any_bounds_inside_their_coverage(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    """every(2) keeps position 4 of [3, 6): get(start=3) is inside the coverage and
    returns the kept row; every(8) keeps nothing, and says so inside the coverage."""
    _logits_every(open_sink, "lk2", 2, [4])
    h = handle(store, "lk2", "r")
    assert h.missing == ()
    assert h.positions("final_logits") == range(4, 6, 2)
    assert h.get("final_logits", start=3)[:, 0].tolist() == [4.0]
    assert h.get("final_logits", start=5).numel() == 0
    _logits_every(open_sink, "lk8", 8, [])
    h = handle(store, "lk8", "r")
    assert h.missing == ()
    kept = h.positions("final_logits")
    assert not kept
    assert 3 <= kept.start <= 6
    assert h.get("final_logits").numel() == 0


def test_an_export_says_which_positions_a_strided_selections_rows_are(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig, tmp_path: Path
) -> None:
    # Found in review: the command's file held the rows of positions 0, 2, 4 and nothing
    # said so (the server's export says it in the metadata), and --partial named them
    # @0-6, "positions [0, 6)"
    import json

    from safetensors import safe_open

    from dmi_sglang.app.cli import main

    _ruled_run(open_sink, "strided", "every(2)", range(0, 6, 2))
    db = ["--db", f"chdb://{store.path}"]
    resid = "blocks.hook_resid_pre.0"
    for extra, name in (((), resid), (("--partial",), f"{resid}@0-6:2")):
        out = tmp_path / f"x{len(extra)}.safetensors"
        assert main(["export", "strided", "r", "--out", str(out), *extra, *db]) == 0
        with safe_open(str(out), framework="pt") as f:
            assert json.loads(f.metadata()["positions"])[name] == [0, 6, 2]
            assert f.get_tensor(name)[:, 0].tolist() == [0.0, 2.0, 4.0]
