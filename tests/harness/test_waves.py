"""``python -m harness waves``: serving results' timed waves, run by run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import waves


def _unit(name: str, measured: list[float], before: list[float], after: list[float],
          gc: dict[str, object] | None, ratio: float) -> dict[str, object]:
    figures: dict[str, object] = {
        "throughput": {"ratio": ratio},
        "wave_seconds": {"measured": measured, "stock_before": [before],
                         "stock_after": [after]}}
    if gc is not None:
        figures["gc_full_waves"] = gc
    return {"name": name, "figures": figures}


def test_each_run_names_its_slow_waves_and_the_ratio_of_median_waves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monitored = [0.40] * 5 + [0.80] + [0.40] * 4  # one stalled wave, wave 5
    unit = _unit("last-r0", monitored, [0.38] * 10, [0.39] * 3 + [0.60] + [0.39] * 6,
                 {"measured": [5], "stock_before": [[]], "stock_after": [[3]]}, 0.9)
    rows = waves.unit_rows("x", unit)
    assert [r["run"] for r in rows] == ["monitored", "stock before", "stock after"]
    assert [r["slow waves"] for r in rows] == ["5:0.800", "-", "3:0.600"]
    assert [r["full gc waves"] for r in rows] == ["5", "-", "3"]
    assert rows[0]["median s"] == 0.4
    assert rows[0]["mean s"] == 0.44
    assert rows[0]["x stock"] == 0.9
    assert rows[0]["x stock, median waves"] == round((0.38 + 0.39) / 2 / 0.40, 3)
    assert rows[1]["x stock"] is None

    path = tmp_path / "run" / "serving.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"units": [unit]}))
    assert waves.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "5:0.800" in out
    assert out.count("\n") == 4  # a header, then the three runs


def test_results_from_before_the_collections_were_recorded_say_so() -> None:
    unit = _unit("old", [0.4, 0.4], [0.4, 0.4], [0.4, 0.4], None, 1.0)
    assert {r["full gc waves"] for r in waves.unit_rows("x", unit)} == {"n/a"}


def test_a_file_without_units_fails_and_a_slow_factor_of_one_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"units": []}))
    assert waves.main([str(empty)]) == 1
    assert "no unit with timed waves in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        waves.main([str(empty), "--slow", "1"])
    assert "--slow must be a number above 1, got 1.0" in capsys.readouterr().err
