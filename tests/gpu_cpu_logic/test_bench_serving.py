"""bench/bench_serving.py: modes, specs, merging, targets, budget, with fake engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def test_parse_modes(bench: Any) -> None:
    keys = [m.key for m in bench.parse_modes(bench.DEFAULT_MODES, "hidden-states")]
    assert keys == ["stock", "store[hidden-states]", "transport[hidden-states]",
                    "transport[sglang-full]", "return-hidden-states", "stock-eager"]
    assert [m.key for m in bench.parse_modes("store,stock,store", "hf-only")] == [
        "stock", "store[hf-only]"]
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        bench.parse_modes("stock,fast", "hidden-states")
    with pytest.raises(ValueError, match="takes no preset"):
        bench.parse_modes("stock:hidden-states", "hidden-states")
    with pytest.raises(ValueError, match="no mode"):
        bench.parse_modes(" , ", "hidden-states")


def test_parse_args(bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    args = bench.parse_args(["--quick"])
    assert (args.min_seconds, args.prompt_len, args.output_len, args.batch) == (3.0, 64, 32, 64)
    assert args.out == str(tmp_path / "bench_serving.json")
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "store:nonsense"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "0"])


def test_engine_specs_per_mode(bench: Any, tmp_path: Path) -> None:
    args = bench.parse_args(["--out", str(tmp_path / "o.json")])
    specs = {m.key: bench.engine_spec(args, m, tmp_path, store=tmp_path / "s", run_id="r",
                                      max_waves=7)
             for m in bench.parse_modes(bench.DEFAULT_MODES, "hidden-states")}
    common = specs["stock"]["engine"]
    assert common["disable_prefill_cuda_graph"]
    assert common["disable_radix_cache"]
    assert "chunked_prefill_size" not in common  # SGLang's default, as in the references
    assert common["cuda_graph_max_bs_decode"] == 64
    assert specs["stock"]["env"] == {"DMX_SGLANG_ENABLE": "0"}
    assert specs["stock-eager"]["engine"]["disable_cuda_graph"] is True
    rhs = specs["return-hidden-states"]
    assert rhs["engine"]["enable_return_hidden_states"] is True
    assert all(w["return_hidden_states"] for w in rhs["workloads"])
    assert specs["store[hidden-states]"]["env"]["DMX_DB_URL"] == f"chdb://{tmp_path / 's'}"
    assert specs["transport[sglang-full]"]["env"]["DMX_DB_URL"] == "none"
    assert specs["transport[sglang-full]"]["env"]["DMX_HOOK_SELECTION"] == "sglang-full"
    for key in ("store[hidden-states]", "transport[hidden-states]"):
        assert specs[key]["engine"] == specs["stock"]["engine"]
        assert specs[key]["monitored"] is True
    warm, main = specs["stock"]["workloads"]
    assert not warm["timed"]
    assert main["min_seconds"] == 30.0
    assert main["max_waves"] == 7
    assert len(main["input_ids"]) == 64
    assert {len(x) for x in main["input_ids"]} == {256}
    assert {p["max_new_tokens"] for p in main["sampling_params"]} == {128}
    assert not main["keep_outputs"]


def test_wave_bytes_and_store_cap(bench: Any, tmp_path: Path) -> None:
    args = bench.parse_args(["--out", "x.json", "--max-store-gb", "3"])
    assert bench.wave_bytes(args, "hidden-states") == 64 * 384 * 28 * 2048
    store = bench.Mode("store", "hidden-states")
    cap, why = bench.max_waves_for(args, store, tmp_path)
    assert cap == 2
    assert "--max-store-gb 3" in why
    assert bench.max_waves_for(args, bench.Mode("transport", "hidden-states"), tmp_path) == (
        args.max_waves, "")


def _run(bench: Any, engines: Any, tmp_path: Path, *extra: str) -> int:
    return bench.main(["--out", str(tmp_path / "out.json"), "--state", str(tmp_path / "st"),
                       "--work", str(tmp_path / "work"), "--budget-s", "0", *extra],
                      launcher=engines, read_back=lambda *a: {"sampled": 16, "incomplete": {}})


def test_full_run_merge_and_targets(bench: Any, engines: Any, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(bench, engines, tmp_path) == 0
    assert len(engines.calls) == 6
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["bench"] == "serving"
    assert set(data["modes"]) == {"stock", "store[hidden-states]", "transport[hidden-states]",
                                  "transport[sglang-full]", "return-hidden-states",
                                  "stock-eager"}
    store = data["modes"]["store[hidden-states]"]
    assert store["ok"]
    assert store["commit"]
    assert store["ran_at_utc"]
    assert store["readback"]["incomplete"] == {}
    fig = store["figures"]
    assert fig["transport_rows_check"]["ok"]
    assert fig["capture_bytes_timed"] == 3 * bench.wave_bytes(
        bench.parse_args(["--out", "x"]), "hidden-states")
    assert 0 < fig["d2h_fraction"] < 1
    assert fig["store_insert_MBps"] > 0
    rows = {r["mode"]: r for r in data["summary"]["rows"]}
    assert rows["stock"]["ratio"] == pytest.approx(1.0)
    # the fake store mode pays 0.25 s of stop time on 1.5 s of generation
    assert rows["store[hidden-states]"]["ratio"] == pytest.approx(1.5 / 1.75)
    verdicts = {t["mode"]: t["verdict"] for t in data["summary"]["targets"]}
    assert verdicts == {"store[hidden-states]": "FAIL", "transport[sglang-full]": "PASS"}
    assert rows["return-hidden-states"]["capture_bytes"] > 0
    out = capsys.readouterr().out
    assert "target: hidden-states with persistence" in out
    assert "store[hidden-states]" in out

    # The same command again: every mode has a result, nothing starts.
    engines.calls.clear()
    assert _run(bench, engines, tmp_path) == 0
    assert engines.calls == []
    # --rerun measures the selected modes again.
    assert _run(bench, engines, tmp_path, "--modes", "stock", "--rerun") == 0
    assert [n for n, _ in engines.calls] == ["stock"]


def test_budget_leaves_modes_for_the_next_call(bench: Any, engines: Any, tmp_path: Path,
                                               clock: Any) -> None:
    args = ["--out", str(tmp_path / "out.json"), "--state", str(tmp_path / "st"),
            "--work", str(tmp_path / "work"), "--modes", "stock,stock-eager,store"]
    engines.clock, engines.seconds_per_engine = clock, 150.0
    code = bench.main([*args, "--budget-s", "300"], launcher=engines,
                      read_back=lambda *a: {}, clock=clock)
    assert code == 3
    data = json.loads((tmp_path / "out.json").read_text())
    assert set(data["modes"]) == {"stock", "stock-eager"}
    assert data["pending_modes"] == ["store[hidden-states]"]
    engines.calls.clear()
    assert bench.main([*args, "--budget-s", "0"], launcher=engines,
                      read_back=lambda *a: {}) == 0
    assert [n for n, _ in engines.calls] == ["store-hidden-states"]
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["pending_modes"] == []
    assert len(data["modes"]) == 3


def test_failed_mode_and_merge_from(bench: Any, engines: Any, tmp_path: Path) -> None:
    engines.fail = {"transport-hidden-states"}
    assert _run(bench, engines, tmp_path, "--modes", "stock,transport") == 1
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["modes"]["transport[hidden-states]"]["ok"] is False
    assert "(ERROR)" in bench.render_table(data)
    # A fresh machine: merge the earlier JSON, measure only what is missing.
    engines.calls.clear()
    engines.fail = set()
    other = tmp_path / "other"
    other.mkdir()
    code = bench.main(["--out", str(other / "out.json"), "--state", str(other / "st"),
                       "--work", str(other / "w"), "--budget-s", "0", "--modes",
                       "stock,stock-eager", "--merge-from", str(tmp_path / "out.json")],
                      launcher=engines, read_back=lambda *a: {})
    assert code == 0
    assert [n for n, _ in engines.calls] == ["stock-eager"]
    merged = json.loads((other / "out.json").read_text())
    assert set(merged["modes"]) == {"stock", "transport[hidden-states]", "stock-eager"}
    # A different workload is not merged silently.
    with pytest.raises(ValueError, match="cannot merge"):
        bench.main(["--out", str(other / "o2.json"), "--state", str(other / "st2"),
                    "--budget-s", "0", "--batch", "8", "--merge-from",
                    str(tmp_path / "out.json")], launcher=engines, read_back=lambda *a: {})


def test_merge_prefers_a_success_then_the_newer_run(bench: Any) -> None:
    def data(**modes: dict[str, Any]) -> dict[str, Any]:
        return {"config_hash": "c", "modes": modes}

    ok_old = {"ok": True, "ran_at_utc": "2026-11-29T10:00:00+00:00"}
    ok_new = {"ok": True, "ran_at_utc": "2026-11-29T12:00:00+00:00"}
    failed_newer = {"ok": False, "ran_at_utc": "2026-11-29T13:00:00+00:00"}
    undated = {"ok": True}
    merged = bench.merge(data(a=dict(ok_old), b=dict(failed_newer), c=dict(undated)),
                         data(a=dict(failed_newer), b=dict(ok_old), c=dict(ok_old)))
    assert merged["modes"]["a"] == ok_old  # a failed rerun does not hide a measurement
    assert merged["modes"]["b"] == ok_old  # a success replaces a failure
    assert merged["modes"]["c"] == ok_old  # an undated run never counts as the newest
    assert bench.merge(data(a=dict(ok_old)), data(a=dict(ok_new)))["modes"]["a"] == ok_new


def test_dry_run_starts_nothing(bench: Any, engines: Any, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMI_STATE_ROOT", str(tmp_path / "root"))
    assert bench.main(["--dry-run", "--out", str(tmp_path / "o.json"), "--budget-s", "500"],
                      launcher=engines) == 0
    assert engines.calls == []
    out = capsys.readouterr().out
    assert "27.68 GB captured per wave" in out
    assert "next call" in out
    assert not (tmp_path / "root").exists()
    assert not (tmp_path / "o.json").exists()


def test_env_and_profile_options(bench: Any, tmp_path: Path) -> None:
    plain = bench.parse_args(["--out", str(tmp_path / "o.json")])
    args = bench.parse_args(["--out", str(tmp_path / "o.json"), "--env", "DMX_CH_WRITERS=8",
                             "--profile-seconds", "6"])
    assert bench.bench_config(plain) == {k: v for k, v in bench.bench_config(args).items()
                                         if k not in ("monitored_env", "profile_seconds")}
    assert bench.bench_config(args)["monitored_env"] == {"DMX_CH_WRITERS": "8"}
    modes = {m.key: m for m in bench.parse_modes("stock,store", "hidden-states")}
    store = bench.engine_spec(args, modes["store[hidden-states]"], tmp_path,
                              store=tmp_path / "s", run_id="r", max_waves=2)
    stock = bench.engine_spec(args, modes["stock"], tmp_path, store=tmp_path / "s",
                              run_id="r", max_waves=2)
    assert store["env"]["DMX_CH_WRITERS"] == "8"
    assert "DMX_CH_WRITERS" not in stock["env"]
    assert store["profile"]["seconds"] == 6
    assert store["profile"]["passes"] == ["cpu", "gil"]
    assert "torch_profile" not in store
    torch_args = bench.parse_args(["--out", str(tmp_path / "o.json"),
                                   "--torch-profile-steps", "32"])
    assert bench.bench_config(torch_args)["torch_profile_steps"] == 32
    profiled = bench.engine_spec(torch_args, modes["stock"], tmp_path, store=tmp_path / "s",
                                 run_id="r", max_waves=2)
    assert profiled["torch_profile"] == {"decode_steps": 32, "dir": f"{tmp_path / 's'}-torch"}
    for bad in (["--env", "CH_WRITERS=8"], ["--env", "DMX_CH_WRITERS=0"],
                ["--env", "DMX_DB_URL=none"], ["--profile-seconds", "-1"],
                ["--torch-profile-steps", "-1"], ["--torch-profile-steps", "128"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", str(tmp_path / "o.json"), *bad])


def test_breakdown_of_the_h200_evidence(bench: Any) -> None:
    data = json.loads((Path(__file__).resolve().parents[2] / "docs" / "evidence"
                       / "2026-11-29-h200-lease3" / "bench_serving.json").read_text())
    rows = {r["mode"]: r for r in bench.breakdown(data)}
    assert set(rows) == {"store[hidden-states]", "transport[hidden-states]",
                         "transport[sglang-full]"}
    full = rows["transport[sglang-full]"]
    # 55.36 GB for 16,384 output tokens at stock's 20,838 tok/s: ~70 GB/s, above 55 GB/s
    assert full["needed_bps_at_stock"] == pytest.approx(70.4e9, rel=0.01)
    assert full["d2h_bound_ratio"] == pytest.approx(0.78, abs=0.01)
    store = rows["store[hidden-states]"]
    assert store["d2h_bound_ratio"] is None
    assert store["store_writers"] == 2
    assert store["store_writer_busy"] == pytest.approx(0.98, abs=0.01)
    assert rows["transport[hidden-states]"]["stall_share"] == pytest.approx(0.108, abs=0.005)
    text = bench.render_breakdown(data)
    assert "transport[sglang-full]" in text
    assert "0.78" in text


def test_torch_profile_lines(bench: Any) -> None:
    gpu = {"span_us": 64_000.0, "gpu_busy_share": 0.62, "kernel_busy_share": 0.55,
           "gpu_idle_us": 24_320.0,
           "copies": [{"name": "Memcpy DtoH (Device -> Pinned)", "count": 64, "us": 3_200.0,
                       "bytes": 128_000_000, "hidden_share": 0.8, "gb_per_s": 40.0}],
           "kernels": [{"name": "gemm", "count": 1792, "us": 19_200.0}]}
    data = {"modes": {
        "transport[hidden-states]": {"torch_profile": {
            "decode_steps": 64, "graph_launches": 63, "gpu": gpu, "file": "x",
            "steps": {"DECODE": 63, "EXTEND": 1},
            "threads": [{"thread": "scheduler", "op_us": 30_000.0,
                         "top": [["seal", 9_000.0]]}]}},
        "stock": {"torch_profile": {"error": "RuntimeError('no trace')"}},
        "transport[sglang-full]": {"torch_profile": {
            "steps": {"DECODE": 64}, "file": "y",
            "gpu": {**gpu, "kernels_missing": True, "kernels": [], "copies": []}}},
        "store[hidden-states]": {}}}
    lines = bench.torch_profile_lines(data)
    assert lines[0] == ("transport[hidden-states] [torch] 64 ms, steps: 63 decode, 1 extend, "
                        "1.00 ms per step: GPU busy 62% (kernels 55%), waiting for the host "
                        "24 ms")
    assert "64 x, 3.2 ms, 40.0 GB/s, 80% under kernels" in lines[1]
    assert lines[2].endswith("top kernels (share of the span): gemm 30%")
    assert lines[3].endswith("host thread scheduler: operators 30 ms (seal 9.0 ms)")
    assert lines[4] == "stock [torch]: RuntimeError('no trace')"
    assert lines[5] == ("transport[sglang-full] [torch] 64 ms, steps: 64 decode: no kernels "
                        "recorded (CUPTI missed the graph kernels): shares unknown")
    assert len(lines) == 6
