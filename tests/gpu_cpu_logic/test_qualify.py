"""tests/gpu/qualify.py: cells, plan, checks and result JSON with fake engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ["0.6b-eager-hidden", "0.6b-graph-hidden", "0.6b-eager-full", "0.6b-graph-full",
        "8b-graph-hidden"]


def test_cell_selection(qualify: Any) -> None:
    assert [c.name for c in qualify.select_cells(None)] == CORE
    assert [c.name for c in qualify.select_cells("")] == CORE
    assert [c.name for c in qualify.select_cells(" 8b-graph-hidden , 0.6b-eager-full")] == [
        "0.6b-eager-full", "8b-graph-hidden"]
    assert len(qualify.select_cells("all")) == len(qualify.CELLS)
    assert {c.name for c in qualify.select_cells("optional")} == {
        "0.6b-graph-hidden-nooverlap", "0.6b-graph-hfonly", "0.6b-graph-full-nostore",
        "0.6b-graph-full-ring64"}
    assert [c.name for c in qualify.select_cells("core,0.6b-graph-hidden")] == CORE
    with pytest.raises(ValueError, match=r"unknown cell 'nope'.*accepted: core"):
        qualify.select_cells("core,nope")


def test_core_plan_fits_eight_engine_starts(qualify: Any) -> None:
    steps = qualify.make_plan(qualify.select_cells("core"))
    assert len(steps) == 8
    stocks = [s for s in steps if s.role == "stock"]
    assert [s.cell.stock_key for s in stocks] == ["0.6b-eager", "0.6b-graph", "8b-graph"]
    assert stocks[0].cells == ["0.6b-eager-hidden", "0.6b-eager-full"]
    # every monitored engine comes after its stock baseline
    seen: set[str] = set()
    for step in steps:
        if step.role == "stock":
            seen.add(step.cell.stock_key)
        else:
            assert step.cell.stock_key in seen
    total = sum(s.estimate_s for s in steps)
    assert 10 * 60 < total < 30 * 60  # within one 30-minute lease, more than one call
    text = qualify.render_plan(steps, deadline=1000.0 + 540, now=1000.0)
    assert "8 engine starts for 5 cells" in text
    assert "NO" in text  # not all of it fits one 10-minute call


def test_specs_stock_and_monitored_agree(qualify: Any, tmp_path: Path) -> None:
    for cell in qualify.CELLS:
        stock = qualify.stock_spec(cell, tmp_path)
        mon = qualify.monitored_spec(cell, tmp_path, tmp_path / "store", "run-1")
        assert stock["engine"] == mon["engine"]
        assert stock["env"] == {"DMX_SGLANG_ENABLE": "0"}
        assert mon["env"]["DMX_HOOK_SELECTION"] == cell.preset
        assert mon["env"]["DMX_MODEL_ID"] == "run-1"
        assert mon["env"]["DMX_DB_URL"] == (
            f"chdb://{tmp_path / 'store'}" if cell.persistence == "chdb" else "none")
        assert mon["monitored"]
        assert not stock["monitored"]
        ring = mon["env"].get("DMX_RING_PAYLOAD_MB")
        assert ring == mon["env"].get("DMX_RING_PINNED_MB")
        assert ring == (str(cell.ring_mb) if cell.ring_mb else None)
        names = [w["name"] for w in stock["workloads"]]
        assert names[0] == "warmup"
        for w in mon["workloads"]:
            assert w["name"] in names
            twin = stock["workloads"][names.index(w["name"])]
            assert twin["input_ids"] == w["input_ids"]
            assert twin["rids"] == w["rids"]
        again = [w for w in stock["workloads"] if w["name"].startswith("again-")]
        assert again
        for w in again:
            assert w["input_ids"] == stock["workloads"][names.index(w["name"][6:])]["input_ids"]
        if cell.light:
            assert {"long-chunked", "bs64"}.isdisjoint(w["name"] for w in mon["workloads"])
        assert cell.graphs == ("cuda_graph_max_bs_decode" in stock["engine"])
        assert cell.overlap == ("disable_overlap_schedule" not in stock["engine"])


def test_long_prompt_spans_two_chunks_and_bs13_pads(qualify: Any) -> None:
    wl = {w.name: w for w in qualify.model_workloads("0.6b")}
    chunk = qualify.engine_kwargs(qualify.BY_NAME["0.6b-graph-hidden"],
                                  Path("/m"))["chunked_prefill_size"]
    assert chunk < max(wl["long-chunked"].prompt_lens) <= 2 * chunk
    assert wl["bs13-pad"].requests == 13
    assert len(set(wl["bs8-mixed"].output_lens)) > 1  # requests finish at different steps


def test_hashes_change_with_settings(qualify: Any) -> None:
    a, b = qualify.BY_NAME["0.6b-graph-hidden"], qualify.BY_NAME["0.6b-graph-full"]
    assert qualify.stock_hash(a) == qualify.stock_hash(b)  # shared baseline
    assert qualify.cell_hash(a) != qualify.cell_hash(b)
    assert qualify.stock_hash(a) != qualify.stock_hash(qualify.BY_NAME["0.6b-eager-hidden"])


def test_every_timed_shape_is_warmed_up_untimed_first(qualify: Any) -> None:
    for cell in qualify.select_cells("all"):
        work = qualify.cell_workloads(cell)
        timed = [w for w in work if w.timed]
        assert timed
        first_timed = work.index(timed[0])
        warm = {w.name: w for w in work[:first_timed]}
        assert all(not w.timed for w in work[:first_timed])
        for t in timed:
            assert warm["warm-" + t.name].prompt_lens == t.prompt_lens
            assert set(warm["warm-" + t.name].output_lens) == {2}
    stock = [w.name for w in qualify.stock_workloads("0.6b")]
    assert stock.index("warm-bs64") < stock.index("bs64") < stock.index("again-bs64")


def test_compare_tokens(qualify: Any) -> None:
    stock = [{"id": "a", "output_ids": [1, 2, 3], "workload": "w"},
             {"id": "b", "output_ids": [4, 5], "workload": "w"},
             {"id": "x", "output_ids": [9], "workload": "other"}]
    same = qualify.compare_tokens(stock, [dict(o) for o in stock[:2]], {"w"})
    assert same["ok"]
    assert same["compared"] == 2
    diff = qualify.compare_tokens(stock, [{"id": "a", "output_ids": [1, 7, 3], "workload": "w"},
                                          {"id": "c", "output_ids": [4], "workload": "w"}],
                                  {"w"})
    assert not diff["ok"]
    assert diff["diverged"] == [{"id": "a", "workload": "w", "first_diff": 1, "stock_len": 3,
                                 "monitored_len": 3}]
    assert diff["missing_in_monitored"] == ["b"]
    assert diff["unexpected_in_monitored"] == ["c"]
    assert not qualify.compare_tokens([], [], {"w"})["ok"]


def test_stock_determinism(qualify: Any) -> None:
    outs = [{"id": "w-0", "output_ids": [1], "workload": "w"},
            {"id": "again-w-0", "output_ids": [1], "workload": "again-w"},
            {"id": "w-1", "output_ids": [2], "workload": "w"},
            {"id": "again-w-1", "output_ids": [3], "workload": "again-w"}]
    det = qualify.stock_determinism(outs)
    assert det == {"ok": False, "compared": 2, "diverged": 1, "diverged_ids": ["w-1"],
                   "required": False}
    assert qualify.status_of({"t": {"ok": True}, "d": det}) == "passed"
    assert qualify.status_of({"t": {"ok": False}, "d": det}) == "failed"


def _runner(qualify: Any, engines: Any, tmp_path: Path, clock: Any,
            deadline: float | None = None, **kw: Any) -> Any:
    return qualify.Runner(
        results=tmp_path / "results", state=tmp_path / "state", work=tmp_path / "work",
        deadline=deadline, command="python tests/gpu/qualify.py X", launcher=engines,
        read_back=engines.read_back, clock=clock,
        git={"commit": "abc123def4567890", "dirty": False}, **kw)


def test_runner_writes_one_json_per_cell(qualify: Any, engines: Any, tmp_path: Path,
                                         clock: Any) -> None:
    cells = qualify.select_cells("core,0.6b-graph-full-nostore")
    code = _runner(qualify, engines, tmp_path, clock).run(cells)
    assert code == 0
    assert len(engines.calls) == 9  # 3 stock + 6 monitored
    results = tmp_path / "results"
    for cell in cells:
        data = json.loads((results / f"{cell.name}.json").read_text())
        assert data["cell"] == cell.name
        assert data["status"] == "passed", data
        assert data["commit"] == "abc123def4567890"
        assert data["command"].startswith("python")
        assert data["ran_at_utc"]
        assert data["finished_at_utc"] >= data["ran_at_utc"]
        assert data["settings"]["engine"]["disable_radix_cache"] is True
        assert data["settings"]["monitored_env"]["DMX_HOOK_SELECTION"] == cell.preset
        assert data["checks"]["token_identity"]["ok"]
        assert data["checks"]["token_identity"]["compared"] > 50
        assert data["checks"]["rows_complete"]["ok"]
        assert data["checks"]["stock_deterministic"]["ok"]
        fig = data["figures"]
        assert fig["headline_ratio"] == pytest.approx(1.0)
        assert fig["capture_bytes"] > 0
        assert data["stock"]["source"] == "this call"
        if cell.persistence == "chdb":
            assert data["checks"]["stored_exactly_expected"]["ok"]
            assert fig["store_insert_MBps"] > 0
        else:
            assert data["checks"]["rows_complete"]["requests_with_extra_forward"] > 0
    summary = json.loads((results / "summary.json").read_text())
    assert [r["status"] for r in summary["cells"]] == ["passed"] * len(cells)
    assert (results / "logs").exists() is False  # fake logs do not exist


def test_runner_detects_divergence_and_incomplete_rows(qualify: Any, engines: Any,
                                                       tmp_path: Path, clock: Any) -> None:
    engines.diverge = {"bs8-mixed-3"}
    real_read_back = engines.read_back

    def incomplete(store: Path, run_id: str, outputs: Any) -> dict[str, Any]:
        back = real_read_back(store, run_id, outputs)
        back["incomplete"] = {"bs1-0": ["resid_pre layer 3: rows 0-5 missing"]}
        return back

    engines.read_back = incomplete
    cells = qualify.select_cells("0.6b-graph-hidden")
    code = _runner(qualify, engines, tmp_path, clock).run(cells)
    data = json.loads((tmp_path / "results" / "0.6b-graph-hidden.json").read_text())
    assert code == 1
    assert data["status"] == "failed"
    tokens = data["checks"]["token_identity"]
    assert tokens["diverged"][0]["id"] == "bs8-mixed-3"
    rows = data["checks"]["rows_complete"]
    assert not rows["ok"]
    assert "1 requests incomplete (CaptureHandle.missing)" in rows["problems"]


def test_stock_failure_makes_dependent_cells_errors(qualify: Any, engines: Any,
                                                    tmp_path: Path, clock: Any) -> None:
    engines.fail = {"stock-0.6b-graph"}
    cells = qualify.select_cells("0.6b-graph-hidden,0.6b-graph-full,0.6b-eager-hidden")
    code = _runner(qualify, engines, tmp_path, clock).run(cells)
    assert code == 1
    for name in ("0.6b-graph-hidden", "0.6b-graph-full"):
        data = json.loads((tmp_path / "results" / f"{name}.json").read_text())
        assert data["status"] == "error"
        assert "stock baseline failed" in data["error"]
    ok = json.loads((tmp_path / "results" / "0.6b-eager-hidden.json").read_text())
    assert ok["status"] == "passed"


def test_budget_skips_then_next_call_continues(qualify: Any, engines: Any, tmp_path: Path,
                                               clock: Any) -> None:
    cells = qualify.select_cells("0.6b-graph-hidden,0.6b-graph-full")
    engines.clock, engines.seconds_per_engine = clock, 150.0
    # Room for the stock engine and one monitored engine, not for the second.
    first = _runner(qualify, engines, tmp_path, clock, deadline=clock.now + 360).run(cells)
    assert first == qualify.EXIT_INCOMPLETE
    results = tmp_path / "results"
    hidden = json.loads((results / "0.6b-graph-hidden.json").read_text())
    full = json.loads((results / "0.6b-graph-full.json").read_text())
    assert hidden["status"] == "passed"
    assert full["status"] == "skipped"
    assert "not started" in full["error"]
    assert len(engines.calls) == 2

    # Next call: the hidden cell is reused, the stock baseline too; only one engine starts.
    engines.calls.clear()
    again = _runner(qualify, engines, tmp_path, clock, deadline=clock.now + 400).run(cells)
    assert again == 0
    assert [name for name, _ in engines.calls] == ["monitored-0.6b-graph-full"]
    hidden = json.loads((results / "0.6b-graph-hidden.json").read_text())
    full = json.loads((results / "0.6b-graph-full.json").read_text())
    assert hidden["from_earlier_call"] is True
    assert full["status"] == "passed"
    assert full["stock"]["source"].startswith("reused")

    # --fresh ignores both.
    engines.calls.clear()
    assert _runner(qualify, engines, tmp_path, clock, fresh=True).run(cells) == 0
    assert len(engines.calls) == 3


def _earlier_lease(qualify: Any, engines: Any, tmp_path: Path, clock: Any, cells: list[Any],
                   edit: Callable[[str, dict[str, Any]], dict[str, Any]]) -> Path:
    """Run ``cells`` as an earlier lease; its stock baselines, each passed through
    ``edit(file name, data)``, in a directory of their own (like committed evidence)."""
    assert _runner(qualify, engines, tmp_path / "lease1", clock).run(cells) == 0
    earlier = tmp_path / "evidence"
    earlier.mkdir()
    for path in (tmp_path / "lease1" / "state" / "stock").glob("*.json"):
        (earlier / path.name).write_text(
            json.dumps(edit(path.name, json.loads(path.read_text()))))
    engines.calls.clear()
    return earlier


def test_stock_baselines_of_an_earlier_lease_are_reused_when_their_hash_matches(
        qualify: Any, engines: Any, tmp_path: Path, clock: Any) -> None:
    cells = qualify.select_cells("0.6b-graph-hidden,0.6b-eager-hidden")
    earlier = _earlier_lease(  # a baseline of other settings must not be taken
        qualify, engines, tmp_path, clock, cells,
        lambda name, data: data | {"stock_hash": "0" * 12} if "graph" in name else data)
    runner = _runner(qualify, engines, tmp_path / "lease2", clock, stock_from=earlier)
    assert runner.run(cells) == 0
    assert sorted(name for name, _ in engines.calls) == [
        "monitored-0.6b-eager-hidden", "monitored-0.6b-graph-hidden", "stock-0.6b-graph"]
    results = tmp_path / "lease2" / "results"
    eager = json.loads((results / "0.6b-eager-hidden.json").read_text())
    graph = json.loads((results / "0.6b-graph-hidden.json").read_text())
    assert eager["stock"]["source"].startswith("reused")
    assert str(earlier) in eager["stock"]["source"]
    assert graph["stock"]["source"] == "this call"


def test_stock_from_refuses_failed_baselines_and_fresh_ignores_it(
        qualify: Any, engines: Any, tmp_path: Path, clock: Any) -> None:
    cells = qualify.select_cells("0.6b-eager-hidden")
    earlier = _earlier_lease(qualify, engines, tmp_path, clock, cells,
                             lambda name, data: data | {"ok": False})
    (path,) = (tmp_path / "lease1" / "state" / "stock").glob("*.json")
    assert _runner(qualify, engines, tmp_path / "lease2", clock, stock_from=earlier).run(
        cells) == 0
    assert [n for n, _ in engines.calls] == ["stock-0.6b-eager", "monitored-0.6b-eager-hidden"]

    (earlier / path.name).write_text(path.read_text())  # a good one, ignored under --fresh
    engines.calls.clear()
    assert _runner(qualify, engines, tmp_path / "lease3", clock, stock_from=earlier,
                   fresh=True).run(cells) == 0
    assert [n for n, _ in engines.calls] == ["stock-0.6b-eager", "monitored-0.6b-eager-hidden"]


def test_stock_from_must_be_a_directory(qualify: Any, tmp_path: Path) -> None:
    (tmp_path / "file.json").write_text("{}")
    with pytest.raises(SystemExit, match="is not a directory"):
        qualify.main([str(tmp_path / "r"), "--stock-from", str(tmp_path / "file.json")])
    with pytest.raises(SystemExit, match="does not exist"):
        qualify.main([str(tmp_path / "r"), "--stock-from", str(tmp_path / "nowhere")])


def test_a_baseline_of_other_software_fails_the_cell(qualify: Any) -> None:
    stock = {"env_info": {"python": "3.12.3", "torch": "2.13.0", "sglang": "0.5.19",
                          "device": "NVIDIA H200"}}
    same = qualify.same_software(stock, json.loads(json.dumps(stock)))
    assert same == {"ok": True, "differ": {}}
    other = {"env_info": stock["env_info"] | {"torch": "2.11.0"}}
    differ = qualify.same_software(stock, other)
    assert differ == {"ok": False,
                      "differ": {"torch": {"stock": "2.13.0", "monitored": "2.11.0"}}}
    assert qualify.status_of({"same_software": differ, "t": {"ok": True}}) == "failed"


def test_startup_measurements_feed_estimates(qualify: Any, engines: Any, tmp_path: Path,
                                             clock: Any) -> None:
    runner = _runner(qualify, engines, tmp_path, clock)
    runner.run(qualify.select_cells("0.6b-eager-hidden"))
    assert runner.timings() == {"0.6b-eager": 12.0}
    cell = qualify.BY_NAME["0.6b-eager-hidden"]
    assert qualify.estimate_stock_s(cell, runner.timings()) < qualify.estimate_stock_s(cell)


def test_cli_list_and_dry_run(qualify: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert qualify.main(["--list"]) == 0
    assert "0.6b-graph-full-nostore" in capsys.readouterr().out
    assert qualify.main(["--dry-run", "--cells", "8b-graph-hidden", "--budget-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 engine starts for 1 cells" in out
    assert "GB captured" in out
    with pytest.raises(SystemExit):
        qualify.main(["--dry-run", "--cells", "bogus"])


def test_smoke_script_dry_run() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "DMI_V0519_CELLS": "0.6b-graph-hfonly"}
    proc = subprocess.run(["bash", str(ROOT / "tests" / "run_v0519_smoke.sh"), "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "2 engine starts for 1 cells" in proc.stdout
    bad = subprocess.run(["bash", str(ROOT / "tests" / "run_v0519_smoke.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**env, "DMI_V0519_CELLS": "nope"})
    assert bad.returncode == 2
    assert "unknown cell" in bad.stderr


def test_informational_token_identity(qualify: Any, engines: Any, tmp_path: Path,
                                      clock: Any) -> None:
    """The small-ring cell passes on complete rows even where tokens differ."""
    engines.diverge = {"bs13-pad-2"}
    cells = qualify.select_cells("0.6b-graph-full-ring64")
    assert _runner(qualify, engines, tmp_path, clock).run(cells) == 0
    data = json.loads((tmp_path / "results" / "0.6b-graph-full-ring64.json").read_text())
    assert data["status"] == "passed"
    assert data["checks"]["token_identity"]["ok"] is False
    assert data["checks"]["token_identity"]["required"] is False
    assert data["checks"]["rows_complete"]["ok"]
    assert data["settings"]["monitored_env"]["DMX_RING_PAYLOAD_MB"] == "64"
