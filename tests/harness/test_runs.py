"""The harness end to end on CPU: engine children (a fake engine), brackets, checks,
resumable results, the deadline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import serving
from harness.qualify import CELLS, Qualification
from harness.results import Deadline, load_json

FAKE = "tests.harness.fake_engine:FakeEngine"

NOSTORE = next(c for c in CELLS if c.name == "0.6b-graph-full-nostore")


def qualify(tmp_path: Path, cells: list, **kw: object) -> tuple[int, Path]:
    results = tmp_path / "results"
    runner = Qualification(results, tmp_path / "state", tmp_path / "work",
                           kw.pop("deadline", Deadline(0)),  # type: ignore[arg-type]
                           engine_class=FAKE, **kw)  # type: ignore[arg-type]
    return runner.run(cells), results


def test_a_faithful_engine_passes_every_required_check(tmp_path: Path) -> None:
    code, results = qualify(tmp_path, [NOSTORE])
    data = load_json(results / f"{NOSTORE.name}.json")
    assert data is not None
    assert code == 0, data
    assert data["status"] == "passed"
    # a light cell runs bs1, bs8-mixed, bs13-pad and bs64-small
    assert data["checks"]["token_identity"]["compared"] == 1 + 8 + 13 + 64
    assert data["checks"]["rows_complete"]["ok"]
    assert data["checks"]["same_software"]["ok"]
    tput = data["figures"]["throughput"]["bs64-small"]
    assert tput["stock_runs"] == 2  # stock before and after the monitored engine
    assert data["schema"] == 2
    assert data["kind"] == "qualify-cell"
    assert json.loads((results / "summary.json").read_text())["exit_status"] == 0


def test_diverging_tokens_fail_the_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_DIVERGE", "1")
    code, results = qualify(tmp_path, [NOSTORE])
    data = load_json(results / f"{NOSTORE.name}.json")
    assert data is not None
    assert code == 1
    assert data["status"] == "failed"
    assert not data["checks"]["token_identity"]["ok"]
    assert data["checks"]["stock_deterministic"]["ok"]


def test_a_missing_row_fails_the_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_DROP_ROWS", "1")
    code, results = qualify(tmp_path, [NOSTORE])
    data = load_json(results / f"{NOSTORE.name}.json")
    assert data is not None
    assert code == 1
    assert not data["checks"]["rows_complete"]["ok"]


def test_an_engine_that_cannot_start_is_an_error_with_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL_START", "1")
    code, results = qualify(tmp_path, [NOSTORE])
    data = load_json(results / f"{NOSTORE.name}.json")
    assert data is not None
    assert code == 1
    assert data["status"] == "error"
    assert "fake engine refused to start" in data["error"]


def test_work_past_the_deadline_is_skipped_then_resumed(tmp_path: Path) -> None:
    code, results = qualify(tmp_path, [NOSTORE], deadline=Deadline(1))
    assert code == 3
    assert load_json(results / f"{NOSTORE.name}.json")["status"] == "skipped"  # type: ignore[index]
    code, _ = qualify(tmp_path, [NOSTORE])
    assert code == 0
    code, results = qualify(tmp_path, [NOSTORE])  # a third run reuses the saved result
    data = load_json(results / f"{NOSTORE.name}.json")
    assert code == 0
    assert data is not None
    assert data["reused"] is True


def test_the_serving_benchmark_brackets_every_engine(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    code = serving.main(["--out", str(out), "--modes", "transport:hidden-states",
                         "--repeats", "2", "--batch", "4", "--prompt-len", "8",
                         "--output-len", "4", "--min-seconds", "0.01",
                         "--engine-class", FAKE, "--work", str(tmp_path / "work")])
    data = load_json(out)
    assert data is not None
    assert code == 0, data["summary"]
    assert [u["name"] for u in data["units"]] == ["transport-hidden-states-r0",
                                                  "transport-hidden-states-r1"]
    row = data["summary"][0]
    assert row["units"] == 2
    assert row["ratio"] is not None
    assert row["ratio_spread"] is not None
    assert data["units"][0]["bound"]["kind"] == "d2h"
    assert data["units"][0]["checks"]["rows_accounted"]["ok"]


def test_serving_refuses_a_setting_the_modes_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serving.main(["--env", "DMX_DB_URL=none", "--dry-run"])
    assert "DMX_DB_URL" in capsys.readouterr().err
