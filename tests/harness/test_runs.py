"""The harness end to end on CPU: engine children (a fake engine), brackets, checks,
resumable results, the deadline."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from harness import serving
from harness.engine import EngineError, EngineProcess, kill_leftovers
from harness.models import MODELS, write_model_dir
from harness.qualify import CELLS, Qualification
from harness.results import Deadline, load_json
from harness.workloads import Workload

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


def serve(tmp_path: Path, mode: str, *, repeats: int, batch: int, prompt: int,
          output: int, env: tuple[str, ...] = (), min_seconds: float = 0.01,
          ) -> tuple[int, dict[str, Any]]:
    """The serving benchmark on the fake engine: its exit status and result JSON."""
    out = tmp_path / "serving.json"
    code = serving.main(["--out", str(out), "--modes", mode, "--repeats", str(repeats),
                         "--batch", str(batch), "--prompt-len", str(prompt),
                         "--output-len", str(output), "--min-seconds", str(min_seconds),
                         "--engine-class", FAKE, "--work", str(tmp_path / "work"),
                         *(a for e in env for a in ("--env", e))])
    data = load_json(out)
    assert data is not None
    return code, data


def test_the_serving_benchmark_brackets_every_engine(tmp_path: Path) -> None:
    code, data = serve(tmp_path, "transport:hidden-states", repeats=2, batch=4, prompt=8,
                       output=4)
    assert code == 0, data["summary"]
    assert [u["name"] for u in data["units"]] == ["transport-hidden-states-r0",
                                                  "transport-hidden-states-r1"]
    row = data["summary"][0]
    assert row["units"] == 2
    assert row["ratio"] is not None
    assert row["ratio_spread"] is not None
    assert data["units"][0]["bound"]["kind"] == "d2h"
    assert data["units"][0]["checks"]["rows_accounted"]["ok"]
    threads = data["units"][0]["figures"]["threads"]  # each engine child's own threads
    assert len(threads["stock_before"]) == len(threads["stock_after"]) == 1
    for run in (threads["measured"], *threads["stock_before"], *threads["stock_after"]):
        assert run
        assert any(t["main"] for t in run)
        assert all(t["cpu_s"] >= 0 and t["voluntary"] >= 0 for t in run)
    procs = data["units"][0]["figures"]["processes"]
    assert all(p["threads"] >= 1 for p in procs["measured"])
    busy = data["units"][0]["figures"]["gpu_busy"]  # None where NVML is not there
    assert set(busy) == {"measured", "stock_before", "stock_after"}
    collected = data["units"][0]["figures"]["gc_full_waves"]  # [wave, seconds] each
    assert set(collected) == {"measured", "stock_before", "stock_after"}
    assert isinstance(collected["measured"], list)
    assert len(collected["stock_before"]) == len(collected["stock_after"]) == 1
    assert data["units"][0]["figures"]["gc_freeze_s"] >= 0
    # every engine ran its warm-ups with the collector as it starts, its timed waves
    # with it frozen (the fake logs each generate call)
    logs = {log.name: log for log in (tmp_path / "work").rglob("*.log")}
    for name in ("stock-serving.log", "transport-hidden-states-r0.log"):
        calls = [line.split() for line in logs[name].read_text().splitlines()
                 if line.startswith("fake generate ")]  # fake generate RID gc frozen=BOOL
        assert any("warmup" in c[2] for c in calls), name
        assert any("warmup" not in c[2] for c in calls), name
        assert all((c[-1] == "frozen=True") != ("warmup" in c[2]) for c in calls), calls


def test_a_sampled_store_run_is_checked_against_the_requests_it_captured(
        tmp_path: Path) -> None:
    code, data = serve(tmp_path, "store:hidden-states", repeats=1, batch=8, prompt=8,
                       output=4, env=("DMX_REQUEST_SAMPLE=0.5",))
    unit = data["units"][0]
    assert code == 0, unit["checks"]
    assert unit["checks"]["rows_accounted"]["ok"]
    assert unit["checks"]["sample_complete"]["ok"]
    requests = unit["figures"]["requests"]
    assert 0 < requests["captured"] < requests["served"]  # about half of them


def test_serving_refuses_a_setting_the_modes_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serving.main(["--env", "DMX_DB_URL=none", "--dry-run"])
    assert "DMX_DB_URL" in capsys.readouterr().err


def _child(tmp_path: Path) -> EngineProcess:
    model = write_model_dir(tmp_path / "models", MODELS["0.6b"])
    spec = {"engine": {"model_path": str(model), "max_total_tokens": 64},
            "env": {"DMX_SGLANG_ENABLE": "0"}, "factory": FAKE}
    return EngineProcess("child", spec, tmp_path / "engines")


WORKLOAD = Workload("w", (3, 4), (2, 2))


@pytest.mark.parametrize(("fault", "message"), [
    ("raise", "RuntimeError: boom in generate"),
    ("exit", "the child exited (status 7) without replying"),
    ("hang", "no reply within 2 s (killed)")])
def test_a_failing_engine_child_is_reported_not_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, message: str) -> None:
    child = _child(tmp_path)
    assert child.start(30)["max_total_num_tokens"] == 64
    assert child.request("run", 30, workload=WORKLOAD.spec())["output_tokens"] == 4
    child.close()
    monkeypatch.setenv("FAKE_RUN_FAULT", fault)
    child = _child(tmp_path)
    child.start(30)
    with pytest.raises(EngineError, match=re.escape(message)) as failed:
        child.request("run", 2, workload=WORKLOAD.spec())
    if fault == "hang":  # the stacks of where it waited are in its error
        assert re.search(r'fake_engine\.py", line \d+ in generate', str(failed.value))
    assert child.close()["leftover_processes"] in (True, False)
    assert child.proc is not None
    assert child.proc.poll() is not None  # nothing of it is left running


def test_past_the_deadline_an_engine_is_killed_not_waited_for_to_shut_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bracket whose deadline passed closes its engines at once: a polite shutdown
    (up to two minutes, SGLang's can take tens of seconds) ran the invocation past its
    deadline, into the device call's own limit, which ended it before it wrote its
    result. Before the deadline the shutdown is still polite."""
    from harness.bracket import Bracket
    from harness.results import Deadline

    monkeypatch.setenv("FAKE_SHUTDOWN_S", "8")
    took = {}
    for budget in (6.0, 3600.0):  # time to start the engine, then the deadline passes
        deadline = Deadline(budget_s=budget)
        bracket = Bracket("k", _child(tmp_path).spec, [], workdir=tmp_path / "engines",
                          deadline=deadline)
        bracket.start()
        while budget < 60 and deadline.left() > 0:
            time.sleep(0.05)
        t0 = time.monotonic()
        bracket.close()
        took[budget] = time.monotonic() - t0
    assert took[6.0] < 6, took  # killed (the kill waits 2 s for the GPU's memory)
    assert took[3600.0] >= 8, took  # a shutdown that takes its time, before the deadline


def test_leftover_engines_of_an_interrupted_run_are_killed(tmp_path: Path) -> None:
    pgids = tmp_path / "engines.pgids"
    child = EngineProcess("child", _child(tmp_path).spec, tmp_path / "engines", pgids)
    child.start(30)
    assert child.proc is not None
    assert pgids.read_text().split() == [str(child.proc.pid)]
    assert kill_leftovers(pgids) == [child.proc.pid]
    child.proc.wait(10)
    assert pgids.read_text() == ""


def test_return_hidden_states_mode_asks_for_them_and_stock_does_not(tmp_path: Path) -> None:
    code, data = serve(tmp_path, "return-hidden-states", repeats=1, batch=2, prompt=4,
                       output=3)
    assert code == 0, data
    unit = data["units"][0]
    assert unit["figures"]["hidden_state_values"] >= 2 * 3 * 8
    assert unit["checks"]["token_identity"]["ok"]
    assert "bound" not in unit or not unit["bound"]


def test_the_stored_mode_reads_back_and_states_the_disk_bound(tmp_path: Path) -> None:
    code, data = serve(tmp_path, "store:hidden-states", repeats=1, batch=2, prompt=4,
                       output=3)
    unit = data["units"][0]
    assert code == 0, unit
    assert unit["checks"]["sample_complete"]["ok"]
    stored = unit["checks"]["bytes_stored_equal_captured"]
    assert stored["ok"]
    assert stored["captured"] > 0
    assert unit["bound"]["kind"] == "disk"
    assert unit["bound"]["disk_bps"] > 0
    assert unit["bound"]["compression"] > 0
    assert unit["figures"]["on_disk_bytes"] > 0


def test_a_stored_cell_stops_once_its_waves_captured_the_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """">= 30 s of steady decoding or >= 20 GB captured, whichever comes first": a stored
    cell's timed waves end at the cap (its sampled share of each wave counted), a
    capture-only cell's at ``--min-seconds``; every check still holds."""
    args = argparse.Namespace(model="0.6b", batch=4, prompt_len=8, output_len=4, env={},
                              engine_class=FAKE, min_seconds=1.0)
    per_wave = serving.wave_bytes(args, "hidden-states")
    monkeypatch.setattr(serving, "STORED_CELL_CAPTURE_BYTES", 2.5 * per_wave)
    stored, sampled, transport = serving.parse_modes(
        "store:hidden-states,store:hidden-states[DMX_REQUEST_SAMPLE=0.5],"
        "transport:hidden-states")
    assert serving.timed_waves_at_most(args, stored) == 3
    assert serving.timed_waves_at_most(args, sampled) == 5
    assert serving.timed_waves_at_most(args, transport) == serving.MAX_WAVES
    assert serving.timed_waves_at_most(args, None) == serving.MAX_WAVES
    assert serving.workloads(args, stored)[1].max_waves == 3
    code, data = serve(tmp_path, "store:hidden-states,transport:hidden-states", repeats=1,
                       batch=4, prompt=8, output=4, min_seconds=1.0)
    assert code == 0, [u["checks"] for u in data["units"]]
    store_unit, transport_unit = data["units"]
    assert store_unit["figures"]["waves"] == 3
    assert transport_unit["figures"]["waves"] > 3  # ran its second


def test_a_stored_cell_capped_at_one_wave_names_and_checks_it_as_a_wave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One wave reaches the cap and ``--min-seconds 0``: its request ids still carry the
    wave (``.w0``), as the checks look for them."""
    args = argparse.Namespace(model="0.6b", batch=4, prompt_len=8, output_len=4, env={},
                              engine_class=FAKE, min_seconds=0.0)
    monkeypatch.setattr(serving, "STORED_CELL_CAPTURE_BYTES",
                        0.5 * serving.wave_bytes(args, "hidden-states"))
    code, data = serve(tmp_path, "store:hidden-states", repeats=1, batch=4, prompt=8,
                       output=4, min_seconds=0.0)
    unit = data["units"][0]
    assert code == 0, unit["checks"]
    assert unit["figures"]["waves"] == 1


@pytest.mark.parametrize("share", ["1", "0.4", "0.25", "0.65"])
def test_a_capped_cell_stops_at_the_first_wave_that_reaches_the_cap(share: str) -> None:
    """The cap counts the requests the sample keeps (by their ids, as the checks count
    them), not the nominal share: the waves run reach it, one wave fewer does not."""
    args = argparse.Namespace(model="0.6b", batch=64, prompt_len=256, output_len=128,
                              min_seconds=30.0, env={}, engine_class=FAKE)
    mode = serving.parse_modes(f"store:hidden-states[DMX_REQUEST_SAMPLE={share}]")[0]
    waves = serving.timed_waves_at_most(args, mode)
    per_request = serving.wave_bytes(args, "hidden-states") / args.batch
    env = serving.mode_env(args, mode)

    def captured(n: int) -> float:
        return per_request * sum(len(serving.sampled(env, serving.wave_rids(args, k)))
                                 for k in range(n))

    assert captured(waves) >= serving.STORED_CELL_CAPTURE_BYTES > captured(waves - 1)


def test_a_capped_cells_estimate_counts_its_waves_not_min_seconds() -> None:
    args = argparse.Namespace(model="0.6b", batch=64, prompt_len=256, output_len=128,
                              min_seconds=600.0, env={}, engine_class=FAKE)
    stored, transport = serving.parse_modes("store:hidden-states,transport:hidden-states")
    # the stored engine stops at 20 GB, long before 600 s of waves: its estimate is the
    # stock block's 600 s plus its capped waves' ingest, well under two blocks of 600 s
    assert serving.estimate_s(args, stored) < serving.estimate_s(args, transport)


def test_a_store_run_that_samples_no_request_passes_with_nothing_stored(
        tmp_path: Path) -> None:
    code, data = serve(tmp_path, "store:hidden-states", repeats=1, batch=4, prompt=8,
                       output=4, env=("DMX_REQUEST_SAMPLE=0",))
    unit = data["units"][0]
    assert code == 0, unit["checks"]
    assert unit["figures"]["requests"]["captured"] == 0
    assert unit["checks"]["rows_accounted"]["rows"] == 0
    stored = unit["checks"]["bytes_stored_equal_captured"]
    assert stored["ok"]
    assert stored["captured"] == stored["inserted"] == stored["held"] == 0


def test_topk_logits_are_a_mode_of_their_own(tmp_path: Path) -> None:
    code, data = serve(tmp_path, "store:final_logits:topk(8)", repeats=1, batch=4, prompt=8,
                       output=4)
    unit = data["units"][0]
    assert code == 0, unit["checks"]
    per_token = 8 * 4 + 8 * 4  # fp32 values, int32 ids
    held = unit["checks"]["bytes_stored_equal_captured"]["held"]
    assert held > 0
    assert held % per_token == 0  # whole rows of K values and K ids, nothing else


def test_the_profile_command_summarizes_each_modes_trace(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from harness import profile

    out = tmp_path / "profile.json"
    code = profile.main(["--modes", "stock,transport:hidden-states", "--steps", "5",
                         "--batch", "2", "--prompt-len", "4", "--output-len", "7",
                         "--engine-class", FAKE, "--work", str(tmp_path / "work"),
                         "--out", str(out)])
    assert code == 0
    data = load_json(out)
    assert data is not None
    assert data["kind"] == "profile"
    assert data["status"] == "passed"
    modes = data["figures"]["modes"]
    assert [m["mode"] for m in modes] == ["stock", "transport:hidden-states"]
    s = modes[1]["summary"]
    assert s["forwards"] == 5
    assert s["window_s"] == pytest.approx((4 * 3000 + 2100) / 1e6)  # first hook to last append
    assert s["gpu_busy"] == pytest.approx(5 * 800 / (4 * 3000 + 2100))
    threads = {t["name"]: t for t in s["threads"]}
    assert threads["MainThread"]["python_s"] == pytest.approx(5 * 1200e-6)
    assert threads["MainThread"]["dmi_s"] == pytest.approx(5 * 200e-6)  # not the forward
    assert threads["dmi-capture-drain"]["dmi_s"] == pytest.approx(5 * 500e-6)
    by = {f["function"]: f for f in s["dmi"]}
    assert by["adapters/sglang_v0519/runtime_hooks.py: around_forward"] == {
        "function": "adapters/sglang_v0519/runtime_hooks.py: around_forward",
        "seconds": pytest.approx(5 * 200e-6), "calls": 5}
    assert s["dmi_ops"] == [{"op": "aten::copy_", "seconds": pytest.approx(5 * 30e-6)}]
    assert modes[1]["run"]["requests"] == 2
    printed = capsys.readouterr().out
    assert "transport:hidden-states" in printed
    assert "around_forward" in printed


def test_the_profile_command_profiles_a_stored_mode(tmp_path: Path) -> None:
    from harness import profile

    out = tmp_path / "profile.json"
    code = profile.main(["--modes", "stock,store:hidden-states", "--steps", "5",
                         "--batch", "2", "--prompt-len", "4", "--output-len", "7",
                         "--engine-class", FAKE, "--work", str(tmp_path / "work"),
                         "--out", str(out)])
    data = load_json(out)
    assert data is not None
    assert code == 0, data
    assert [m["mode"] for m in data["figures"]["modes"]] == ["stock", "store:hidden-states"]


def test_the_profile_command_refuses_more_steps_than_a_wave_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    from harness import profile

    with pytest.raises(SystemExit) as exited:
        profile.main(["--steps", "40", "--output-len", "41"])
    assert exited.value.code == 2
    assert "--steps 40: at most --output-len - 2 = 39" in capsys.readouterr().err


def test_cells_are_named_by_mode_and_env_and_carry_their_own_targets() -> None:
    from harness.serving import cell, summarize

    assert cell("store:hidden-states", {}) == "store:hidden-states"
    assert cell("store:hidden-states", {"DMX_REQUEST_SAMPLE": "0.1"}) == (
        "store:hidden-states [DMX_REQUEST_SAMPLE=0.1]")
    units = [{"settings": {"mode": "store:hidden-states", "env": env, "model": "0.6b",
                           "batch": 64, "prompt_len": 256, "output_len": 128,
                           "min_seconds": 30},
              "status": "passed", "bound": {"ratio": 1.0},
              "figures": {"throughput": {"ratios": [ratio], "stock_rates": [20000.0]}}}
             for env, ratio in (({}, 0.5), ({"DMX_REQUEST_SAMPLE": "0.1"}, 0.92))]
    rows = {r["mode"]: r for r in summarize(units)}
    assert rows["store:hidden-states"]["target"] == "bound_share >= 0.85"
    assert rows["store:hidden-states"]["verdict"] == "FAIL"
    sampled = rows["store:hidden-states [DMX_REQUEST_SAMPLE=0.1]"]
    assert (sampled["target"], sampled["verdict"]) == ("ratio >= 0.9", "PASS")


def test_a_modes_own_request_sample_decides_what_its_units_are_checked_against(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    modes = "store:hidden-states,store:hidden-states[DMX_REQUEST_SAMPLE=0.5]"
    assert serving.main(["--modes", modes, "--batch", "8", "--prompt-len", "8",
                         "--output-len", "4", "--repeats", "1", "--dry-run"]) == 0
    plain, sampled = (float(re.findall(r"([0-9.]+) GB captured per wave", line)[0])
                      for line in capsys.readouterr().out.splitlines())
    assert sampled == pytest.approx(plain / 2)
    code, data = serve(tmp_path, modes, repeats=1, batch=8, prompt=8, output=4)
    assert code == 0, [u["checks"] for u in data["units"]]
    first, second = (u["figures"]["requests"] for u in data["units"])
    assert first["captured"] == first["served"]
    assert 0 < second["captured"] < second["served"]  # about half of them
    assert data["units"][1]["checks"]["sample_complete"]["ok"]


def test_a_mode_with_settings_of_its_own_is_measured_beside_the_plain_mode(
        tmp_path: Path) -> None:
    from harness.serving import Mode, mode_env, monitored_spec, parse_modes

    both = parse_modes("transport:hidden-states, transport:hidden-states[DMX_DRAIN_WINDOW_MB=16 "
                       "DMX_DRAIN_LINGER_US=0]")
    assert both == [Mode("transport", "hidden-states"),
                    Mode("transport", "hidden-states",
                         (("DMX_DRAIN_LINGER_US", "0"), ("DMX_DRAIN_WINDOW_MB", "16")))]
    # values as the settings write them: one cell name per engine
    assert parse_modes("store:hidden-states[DMX_REQUEST_SAMPLE=0.10 DMX_DRAIN_WINDOW_MB=016]") \
        == [Mode("store", "hidden-states",
                 (("DMX_DRAIN_WINDOW_MB", "16"), ("DMX_REQUEST_SAMPLE", "0.1")))]
    args = argparse.Namespace(env={"DMX_CH_WRITERS": "2"}, engine_class="sglang:Engine")
    assert mode_env(args, both[1]) == {"DMX_CH_WRITERS": "2", "DMX_DRAIN_LINGER_US": "0",
                                       "DMX_DRAIN_WINDOW_MB": "16"}
    spec = monitored_spec(args, both[1], {}, tmp_path, "run")
    assert spec["env"]["DMX_DRAIN_WINDOW_MB"] == "16"
    assert spec["env"]["DMX_CH_WRITERS"] == "2"
    assert "DMX_DRAIN_WINDOW_MB" not in monitored_spec(args, both[0], {}, tmp_path, "run")["env"]

    code, data = serve(tmp_path, "transport:hidden-states,"
                       "transport:hidden-states[DMX_DRAIN_WINDOW_MB=16]",
                       repeats=1, batch=4, prompt=8, output=4)
    assert code == 0, data["summary"]
    assert [u["name"] for u in data["units"]] == [
        "transport-hidden-states-r0", "transport-hidden-states-DMX_DRAIN_WINDOW_MB-16-r0"]
    assert [u["settings"]["env"] for u in data["units"]] == [{}, {"DMX_DRAIN_WINDOW_MB": "16"}]
    assert [r["mode"] for r in data["summary"]] == [
        "transport:hidden-states", "transport:hidden-states [DMX_DRAIN_WINDOW_MB=16]"]


@pytest.mark.parametrize(("modes", "env", "words"), [
    ("transport:hidden-states[DMX_DRAIN_WINDOW_MB=8]", (), "an integer from 16 to 16,384"),
    ("transport:hidden-states[DMX_DB_URL=none]", (), "DMX_DB_URL is set by every mode"),
    ("transport:hidden-states[WINDOW=16]", (), "expected DMX_NAME=VALUE"),
    ("transport:hidden-states[DMX_DRAIN_WINDOW_MB=16", (), "accepted store:PRESET"),
    ("return-hidden-states[DMX_DRAIN_WINDOW_MB=16]", (), "takes no DMX_* settings"),
    ("transport:hidden-states[DMX_DRAIN_WINDOW_MB=16]", ("DMX_DRAIN_WINDOW_MB=32",),
     "is set by --env too"),
    ("transport:hidden-states[DMX_DRAIN_LINGER_US=0 DMX_DRAIN_LINGER_US=5]", (),
     "DMX_DRAIN_LINGER_US is given twice"),
    ("transport:hidden-states[DMX_CH_PASSWORD=hunter2]", (), "DMX_CH_PASSWORD is a secret"),
    ("transport:hidden-states", ("DMX_CH_PASSWORD=hunter2",), "DMX_CH_PASSWORD is a secret"),
    ("transport:hidden-states[DMX_CH_USER=a-b],transport:hidden-states[DMX_CH_USER=a+b]",
     (), "would share the unit name"),
    ("transport:hidden-states[" + " ".join(f"DMX_DRAIN_{k}=1" for k in (
        "LINGER_US", "GIL_SLICE_US", "FLUSH_TIMEOUT_US")) + " DMX_CH_WRITERS=2 "
     "DMX_CH_INSERT_ROWS=1000 DMX_CH_QUEUE_MB=100 DMX_RING_TASK_ENTRIES=1000 "
     "DMX_CH_TIMEOUT_S=10 DMX_STORE_MAX_GB=1]", (), "DMX_MODEL_ID"),
], ids=["out-of-range", "owned", "not-dmx", "unclosed", "rhs", "twice", "repeated",
        "secret", "secret-env", "same-slug", "run-id-too-long"])
def test_a_modes_own_settings_are_checked_before_any_engine_starts(
        modes: str, env: tuple[str, ...], words: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serving.main(["--modes", modes, *(a for e in env for a in ("--env", e)), "--dry-run"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert words in err
    assert "hunter2" not in err


def _serve_model(tmp_path: Path, model: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / f"serving-{model}.json"
    code = serving.main(["--out", str(out), "--modes", "transport:hidden-states",
                         "--repeats", "1", "--batch", "2", "--prompt-len", "4",
                         "--output-len", "3", "--min-seconds", "0.01", "--model", model,
                         "--engine-class", FAKE, "--work", str(tmp_path / "work")])
    data = load_json(out)
    assert data is not None
    return code, data


def test_a_units_estimate_is_not_another_configurations_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seconds a unit took were kept per mode alone: a 0.6b unit's planned an 8b one
    (a unit that cannot fit started and was cut off at the deadline; one that could was
    skipped on every invocation)."""
    code, _ = _serve_model(tmp_path, "0.6b")
    assert code == 0
    budget = 60.0
    args = argparse.Namespace(model="8b", batch=2, prompt_len=4, output_len=3,
                              min_seconds=0.01, env={})
    need = serving.estimate_s(args, serving.parse_modes("transport:hidden-states")[0])
    assert need * 1.5 > budget  # the 8b unit's own estimate does not fit
    monkeypatch.setenv("DMI_HARNESS_DEADLINE_S", str(budget))
    code, data = _serve_model(tmp_path, "8b")
    assert data["units"][0]["status"] == "skipped"
    assert code == 3


def test_an_erred_units_seconds_do_not_become_its_modes_estimate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL_START", "1")
    _, data = serve(tmp_path, "transport:hidden-states", repeats=1, batch=2, prompt=4,
                    output=3)
    assert data["units"][0]["status"] == "error"
    monkeypatch.delenv("FAKE_FAIL_START")
    monkeypatch.setenv("DMI_HARNESS_DEADLINE_S", "60")  # below 1.5 x the estimate
    _, data = serve(tmp_path, "transport:hidden-states", repeats=1, batch=2, prompt=4,
                    output=3)
    assert data["units"][0]["status"] == "skipped", "planned with a failed start's seconds"


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_min_seconds_is_refused(value: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """nan made every estimate nan: every unit skipped, exit 3 ("run again") forever."""
    with pytest.raises(SystemExit) as exc:
        serving.main(["--min-seconds", value, "--dry-run"])
    assert exc.value.code == 2
    assert "--min-seconds" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["nan", "-60"])
def test_a_deadline_that_is_no_number_of_seconds_is_refused(text: str) -> None:
    """Both were read as no deadline at all: the invocation outlasted its lease."""
    with pytest.raises(SystemExit, match="DMI_HARNESS_DEADLINE_S"):
        Deadline(env={"DMI_HARNESS_DEADLINE_S": text})


def test_an_overrun_engines_error_quotes_its_stacks_from_the_first_dump(tmp_path: Path) -> None:
    """The error of an engine that did not reply quotes its log from the first process's
    stack dump on (the lines before it are the engine's ordinary log), or, where no
    process wrote one, the log's tail."""
    child = EngineProcess("x", {}, tmp_path)
    child.log.write_text("\n".join(f"log line {i}" for i in range(100)) + "\n")
    assert child._stacks() == child._tail()
    assert "log line 99" in child._stacks()
    assert "log line 69" not in child._stacks()
    dump = ["Fatal Python error: Aborted", "", "Thread 0x1 (most recent call first):",
            '  File "x.py", line 3 in wait']
    child.log.write_text("\n".join(["log line a", *dump, "Fatal Python error: Aborted"]))
    quoted = child._stacks()
    assert "log line a" not in quoted
    assert quoted.splitlines()[2:] == [*dump, "Fatal Python error: Aborted"]
