"""``python -m harness waves``: serving results' timed waves, run by run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import waves


def _unit(measured: list[float], before: list[float], after: list[float],
          gc: dict[str, object] | None = None, ratio: float = 0.9) -> dict[str, object]:
    figures: dict[str, object] = {
        "throughput": {"ratio": ratio},
        "timing": {"gc_full_collections": 3.0, "gc_full_seconds": 1.25},
        "wave_seconds": {"measured": measured, "stock_before": [before],
                         "stock_after": [after]}}
    if gc is not None:
        figures["gc_full_waves"] = gc
    return {"name": "last-r0", "figures": figures}


def test_each_run_names_its_slow_waves_collections_and_the_ratio_of_median_waves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monitored = [0.40] * 5 + [0.80] + [0.40] * 4  # one stalled wave, wave 5
    unit = _unit(monitored, [0.38] * 10, [0.39] * 3 + [0.60] + [0.39] * 6,
                 {"measured": [[5, 0.38]], "stock_before": [[]], "stock_after": [[[3, 0.2]]]})
    rows = waves.unit_rows("x", unit)
    assert [r["run"] for r in rows] == ["monitored", "stock before", "stock after"]
    assert [r["slow waves"] for r in rows] == ["5:0.800", "-", "3:0.600"]
    assert [r["full gc (own)"] for r in rows] == ["5:0.380", "-", "3:0.200"]
    assert [r["full gc (scheduler)"] for r in rows] == ["3 (1.250 s)", None, None]
    assert rows[0]["median ms"] == pytest.approx(400)
    assert rows[0]["mean ms"] == pytest.approx(440)
    assert [r["x stock"] for r in rows] == [0.9, None, None]
    assert rows[0]["x stock, median waves"] == round((0.38 + 0.39) / 2 / 0.40, 3)

    path = tmp_path / "run" / "serving.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"units": [unit]}))
    assert waves.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "run/serving.json" in out
    assert "5:0.800" in out
    assert out.count("\n") == 4  # a header, then the three runs


def test_results_from_before_the_collections_were_recorded_say_so() -> None:
    rows = waves.unit_rows("x", _unit([0.4, 0.4], [0.4, 0.4], [0.4, 0.4]))
    assert {r["full gc (own)"] for r in rows} == {"n/a"}


def test_a_unit_without_monitored_waves_puts_no_ratio_on_a_stock_run() -> None:
    rows = waves.unit_rows("x", _unit([], [0.4, 0.4], []))
    assert [r["run"] for r in rows] == ["stock before"]  # a run without waves is left out
    assert rows[0]["x stock"] is None
    assert rows[0]["x stock, median waves"] is None


def test_files_without_units_or_json_are_named_and_fail(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"units": []}))
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    assert waves.main([str(empty), str(listed), str(tmp_path / "gone.json")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{empty}: no unit with timed waves",
                   f"{listed}: not a readable JSON object",
                   f"{tmp_path / 'gone.json'}: not a readable JSON object"]


def test_a_slow_factor_of_one_or_less_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        waves.main(["x.json", "--slow", "1"])
    assert "--slow must be a number above 1, got 1.0" in capsys.readouterr().err
