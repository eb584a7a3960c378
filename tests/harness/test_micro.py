"""The component benchmarks (``python -m harness transport`` / ``store``) on CPU, tiny sizes:
one result of the one schema, every row delivered, the bound and the spreads present."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness.constants import SCHEMA

KEYS = {"schema", "kind", "name", "status", "commit", "code", "command", "ran_at_utc",
        "finished_at_utc", "settings", "checks", "figures", "bound", "error"}


def _needs_torch() -> None:
    if os.environ.get("CI", "").lower() != "true":  # under CI=true a missing torch fails
        pytest.importorskip("torch")


def _result(path: Path, kind: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    assert set(data) == KEYS
    assert (data["schema"], data["kind"], data["status"], data["error"]) == (
        SCHEMA, kind, "passed", None)
    required = [c["ok"] for c in data["checks"].values() if c["required"]]
    assert required == [True] * len(required) != []
    return data


@pytest.mark.torch
def test_transport_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    _needs_torch()
    from harness.micro_transport import DRAIN_PRESETS, main

    monkeypatch.setenv("OUT", str(tmp_path))  # the default --out: $OUT/transport.json
    assert main(["--device", "cpu", "--layers", "2", "--hidden", "32", "--vocab", "256",
                 "--batches", "1,8", "--steps", "4", "--warmup", "1", "--reps", "2",
                 "--ring-mb", "16"]) == 0
    data = _result(tmp_path / "transport.json", "transport")
    rows = data["figures"]["overhead"]
    assert [(r["preset"], r["batch"], r["captures"]) for r in rows] == [
        ("hidden-states", 1, 2), ("hidden-states", 8, 2), ("7-hooks", 1, 14), ("7-hooks", 8, 14)]
    for r in rows:  # 2 x (1 + 4) captured steps, every row of every capture delivered
        assert r["delivered"]
        assert r["rows"] == r["rows_expected"] == 10 * r["batch"] * r["captures"]
        assert len(r["overheads_us"]) == 2
        assert r["overhead_spread_us"] == max(r["overheads_us"]) - min(r["overheads_us"])
    drain = data["figures"]["drain"]
    assert set(drain) == set(DRAIN_PRESETS)
    for summary in drain.values():
        assert (len(summary["runs"]), summary["spread"] >= 0) == (2, True)
        for run in summary["runs"]:
            assert run["delivered"]
            assert run["rows"] == 4 * 64 * run["captures"] > 0
            assert run["bytes"] == 4 * run["step_bytes"] > 0
            assert run["counters"]["records"] > 0
    bound = data["bound"]  # no CUDA: no D2H bound, and the reason says so
    assert (bound["kind"], bound["d2h_bps"], bound["d2h_probes_bps"]) == ("d2h", None, [None] * 3)
    assert "CUDA" in bound["reason"]
    assert not data["checks"]["hidden_states_bs64_overhead"]["required"]
    out = capsys.readouterr().out
    assert (out.count("delivered"), out.count("LOST")) == (6, 0)
    assert "bound: pinned D2H None" in out


@pytest.mark.torch
def test_store_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _needs_torch()
    from harness.micro_store import main

    out = tmp_path / "results" / "store.json"
    assert main(["--quick", "--mb", "2", "--sizes", "16384", "--writers", "1,2",
                 "--repeat", "2", "--probe-mb", "4", "--readback", "2,8,8",
                 "--dir", str(tmp_path), "--out", str(out)]) == 0
    data = _result(out, "store")
    rows = data["figures"]["ingest"]
    assert [(r["payload_bytes"], r["writers"]) for r in rows] == [(16384, 1), (16384, 2)]
    for r in rows:
        assert r["delivered"]
        assert [(x["records"], x["delivered"]) for x in r["runs"]] == [(2_000_000 // 16384,
                                                                        True)] * 2
        assert min(r["spread"], r["compression"], r["of_bound"], r["cpu_s_per_GB"]) >= 0
        assert r["of_bound"] > 0
    bound = data["bound"]  # probe, run, probe, run, probe per configuration
    assert (bound["kind"], len(bound["disk_probes_bps"])) == ("disk", 5)
    assert min(bound["disk_probes_bps"]) > 0
    assert bound["disk_spread"] >= 0
    assert bound["ratio"] == max(r["of_bound"] for r in rows)
    back = data["figures"]["readback"]
    assert (back["equal"], back["positions"], back["records"]) == (True, 16, 2 * 9)
    assert min(back["available_ms_cold"], back["hidden_states_ms"]) > 0
    assert not list(tmp_path.glob("dmi-store-bench-*"))  # the scratch stores are gone
    assert "read equal to what was written" in capsys.readouterr().out
