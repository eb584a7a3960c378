"""The harness's parts on their own: log parsing, bounds, bracketed figures, read-back on a
real embedded store, the docs generator, the deadline."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from harness import checks, docs
from harness.bounds import bound, directory_bytes, measure_disk_bps
from harness.engine import (
    STAT_EVENTS,
    GpuBusy,
    cpu_between,
    group_cpu,
    group_threads,
    parse_log_events,
    processes_between,
    run_workload,
    threads_between,
)
from harness.qualify import select_cells
from harness.results import Deadline, finish, result, write_json
from harness.serving import (
    capture_line,
    hooks_line,
    scheduler_use,
    store_line,
    threads_line,
    use_line,
)

RUN = "harness-run"
RESID = "blocks.hook_resid_pre"


def test_log_events_are_parsed_from_console_and_json_lines() -> None:
    text = ("\x1b[2m2026-12-01\x1b[0m [info     ] dmi.stopped    bytes=4096 rows=12 "
            "run_id='r 1' shape=[1, 2] ok=True\n"
            '{"event": "store.closed", "bytes_stored": 4096}\n'
            "[info     ] dmi.stopped    bytes=8192 rows=24\n")
    found = parse_log_events(text, ("dmi.stopped", "store.closed", "dmi.timing"))
    assert found["dmi.stopped"] == {"bytes": 8192, "rows": 24}  # the last one wins
    assert found["store.closed"]["bytes_stored"] == 4096
    assert "dmi.timing" not in found
    first = parse_log_events(text.splitlines()[0], ("dmi.stopped",))["dmi.stopped"]
    assert first == {"bytes": 4096, "rows": 12, "run_id": "r 1", "shape": "[1, 2]",
                     "ok": True}
    ready = ("[info     ] capture transport ready        copy_gaps=True "
             "copy_piece_bytes=16777216 side_stream=True topk_kernel=flashinfer\n")
    options = parse_log_events(ready, STAT_EVENTS)["capture transport ready"]
    assert options == {"copy_gaps": True, "copy_piece_bytes": 16777216, "side_stream": True,
                       "topk_kernel": "flashinfer"}


def test_the_bound_is_the_hardware_rate_over_the_rate_stock_speed_needs() -> None:
    d2h = bound(captured_bytes_per_token=1000.0, stock_tok_s=20_000.0, d2h_bps=10e6)
    assert d2h["kind"] == "d2h"
    assert d2h["needed_bps"] == 20e6
    assert d2h["ratio"] == pytest.approx(0.5)
    disk = bound(captured_bytes_per_token=1000.0, stock_tok_s=20_000.0, d2h_bps=10e6,
                 disk_bps=5e6, compression=2.0)
    assert disk["ratio"] == pytest.approx(0.5)
    assert bound(captured_bytes_per_token=1.0, stock_tok_s=1.0, d2h_bps=9.0)["ratio"] == 1.0
    assert bound(captured_bytes_per_token=1.0, stock_tok_s=None, d2h_bps=9.0)["ratio"] is None


def test_the_disk_probe_writes_syncs_and_removes_its_file(tmp_path: Path) -> None:
    assert measure_disk_bps(tmp_path, 8 << 20) > 0
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_bytes(b"x" * 10_000)
    assert directory_bytes(tmp_path) >= 10_000


def _run(name: str, seconds: float, tokens: int = 100) -> dict[str, object]:
    return {"name": name, "timed": True, "seconds": seconds, "output_tokens": tokens}


def test_throughput_is_each_measured_run_over_the_stock_runs_around_it() -> None:
    units = [{"stock_before": [_run("main", 1.0)], "stock_after": [_run("main", 1.25)],
              "measured": {"workloads": [_run("main", 2.0), {**_run("w", 9.0),
                                                              "timed": False}]}},
             {"stock_before": [_run("main", 1.25)], "stock_after": [_run("main", 1.0)],
              "measured": {"workloads": [_run("main", 1.0)]}}]
    got = checks.bracketed_throughput(units)
    assert list(got) == ["main"]
    assert got["main"]["ratios"] == pytest.approx([50 / 90, 100 / 90])
    assert got["main"]["ratio_spread"] == pytest.approx(1.0)
    assert got["main"]["stock_spread"] == pytest.approx(0.25)
    assert got["main"]["stock_runs"] == 4


def test_token_identity_names_the_first_difference_and_missing_requests() -> None:
    ref = [{"key": "a", "output_ids": [1, 2, 3]}, {"key": "b", "output_ids": [4]}]
    same = checks.token_identity(ref, [dict(r) for r in ref])
    assert same["ok"]
    assert same["compared"] == 2
    other = checks.token_identity(ref, [{"key": "a", "output_ids": [1, 9, 3]}])
    assert not other["ok"]
    assert other["diverged"] == [{"key": "a", "first_diff": 1}]
    assert other["missing"] == ["b"]


def _store(tmp_path: Path, *, commit: bool) -> Path:
    path = tmp_path / "store"
    sink = ClickHouseSink(StoreConfig(kind=StoreKind.EMBEDDED, path=str(path),
                                      flush_timeout_us=20_000))
    run = RunInfo(RUN, "/m", (), ((RESID, 0),), "2026-12-01T10:00:00+00:00")
    sink.start_run(run)
    sink.put(RecordBatch.from_records([
        CaptureRecord(model_id=RUN, request_id=rid, act_name=RESID, layer_no=0, shard_rank=0,
                      start_token_idx=0, end_token_idx=n, dtype="torch.float32",
                      shape=(n, 2), payload=bytes(8 * n), seq=1)
        for rid, n in (("main-0.w0", 5), ("main-1.w0", 3))]))
    if commit:
        sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED),
                        [RequestManifest(RUN, "main-0.w0", 4, 2, committed=True),
                         RequestManifest(RUN, "main-1.w0", 2, 2, committed=True)])
    sink.close()
    return path


def test_read_back_and_completeness_on_a_real_store(tmp_path: Path) -> None:
    store = _store(tmp_path, commit=True)
    back = checks.read_back(store, RUN, ["main-0.w0", "main-1.w0", "never-stored"])
    assert back["run_status"] == "committed"
    assert back["hook_totals"] == {RESID: [8, 64]}
    assert back["manifests"] == {"main-0.w0": [4, 2, False], "main-1.w0": [2, 2, False]}
    assert sorted(back["stored_requests"]) == ["main-0.w0", "main-1.w0"]
    assert list(back["missing"]) == ["never-stored"]
    sent = [{"id": "main-0.w0", "prompt_tokens": 4, "completion_tokens": 2},
            {"id": "main-1.w0", "prompt_tokens": 2, "completion_tokens": 2}]
    rows = checks.rows_complete(sent, checks.read_back(store, RUN, [s["id"] for s in sent]))
    assert rows["ok"], rows
    wrong = checks.rows_complete([{**sent[0], "completion_tokens": 3}, sent[1]],
                                 checks.read_back(store, RUN, [s["id"] for s in sent]))
    assert wrong["problems"] == ["1 manifests disagree with SGLang's token counts"]
    events = {"dmi.stopped": {"bytes": 64}, "store.closed": {"bytes_stored": 64}}
    assert checks.bytes_stored_equal_captured(events, back["hook_totals"])["ok"]
    events["dmi.stopped"]["bytes"] = 72
    assert not checks.bytes_stored_equal_captured(events, back["hook_totals"])["ok"]


def test_an_unfinished_run_is_not_complete(tmp_path: Path) -> None:
    store = _store(tmp_path, commit=False)
    back = checks.read_back(store, RUN, ["main-0.w0"])
    assert back["run_status"] == "interrupted"
    assert "main-0.w0" in back["missing"]


def test_docs_blocks_are_generated_from_results_and_checked(tmp_path: Path) -> None:
    evidence = tmp_path / "evidence" / "2026-12-01-h200-cells"
    data = result("qualify-cell", "0.6b-graph-hidden", {})
    data["checks"] = {"token_identity": {"ok": True, "compared": 306},
                      "rows_complete": {"ok": True}}
    data["figures"] = {"headline_workload": "bs64", "headline_ratio": 0.9,
                       "capture_bytes": 3.2e9, "throughput": {"bs64": {"stock_spread": 0.01}}}
    write_json(evidence / "0.6b-graph-hidden.json", finish(data))
    doc = tmp_path / "port.md"
    doc.write_text("intro\n<!-- BEGIN GENERATED: qualified-cells (python -m harness docs) -->\n"
                   "old\n<!-- END GENERATED: qualified-cells -->\n"
                   "<!-- BEGIN GENERATED: serving-bench (x) -->\nkept\n"
                   "<!-- END GENERATED: serving-bench -->\n")
    assert docs.main(["--docs", str(tmp_path), "--check"]) == 1
    assert docs.main(["--docs", str(tmp_path)]) == 0
    text = doc.read_text()
    assert "| 0.6b-graph-hidden | passed | yes (306 req.) | yes | - | 0.900 (bs64, 1.0%)" in text
    assert "kept" in text  # no serving result: the block stays as it was
    assert text.startswith("intro\n")
    assert docs.main(["--docs", str(tmp_path), "--check"]) == 0


def test_the_serving_table_keeps_a_row_per_model_each_judged_by_its_own_target(
        tmp_path: Path) -> None:
    def serving(model: str, ratio: float) -> tuple[Path, dict[str, Any]]:
        workload = {"model": model, "batch": 64, "prompt_len": 256, "output_len": 128,
                    "min_seconds": 30.0}
        data = result("serving", "serving", workload)
        data["units"] = [{"settings": workload | {"mode": "transport:hidden-states"},
                          "status": "passed"}]
        # written before the model had a target: the table judges it by today's
        data["summary"] = [{"mode": "transport:hidden-states", "units": 1,
                            "status": "passed", "ratio": ratio, "ratio_spread": 0.0,
                            "stock_spread": 0.01, "bound": 1.0, "bound_share": ratio,
                            "target": "ratio >= 0.97",
                            "verdict": "n/a (not the reference workload)"}]
        return tmp_path / f"{model}.json", finish(data, "passed")

    table = docs.serving_table([serving("0.6b", 0.9), serving("8b", 0.975)], tmp_path)
    rows = [line for line in table.splitlines() if line.startswith("| transport:")]
    assert len(rows) == 2
    assert "| 0.6b, 64 x 256 + 128, >= 30 s |" in rows[0]
    assert "| 0.900 |" in rows[0]
    assert "| ratio >= 0.97: FAIL |" in rows[0]
    assert "| 8b, 64 x 256 + 128, >= 30 s |" in rows[1]
    assert "| 0.975 |" in rows[1]
    assert "| ratio >= 0.97: PASS |" in rows[1]


def test_the_serving_table_keeps_each_cards_latest_row_and_names_the_card(
        tmp_path: Path) -> None:
    """Ratios of different GPUs are not comparable: an H100 result does not replace the
    H200 row of its mode; a result that recorded no card gives way to one that did."""
    def serving(name: str, ratio: float, device: str | None) -> tuple[Path, dict[str, Any]]:
        workload = {"model": "0.6b", "batch": 64, "prompt_len": 256, "output_len": 128,
                    "min_seconds": 30.0}
        data = result("serving", "serving", workload)
        checks = ({"same_software": {"ok": True, "compared": {"device": [device, device]}}}
                  if device else {})
        data["units"] = [{"settings": workload | {"mode": "store:resid_pre:last"},
                          "status": "passed", "checks": checks}]
        data["summary"] = [{"mode": "store:resid_pre:last", "units": 1, "status": "passed",
                            "ratio": ratio, "ratio_spread": None, "stock_spread": 0.01,
                            "bound": 1.0, "bound_share": ratio}]
        return tmp_path / f"{name}.json", finish(data, "passed")

    found = [serving("old", 0.5, None), serving("h200", 0.895, "NVIDIA H200"),
             serving("h100", 0.914, "NVIDIA H100 80GB HBM3")]
    rows = [line for line in docs.serving_table(found, tmp_path).splitlines()
            if line.startswith("| store:")]
    assert len(rows) == 2, rows
    assert rows[0].startswith("| store:resid_pre:last | H200 |")
    assert "| 0.895 |" in rows[0]
    assert rows[1].startswith("| store:resid_pre:last | H100 80GB HBM3 |")
    assert "| 0.914 |" in rows[1]
    alone = docs.serving_table([serving("old", 0.5, None)], tmp_path)
    assert "| store:resid_pre:last | - |" in alone


def test_the_deadline_setting_is_one_number_of_seconds() -> None:
    assert Deadline(env={}).left() == float("inf")
    assert Deadline(env={"DMI_HARNESS_DEADLINE_S": "60"}, clock=lambda: 0.0).at == 60.0
    with pytest.raises(SystemExit, match="DMI_HARNESS_DEADLINE_S='soon'"):
        Deadline(env={"DMI_HARNESS_DEADLINE_S": "soon"})


def test_an_unknown_cell_is_refused_with_the_accepted_names() -> None:
    with pytest.raises(ValueError, match=r"unknown cell 'nope'; accepted: core, optional"):
        select_cells("core,nope")
    assert [c.name for c in select_cells("8b-graph-hidden")] == ["8b-graph-hidden"]
    with pytest.raises(ValueError, match="no cell named in ','"):
        select_cells(",")


def test_the_original_smoke_variables_are_refused_with_their_replacements(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.__main__ import main

    monkeypatch.setenv("DMI_V0519_CELLS", "graph")
    monkeypatch.setenv("DMI_V0519_MEM_FRACTION", "0.3")
    assert main(["qualify", "--list"]) == 2
    err = capsys.readouterr().err
    assert "DMI_V0519_CELLS: --cells core|optional|all" in err
    assert "DMI_V0519_MEM_FRACTION: none" in err
    assert "DMI_HARNESS_DEADLINE_S" in err
    monkeypatch.delenv("DMI_V0519_CELLS")
    monkeypatch.delenv("DMI_V0519_MEM_FRACTION")
    assert main(["qualify", "--list"]) == 0


def test_saved_results_are_reused_only_for_the_same_code_and_settings(tmp_path: Path) -> None:
    from harness.results import Resumable

    saved = Resumable(tmp_path)
    data = finish(result("qualify-cell", "c", {}) | {"checks": {"x": {"ok": True}}})
    saved.put("c", "id-1", data)
    assert saved.get("c", "id-1") is not None
    assert saved.get("c", "id-2") is None
    assert Resumable(tmp_path, fresh=True).get("c", "id-1") is None
    other_code = Resumable(tmp_path)
    other_code.code = "0" * 12
    assert other_code.get("c", "id-1") is None
    saved.put("s", "id-1", finish(result("qualify-cell", "s", {}), "skipped"))
    assert saved.get("s", "id-1") is None


def test_the_committed_docs_match_the_committed_results() -> None:
    assert docs.main(["--check"]) == 0


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.__main__ import main

    assert main(["--help"]) == 0
    assert "qualify,serving,hooks,transport,store,profile,docs" in capsys.readouterr().out
    assert main(["bogus"]) == 2


def test_serving_targets_are_judged_only_on_the_reference_workload() -> None:
    from harness.serving import verdict

    reference = {"model": "0.6b", "batch": 64, "prompt_len": 256, "output_len": 128,
                 "min_seconds": 30.0}
    units = [{"settings": reference}]
    assert verdict("transport:hidden-states", {"ratio": 0.98, "bound_share": None}, units) \
        == {"target": "ratio >= 0.97", "verdict": "PASS"}
    assert verdict("transport:sglang-full", {"ratio": 0.5, "bound_share": 0.7}, units) \
        == {"target": "ratio >= 0.6", "verdict": "FAIL"}
    assert verdict("store:hidden-states", {"ratio": 0.3, "bound_share": 0.9}, units)[
        "verdict"] == "PASS"
    short = [{"settings": reference | {"min_seconds": 5.0}}]
    assert verdict("transport:hidden-states", {"ratio": 0.99, "bound_share": None}, short)[
        "verdict"] == "n/a (not the reference workload)"
    assert verdict("transport:hidden-states", {"ratio": None, "bound_share": None}, [])[
        "verdict"] == "not measured"
    assert verdict("return-hidden-states", {"ratio": 0.1, "bound_share": None}, units) == {
        "target": None, "verdict": None}


def test_a_serving_target_is_judged_on_the_model_it_is_stated_for() -> None:
    from harness.serving import verdict

    def on(model: str) -> list[dict[str, object]]:
        return [{"settings": {"model": model, "batch": 64, "prompt_len": 256,
                              "output_len": 128, "min_seconds": 30.0}}]

    assert verdict("transport:hidden-states", {"ratio": 0.975, "bound_share": None},
                   on("8b")) == {"target": "ratio >= 0.97", "verdict": "PASS"}
    assert verdict("transport:hidden-states", {"ratio": 0.95, "bound_share": None},
                   on("8b"))["verdict"] == "FAIL"
    # no 8B target for sglang-full: the reference model's is shown, not judged
    assert verdict("transport:sglang-full", {"ratio": 0.9, "bound_share": None},
                   on("8b")) == {"target": "ratio >= 0.6",
                                 "verdict": "n/a (not the reference workload)"}
    # a unit that does not say its model is not the reference workload
    unsaid = [{"settings": {"batch": 64, "prompt_len": 256, "output_len": 128,
                            "min_seconds": 30.0}}]
    assert verdict("transport:hidden-states", {"ratio": 0.99, "bound_share": None},
                   unsaid)["verdict"] == "n/a (not the reference workload)"


def _stat_line(pid: int, name: str, pgrp: int, utime: int, stime: int) -> str:
    """A /proc/PID/stat line: pid (comm) state ppid pgrp session ... utime stime ..."""
    rest = ["S", "1", str(pgrp), "1", "0", "-1", "0", "0", "0", "0", "0",
            str(utime), str(stime), "0", "0"]
    return f"{pid} ({name}) {' '.join(rest)}\n"


def test_group_cpu_reads_the_groups_processes_and_names_with_blanks(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    for pid, comm, argv, pgrp, ut, st in [
            (10, "sglang::schedul", b"sglang::scheduler_TP0\0\0", 7, 3 * ticks, ticks),
            (11, "odd) (name", b"", 7, ticks, 0),
            (12, "python", b"/usr/bin/python3\0-m\0x\0", 7, 2 * ticks, 0),
            (13, "python", b"/usr/bin/python3\0", 8, 50 * ticks, 0)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat_line(pid, comm, pgrp, ut, st))
        if argv:
            (tmp_path / str(pid) / "cmdline").write_bytes(argv)
    (tmp_path / "self").mkdir()  # not a process directory
    (tmp_path / "14").mkdir()  # a process that ended between the listing and the read
    assert group_cpu(7, tmp_path) == {"sglang::scheduler_TP0 10": 4.0, "odd) (name 11": 1.0,
                                      "python3 12": 2.0}
    assert group_cpu(9, tmp_path) == {}
    assert group_cpu(7, tmp_path / "absent") == {}


def _status(voluntary: int, involuntary: int) -> str:
    return (f"Name:\tpython\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t{voluntary}\n"
            f"nonvoluntary_ctxt_switches:\t{involuntary}\n")


def test_group_threads_reads_each_thread_of_the_groups_processes(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    for pid, pgrp, tasks in [(10, 7, [(10, 3, 5, 1), (12, 2, 900, 4)]),
                             (11, 8, [(11, 50, 0, 0)])]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat_line(pid, "sched", pgrp, ticks, 0))
        (tmp_path / str(pid) / "cmdline").write_bytes(b"sglang::scheduler_TP0\0")
        for tid, cpu, vol, invol in tasks:
            task = tmp_path / str(pid) / "task" / str(tid)
            task.mkdir(parents=True)
            task.joinpath("stat").write_text(_stat_line(tid, "sched", pgrp, cpu * ticks, 0))
            task.joinpath("status").write_text(_status(vol, invol))
    (tmp_path / "10" / "task" / "13").mkdir()  # a thread that ended meanwhile
    (tmp_path / "10" / "task" / "12" / "stat").write_text(
        _stat_line(12, "ZMQbg/IO/0", 7, 2 * ticks, 0))  # a thread named (libzmq's)
    assert group_threads(7, tmp_path) == {
        "sglang::scheduler_TP0 10/10": (3.0, 5, 1, "sched"),
        "sglang::scheduler_TP0 10/12": (2.0, 900, 4, "ZMQbg/IO/0")}
    assert group_threads(7, tmp_path / "absent") == {}


def test_threads_between_reports_the_busiest_threads_from_zero_when_new() -> None:
    before = {"sched 10/10": (3.0, 5, 1, "sched"), "sched 10/12": (2.0, 900, 4, "sched")}
    after = {"sched 10/10": (7.5, 25, 3, "sched"), "sched 10/12": (2.25, 1900, 4, "sched"),
             "detok 20/20": (0.5, 3, 0, "detok"), "sched 10/14": (1.0, 10, 2, "dmi-capture-dra")}
    assert threads_between(before, after, top=3) == [
        {"process": "sched", "pid": 10, "tid": 10, "main": True, "thread": "sched",
         "cpu_s": 4.5, "voluntary": 20, "involuntary": 2},
        {"process": "sched", "pid": 10, "tid": 14, "main": False, "thread": "dmi-capture-dra",
         "cpu_s": 1.0, "voluntary": 10, "involuntary": 2},
        {"process": "detok", "pid": 20, "tid": 20, "main": True, "thread": "detok",
         "cpu_s": 0.5, "voluntary": 3, "involuntary": 0}]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_minor_faults_count_the_pages_a_process_touches_fresh() -> None:
    from harness.engine import process_minor_faults

    before = process_minor_faults(os.getpid())
    fresh = mmap.mmap(-1, 64 << 20)  # 16,384 pages, none touched yet
    try:
        for at in range(0, len(fresh), mmap.PAGESIZE):
            fresh[at] = 1
        assert process_minor_faults(os.getpid()) - before >= (64 << 20) // mmap.PAGESIZE
    finally:
        fresh.close()
    assert process_minor_faults(2**22 + 7, Path("/proc")) == 0  # no such process


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_group_threads_sees_a_busy_thread_of_a_child() -> None:
    code = ("import time\nfrom dmi_sglang.threads import OsNamedThread\n"
            "def burn():\n t=time.thread_time()\n while time.thread_time()-t<0.5: pass\n"
            "OsNamedThread(target=burn, name='dmi-burner').start()\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        spent: dict[str, tuple[float, int, int, str]] = {}
        while time.monotonic() < deadline:
            spent = group_threads(child.pid)
            if any(cpu >= 0.3 for cpu, *_ in spent.values()):
                break
            time.sleep(0.1)
        busy = [k for k, (cpu, *_) in spent.items() if cpu >= 0.3]
        assert len(busy) == 1
        assert spent[busy[0]][3] == "dmi-burner"
        assert busy[0].split()[-1].startswith(f"{child.pid}/")
        assert busy[0].split()[-1] != f"{child.pid}/{child.pid}"  # not the main thread
    finally:
        child.kill()
        child.wait()


def test_gpu_busy_averages_the_readings_taken_while_the_block_ran() -> None:
    values = iter([80.0, 60.0, 100.0, 40.0] + [70.0] * 10_000)
    calls: list[int] = []
    returned: list[float] = []

    def read() -> float:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("NVML hiccup")  # a failed reading is not a reading
        returned.append(next(values))
        return returned[-1]

    with GpuBusy(period_s=0.001, read=read) as busy:
        deadline = time.monotonic() + 10
        while len(returned) < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
    taken = list(returned)  # the thread has stopped: nothing more is read
    time.sleep(0.01)
    assert returned == taken
    assert len(calls) == len(taken) + 1
    assert busy.summary == {"mean_pct": round(sum(taken) / len(taken), 1),
                            "readings": len(taken)}
    assert taken[:4] == [80.0, 60.0, 100.0, 40.0]


def test_a_workload_names_the_waves_in_which_its_process_collected_all_generations() -> None:
    import gc

    class Collecting:
        """An engine whose second wave runs a full collection, as a first one of a fresh
        process does when the objects its imports made are walked."""

        waves = 0

        def generate(self, **args: Any) -> list[dict[str, Any]]:
            self.waves += 1
            if self.waves == 2:
                gc.collect()  # all generations
            else:
                gc.collect(0)  # a young collection is not a full one
            return [{"output_ids": [7], "meta_info": {"id": rid, "completion_tokens": 1,
                                                      "prompt_tokens": 1}}
                    for rid in args["rid"]]

    res = run_workload(Collecting(), {"name": "main", "rids": ["a", "b"], "input_ids": [[1]] * 2,
                                      "sampling_params": [{}] * 2, "max_waves": 3,
                                      "min_seconds": 3600})
    assert res["waves"] == 3
    [(wave, seconds)] = res["gc_full_waves"]
    assert wave == 1
    assert 0 < seconds < res["wave_seconds"][1]


def test_gpu_busy_without_readings_is_not_measured() -> None:
    with GpuBusy(period_s=60, read=lambda: 50.0) as slow:
        pass  # stopped before its first reading
    assert slow.summary is None


def test_processes_between_counts_every_thread_of_each_process() -> None:
    before = {f"sglang::scheduler 100/{100 + i}": (0.0, 0, 0, "s") for i in range(12)}
    after = {"sglang::scheduler 100/100": (10.0, 5, 1, "s"), "python3 7/7": (2.0, 3, 0, "p")}
    after |= {f"sglang::scheduler 100/{100 + i}": (1.0, 1, 0, "s") for i in range(1, 12)}
    after["sglang::scheduler 100/120"] = (0.5, 0, 0, "s")  # started in between
    procs = processes_between(before, after)
    assert procs == [
        {"process": "sglang::scheduler", "pid": 100, "main_cpu_s": 10.0,
         "main_voluntary": 5, "main_involuntary": 1, "others_cpu_s": 11.5, "threads": 13},
        {"process": "python3", "pid": 7, "main_cpu_s": 2.0, "main_voluntary": 3,
         "main_involuntary": 0, "others_cpu_s": 0.0, "threads": 1}]
    assert len(threads_between(before, after)) == 8  # the busiest only: not for totals


def _proc(name: str, *, main: float, vol: int, others: float) -> dict[str, Any]:
    return {"process": name, "pid": 10, "main_cpu_s": main, "main_voluntary": vol,
            "main_involuntary": 0, "others_cpu_s": others, "threads": 9}


def test_scheduler_use_is_the_scheduler_process_per_wave() -> None:
    procs = [_proc("sglang::scheduler_TP0", main=8.0, vol=400, others=1.5),
             _proc("python3", main=3.0, vol=9, others=4.0)]  # the engine's own process
    use = scheduler_use(procs, {"mean_pct": 81.5, "readings": 300}, 20)
    assert use == {"main_cpu_s": 0.4, "main_voluntary": 20.0, "others_cpu_s": 0.075,
                   "gpu_busy_pct": 81.5}
    assert scheduler_use(None, None, 0) == {"main_cpu_s": None, "main_voluntary": None,
                                            "others_cpu_s": None, "gpu_busy_pct": None}


def test_use_line_sets_the_monitored_run_beside_each_stock_run() -> None:
    sched = [_proc("sglang::scheduler_TP0", main=4.0, vol=100, others=0.0)]
    figures = {"processes": {"measured": sched, "stock_before": [sched],
                             "stock_after": [[]]},
               "gpu_busy": {"measured": {"mean_pct": 70.0}, "stock_before": [None],
                            "stock_after": [{"mean_pct": 90.0}]},
               "wave_seconds": {"measured": [0.4] * 10, "stock_before": [[0.4] * 8],
                                "stock_after": [[0.4] * 8]}}
    line = use_line(figures)
    assert line.startswith("monitored: scheduler 0.400 s CPU (10 waits), others 0.000 s, "
                           "GPU 70 %; stock before: scheduler 0.500 s CPU (12 waits)")
    assert "stock after: scheduler - s CPU (- waits), others - s, GPU 90 %" in line


def test_threads_line_names_the_monitored_runs_busiest_threads() -> None:
    rows = [{"process": "python3", "pid": 7, "tid": 9, "main": False, "thread": "ZMQbg/IO/0",
             "cpu_s": 15.35, "voluntary": 1, "involuntary": 0},
            {"process": "sglang::scheduler", "pid": 5, "tid": 5, "main": True,
             "cpu_s": 7.391, "voluntary": 1, "involuntary": 0}]  # read before names
    figures = {"threads": {"measured": rows, "stock_before": [[]]}}
    assert threads_line(figures) == ("busiest threads: ZMQbg/IO/0 (python3 7) 15.35 s, "
                                     "? (sglang::scheduler 5) 7.39 s")
    assert threads_line(figures, top=1).endswith("15.35 s")
    assert threads_line({}) == "busiest threads: -"


def test_hooks_line_splits_the_hooks_time_between_graph_steps_and_eager_forwards() -> None:
    timing = {"forwards": 100.0, "graph_forwards": 96.0, "host_seconds": 0.00696,
              "host_graph_seconds": 0.00576}
    assert hooks_line({"timing": timing}) == (
        "hooks: 60.0 µs a decode graph step (96), 300.0 µs an eager forward (4)")
    assert hooks_line({"timing": timing | {"graph_forwards": 0.0, "host_graph_seconds": 0.0}}
                      ) == "hooks: - a decode graph step (0), 69.6 µs an eager forward (100)"
    older = {k: v for k, v in timing.items() if k != "graph_forwards"}
    assert hooks_line({"timing": older}) is None
    assert hooks_line({}) is None
    split = timing | {f"host_graph_{part}_seconds": s for part, s in (
        ("requests", 0.00048), ("begin", 0.00096), ("preflight", 0.00192),
        ("commit", 0.00192), ("end", 0.00048))}
    assert hooks_line({"timing": split}) == (
        "hooks: 60.0 µs a decode graph step (96: requests 5.0 µs, begin 10.0 µs, "
        "preflight 20.0 µs, commit 20.0 µs, end 5.0 µs), 300.0 µs an eager forward (4)")


def test_capture_line_gives_the_prefills_waits_and_the_drains_build() -> None:
    timing = {"forwards": 5079.0, "graph_forwards": 5000.0, "capture_seconds": 7.9,
              "stall_seconds": 3.09, "piecewise_stall_seconds": 2.5,
              "drain_build_cpu_seconds": 10.38, "drain_window_flush_cpu_seconds": 4.99,
              "drain_window_append_cpu_seconds": 0.9,
              "drain_outside_window_not_decode": 4403.0, "drain_outside_window_rows": 0.0}
    assert capture_line({"timing": timing}) == (
        "capture: eager forwards' capture points 7.90 s (100.0 ms each, 79); ring waits "
        "3.09 s (piecewise parts' 2.50 s); drain building 10.38 s CPU (window flushes "
        "4.99 s, appends 0.90 s); items outside the window: not_decode 4,403")
    graphs_only = timing | {"forwards": 5000.0, "drain_outside_window_not_decode": 0.0}
    assert capture_line({"timing": graphs_only}).startswith(
        "capture: eager forwards' capture points 7.90 s (none, 0)")
    assert capture_line({"timing": graphs_only}).endswith("outside the window: none")
    older = {k: v for k, v in timing.items() if k != "piecewise_stall_seconds"}
    assert capture_line({"timing": older}) is None
    assert capture_line({}) is None


def test_store_line_sets_the_inserts_against_the_writers_waits() -> None:
    store = {"bytes_stored": 21_286_092_800, "inserts": 89, "writers": 4,
             "insert_seconds": 48.3, "writer_idle_empty_seconds": 30.25,
             "writer_idle_partial_seconds": 12.0, "put_wait_seconds": 17.04,
             "background_sync_seconds": 8.78, "finish_seconds": 2.89,
             "finish_flush_seconds": 2.31, "finish_queued_bytes": 1_610_612_736,
             "sync_seconds": 0.26}
    assert store_line({"store": store}) == (
        "store: 21.3 GB in 89 inserts by 4 writers: inserting 48.3 s, idle 30.2 s with "
        "nothing queued and 12.0 s with a partial insert queued; put blocked 17.0 s, "
        "background sync 8.8 s (the writers' seconds summed over them, idle from the first "
        "batch on); finish_run 2.9 s: 2.3 s inserting 1.61 GB queued at its start, 0.3 s "
        "syncing (with close's)")
    older = {k: v for k, v in store.items()
             if "idle" not in k and "wait" not in k and "finish" not in k}
    assert "idle - with nothing queued and - with a partial" in str(store_line({"store": older}))
    assert "finish_run -: - inserting - queued at its start" in str(store_line({"store": older}))
    assert store_line({"store": None}) is None
    assert store_line({}) is None


def test_cpu_between_counts_new_processes_from_zero_most_first() -> None:
    before = {"main 1": 10.0, "scheduler 2": 5.0}
    after = {"main 1": 10.5, "scheduler 2": 9.0, "detokenizer 3": 0.25}
    assert list(cpu_between(before, after).items()) == [
        ("scheduler 2", 4.0), ("main 1", 0.5), ("detokenizer 3", 0.25)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_group_cpu_sees_a_busy_child_of_its_own_group() -> None:
    code = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.5: pass\n" \
           "time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        spent: dict[str, float] = {}
        while time.monotonic() < deadline:
            spent = group_cpu(child.pid)
            if sum(spent.values()) >= 0.3:
                break
            time.sleep(0.1)
        assert [k.split()[-1] for k in spent] == [str(child.pid)]
        assert sum(spent.values()) >= 0.3  # /proc rounds down to ticks: 0.5 s burnt
        assert str(child.pid) not in [k.split()[-1] for k in group_cpu(os.getpgid(0))]
    finally:
        child.kill()
        child.wait()
