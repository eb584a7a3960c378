"""How a serving result is judged and shown: only units whose required checks passed
enter a cell's figures, a cell with a failed unit is not judged, rows are named as their
units ran, a cut-off invocation's engines do not outlive it. Each found in review."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

from harness import docs
from harness.results import REPO, finish, result
from harness.serving import cell, summarize

from .test_runs import FAKE, _child, serve

REFERENCE = {"model": "0.6b", "batch": 64, "prompt_len": 256, "output_len": 128,
             "min_seconds": 30.0}


def _unit(status: str, ratio: float, mode: str = "transport:hidden-states",
          env: dict[str, str] | None = None) -> dict[str, Any]:
    return {"settings": REFERENCE | {"mode": mode, "env": env or {}}, "status": status,
            "bound": {"ratio": 1.0},
            "checks": {"token_identity": {"ok": status == "passed", "required": True}},
            "figures": {"throughput": {"ratios": [ratio], "stock_rates": [2e4, 2.01e4]}}}


def test_a_failed_units_figures_are_left_out_and_its_cell_is_not_judged() -> None:
    (alone,) = summarize([_unit("failed", 0.99)])
    assert (alone["status"], alone["ratio"]) == ("failed", None)
    assert alone["verdict"] == "not judged (a unit failed or erred)"
    (row,) = summarize([_unit("passed", 0.95), _unit("failed", 0.99), _unit("failed", 0.99)])
    assert row["ratio"] == 0.95  # the failed units' 0.99 no longer lifts the median
    assert row["verdict"] == "not judged (a unit failed or erred)"
    (ok,) = summarize([_unit("passed", 0.98), _unit("passed", 0.97)])
    assert (ok["status"], ok["verdict"]) == ("passed", "PASS")


def test_the_docs_table_never_shows_pass_beside_a_failed_status(tmp_path: Path) -> None:
    data = result("serving", "serving", REFERENCE)
    data["units"] = [_unit("failed", 0.99)]
    data["summary"] = [{**summarize(data["units"])[0], "ratio": 0.99, "verdict": "PASS"}]
    table = docs.serving_table([(tmp_path / "s.json", finish(data, "failed"))], tmp_path)
    (row,) = [line for line in table.splitlines() if line.startswith("| transport:")]
    assert "| failed |" in row
    assert "not judged (a unit failed or erred)" in row


def test_each_committed_row_is_named_as_its_units_ran() -> None:
    # a 4-writer unit written before names carried --env showed as plain store:hidden-states
    found = docs.evidence(REPO / "docs" / "evidence")
    names = {cell(u["settings"]["mode"], u["settings"].get("env"))
             for _, d in found if d["kind"] == "serving" and d["name"] == "serving"
             for u in d.get("units") or []}
    table = docs.serving_table(found, REPO / "docs")
    shown = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[2:]]
    assert shown
    assert set(shown) <= names, set(shown) - names
    (writers,) = [line for line in table.splitlines() if "DMX_CH_WRITERS=4" in line]
    assert "serving-store-writers4.json" in writers


def test_a_request_sample_of_zero_keeps_its_target() -> None:
    from harness.constants import TARGETS
    from harness.serving import setting_pairs

    env = setting_pairs(["DMX_REQUEST_SAMPLE=0"], "--env")
    name = cell("store:hidden-states", env)
    assert ("0.6b", name) in TARGETS, name  # it was named ...=0.0, which has no target
    (row,) = summarize([_unit("passed", 0.99, "store:hidden-states", env)])
    assert row["verdict"] == "PASS"


def test_serving_kills_the_engines_an_interrupted_invocation_left(
        tmp_path: Path) -> None:
    from harness.engine import EngineProcess, group_alive

    state = Path(os.environ["DMI_HARNESS_STATE"]) / "serving" / re.sub(r"\W", "-", FAKE)
    left = EngineProcess("left", _child(tmp_path).spec, tmp_path / "left",
                         state / "engines.pgids")  # where a run's Bracket records them
    left.start(30)
    assert left.proc is not None
    try:
        code, _ = serve(tmp_path, "transport:hidden-states", repeats=1, batch=2, prompt=4,
                        output=3)
        assert code == 0
        assert left.proc.poll() == -signal.SIGKILL, "the earlier invocation's engine runs"
    finally:
        if group_alive(left.proc.pid):
            os.killpg(left.proc.pid, signal.SIGKILL)
        left.proc.wait(10)


def test_one_engine_has_no_spread_of_ratios() -> None:
    """One unit measures no spread: the summary (and the docs table) says none, not
    0.0 %, which reads as perfectly repeatable."""
    (one,) = summarize([_unit("passed", 0.9)])
    assert one["units"] == 1
    assert one["ratio_spread"] is None
    (two,) = summarize([_unit("passed", 0.9), _unit("passed", 0.99)])
    assert abs(two["ratio_spread"] - (0.99 / 0.9 - 1)) < 1e-9  # max / min - 1


def test_a_complete_position_range_capture_is_accounted_for() -> None:
    """The reference workload's warm-up requests (32 + 8 tokens) have their extra forward
    (position 39) inside positions(0-63), the timed ones (256 + 128: position 383) not:
    the extra forwards add rows to some requests only, and a complete capture passes."""
    from harness.models import MODELS
    from harness.workloads import check_transport_rows, expected_capture

    model, preset = MODELS["0.6b"], "resid_pre:positions(0-63)"
    requests = [(32, 8)] * 64 + [(256, 128)] * 64 * 66
    for extra in (True, False):
        got = expected_capture(preset, model, [(p, c, extra) for p, c in requests])
        check = check_transport_rows({"rows": got.rows, "bytes": got.bytes}, preset, model,
                                     requests)
        assert check["ok"], check
        assert check["requests_with_extra_forward"] == (64 if extra else 0)
        short = check_transport_rows({"rows": got.rows - 1, "bytes": got.bytes}, preset,
                                     model, requests)
        assert not short["ok"]
