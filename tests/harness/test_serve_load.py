"""``python -m harness serve-load`` on CPU: its command lines, the parsing of bench_serving's
result line, the checks and the summary, and (torch) the fake server of its dry run driven
through the same client code, its store read back directly."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness import serve_fake as fake
from harness import serve_load as sl
from harness.constants import SEED, TRITON_CACHE_DIR
from harness.results import REPO

RESULT_LINE = {  # the fields bench_serving 0.5.19 writes (sglang/benchmark/serving.py)
    "backend": "sglang", "dataset_name": "random-ids", "max_concurrency": 64,
    "random_input_len": 256, "random_output_len": 128, "random_range_ratio": 0.5,
    "duration": 12.5, "completed": 320, "total_input_tokens": 61000,
    "total_output_tokens": 30500, "request_throughput": 25.6, "input_throughput": 4880.0,
    "output_throughput": 2440.0, "total_throughput": 7320.0,
    "mean_e2e_latency_ms": 2400.0, "median_e2e_latency_ms": 2300.0,
    "p90_e2e_latency_ms": 3500.0, "p95_e2e_latency_ms": 3700.0, "p99_e2e_latency_ms": 4100.0,
    "mean_ttft_ms": 80.0, "median_ttft_ms": 60.0, "p90_ttft_ms": 150.0, "p95_ttft_ms": 180.0,
    "p99_ttft_ms": 260.0, "median_itl_ms": 20.0, "p90_itl_ms": 31.0, "p95_itl_ms": 35.0,
    "p99_itl_ms": 48.0, "mean_itl_ms": 22.0, "concurrency": 60.1}


def _needs_torch() -> None:
    if os.environ.get("CI", "").lower() != "true":  # under CI=true a missing torch fails
        pytest.importorskip("torch")


def _sglang_file(module: str) -> Path:
    """The source file of an SGLang module: skipped without SGLang (failed under CI=true)."""
    spec = importlib.util.find_spec(module) if importlib.util.find_spec("sglang") else None
    if spec is None or spec.origin is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("sglang==0.5.19 is required under CI=true")
        pytest.skip("sglang is not installed")
    return Path(spec.origin)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# -- command lines -----------------------------------------------------------------------------
def test_stock_and_monitored_servers_get_the_same_sglang_flags(tmp_path: Path) -> None:
    plan = sl.Plan(api_key="k3y", extra_flags=("--chunked-prefill-size", "2048"))
    stock = sl.stock_argv(plan, tmp_path, 4000, python="py")
    mon = sl.monitored_argv(plan, tmp_path, 4000, "hidden-states", store_url="chdb:///s",
                            run_id="r1", python="py")
    assert stock[:3] == ["py", "-m", "sglang.launch_server"]
    assert mon[:4] == ["py", "-m", "dmi_sglang", "serve"]
    assert sl.serve_own_flags(mon) == sl.serve_own_flags(stock)
    assert (_flag(mon, "--hooks"), _flag(mon, "--request-sample"), _flag(mon, "--run-id"),
            _flag(mon, "--db")) == ("hidden-states", "1", "r1", "chdb:///s")
    for flag in ("--hooks", "--request-sample", "--run-id", "--db"):
        assert flag not in stock
        assert flag not in sl.serve_own_flags(mon)
    assert _flag(stock, "--model-path") == str(tmp_path)
    assert _flag(stock, "--port") == "4000"
    assert _flag(stock, "--api-key") == "k3y"
    assert stock[-2:] == ["--chunked-prefill-size", "2048"]
    graphs = int(_flag(stock, "--cuda-graph-max-bs-decode"))
    assert graphs % 8 == 0
    assert graphs >= plan.max_concurrency + sl.CANCEL_WORKERS
    assert {"--disable-radix-cache", "--disable-prefill-cuda-graph"} <= set(stock)
    assert sl.masked(stock)[stock.index("--api-key") + 1] == "***"
    assert "k3y" not in json.dumps(plan.settings())
    assert "--api-key" not in sl.stock_argv(sl.Plan(), tmp_path, 1)


def test_the_bench_client_is_offline_streamed_concurrent_and_mixed(tmp_path: Path) -> None:
    plan = sl.Plan(num_prompts=300, input_len=200, output_len=100, range_ratio=0.25,
                   max_concurrency=64)
    argv = sl.bench_argv(plan, 4100, tmp_path / "tok", tmp_path / "out.jsonl",
                         ("py", "-m", "sglang.bench_serving"))
    assert argv[:3] == ["py", "-m", "sglang.bench_serving"]
    assert _flag(argv, "--dataset-name") == "random-ids"  # "random" downloads ShareGPT
    assert _flag(argv, "--backend") == "sglang"
    assert "--tokenize-prompt" in argv
    assert "--disable-stream" not in argv
    assert (_flag(argv, "--num-prompts"), _flag(argv, "--max-concurrency"),
            _flag(argv, "--random-input-len"), _flag(argv, "--random-output-len"),
            _flag(argv, "--random-range-ratio")) == ("300", "64", "200", "100", "0.25")
    assert _flag(argv, "--tokenizer") == str(tmp_path / "tok")
    assert _flag(argv, "--output-file") == str(tmp_path / "out.jsonl")
    assert _flag(argv, "--seed") == str(SEED)
    assert plan.cancel_requests == 30
    assert sl.Plan(num_prompts=3).cancel_requests == 1


def test_children_get_no_dmx_settings_and_no_stray_api_key() -> None:
    env = sl.child_env({"DMX_HOOK_SELECTION": "x", "OPENAI_API_KEY": "old", "PATH": "/bin",
                        "TRITON_CACHE_DIR": "/t"}, {"DMX_SGLANG_ENABLE": "0"})
    assert env == {"PATH": "/bin", "TRITON_CACHE_DIR": "/t", "PYTHONUNBUFFERED": "1",
                   "DMX_SGLANG_ENABLE": "0"}
    assert sl.child_env({})["TRITON_CACHE_DIR"] == TRITON_CACHE_DIR


def test_modes_are_separated_by_semicolons_and_checked() -> None:
    assert sl.parse_modes("resid_pre:last;hidden-states") == sl.DEFAULT_MODES
    assert sl.parse_modes(" hidden-states ; hidden-states;") == ("hidden-states",)
    assert sl.parse_modes("resid_pre:last,hidden-states") == ("resid_pre:last,hidden-states",)
    with pytest.raises(ValueError, match="no_such_hook"):
        sl.parse_modes("resid_pre:last;no_such_hook")
    with pytest.raises(ValueError, match="no mode"):
        sl.parse_modes(" ; ")


@pytest.mark.parametrize("argv", [["--num-prompts", "0"], ["--range-ratio", "1.5"],
                                  ["--modes", "bogus"], ["--model", "70b"]])
def test_bad_arguments_are_refused_before_any_work(argv: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sl.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_defaults_make_a_modest_mixed_load() -> None:
    _args, plan = sl.parse_args(["--api-key", "k", "--server-flags", "--foo 'a b'"])
    assert plan.modes == sl.DEFAULT_MODES
    assert 256 <= plan.num_prompts <= 384
    assert plan.max_concurrency >= 64
    assert 0 < plan.range_ratio < 1
    assert plan.extra_flags == ("--foo", "a b")
    assert plan.api_key == "k"


# -- prompts -----------------------------------------------------------------------------------
def test_the_subset_is_fixed_and_free_of_special_tokens() -> None:
    first, again = sl.subset_prompts(1024), sl.subset_prompts(1024)
    assert first == again
    assert [len(p) for p in first] == [sl.SUBSET_MIN_LEN + sl.SUBSET_LEN_STEP * i
                                       for i in range(sl.SUBSET_PROMPTS)]
    assert min(min(p) for p in first) >= 3
    assert max(max(p) for p in first) < 1024
    assert sl.subset_prompts(1024, seed=1) != first
    mixed = sl.mixed_prompts(1024, 50, 256, 7)
    assert len({len(p) for p in mixed}) > 10
    assert all(64 <= len(p) <= 256 for p in mixed)
    body = sl.generate_body([5, 6], "r", 9, stream=True)
    assert body == {"input_ids": [5, 6], "rid": "r", "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 9, "ignore_eos": True}}


# -- bench_serving's result ---------------------------------------------------------------------
def test_the_last_result_line_gives_the_figures() -> None:
    older = RESULT_LINE | {"completed": 1}
    text = json.dumps(older) + "\n" + json.dumps(RESULT_LINE) + "\n\n"
    figures = sl.bench_figures(sl.read_bench_line(text))
    assert figures["completed"] == 320
    assert figures["request_throughput"] == 25.6
    assert figures["output_tok_s"] == 2440.0
    assert figures["duration_s"] == 12.5
    assert figures["ttft_ms"] == {"p50": 60.0, "p90": 150.0, "p99": 260.0}
    assert figures["itl_ms"] == {"p50": 20.0, "p90": 31.0, "p99": 48.0}
    assert figures["e2e_ms"] == {"p50": 2300.0, "p90": 3500.0, "p99": 4100.0}
    with pytest.raises(ValueError, match="p99_itl_ms"):
        sl.bench_figures({k: v for k, v in RESULT_LINE.items() if k != "p99_itl_ms"})
    with pytest.raises(ValueError, match="no result line"):
        sl.read_bench_line("\n")


def test_the_fields_read_are_the_ones_bench_serving_writes() -> None:
    source = _sglang_file("sglang.benchmark.serving").read_text()
    fields = [*sl.RATES.values(), "completed", "duration",
              *(f for fs in sl.LATENCIES.values() for f in fs)]
    assert [f for f in fields if f'"{f}":' not in source] == []
    for flag in ("--tokenize-prompt", "--random-range-ratio", "--max-concurrency",
                 "--output-file", "--ready-check-timeout-sec", "--warmup-requests"):
        assert f'"{flag}"' in source, flag
    assert sl.BENCH_MAIN_MARK in source


PREFILL = ("[2026-12-02 08:35:52] Prefill batch, #new-seq: {n}, #new-token: {t}, "
           "#cached-token: 0, token usage: 0.01, #running-req: 60, #queue-req: {q}, "
           "#pending-token: 0, "
           "cuda graph: False, input throughput (token/s): 5000.00")
DECODE = ("[2026-12-02 08:35:53] Decode batch, #running-req: {r}, #token: 9000, "
          "token usage: 0.05, cuda graph: True, gen throughput (token/s): {g}, #queue-req: {q}")


def test_the_scheduler_log_says_how_often_it_prefilled_and_at_what_batch_it_decoded() -> None:
    text = "\n".join([
        "[2026-12-02 08:35:51] INFO: 127.0.0.1 - POST /generate 200",
        PREFILL.format(n=2, t=384, q=0), DECODE.format(r=64, g="1480.50", q=0),
        PREFILL.format(n=1, t=200, q=3), DECODE.format(r=62, g="1520.00", q=1),
        DECODE.format(r=40, g="900.00", q=0).replace("cuda graph: True", "cuda graph: False")])
    got = sl.scheduler_activity(text)
    assert got == {"prefill_batches": 2, "prefill_seqs": 3, "prefill_tokens": 584,
                   "decode_log_lines": 3, "decode_running_p50": 62.0,
                   "decode_running_max": 64.0,
                   "decode_gen_tok_s_p50": 1480.5, "decode_lines_eager": 1, "queued_max": 3.0}
    assert sl.scheduler_activity("no scheduler here")["prefill_batches"] == 0
    assert sl.scheduler_activity("")["decode_running_p50"] is None


def test_the_scheduler_fields_read_are_the_ones_sglang_logs() -> None:
    source = _sglang_file("sglang.srt.managers.scheduler_components.metrics_reporter").read_text()
    for text in ("Prefill batch", "Decode batch", "#new-seq: ", "#new-token: ",
                 "#running-req: ", "#queue-req: ", "gen throughput (token/s): ",
                 '"cuda graph")', "_graph_backend_label}: {can_run_cuda_graph}"):
        assert text in source, text


def test_ratios_are_monitored_over_stock() -> None:
    stock = sl.bench_figures(RESULT_LINE)
    slower = sl.bench_figures(RESULT_LINE | {"output_throughput": 1220.0, "p99_ttft_ms": 520.0})
    r = sl.ratios(stock, slower)
    assert r["output_tok_s"] == 0.5
    assert r["request_throughput"] == 1.0
    assert r["ttft_ms"] == {"p50": 1.0, "p90": 1.0, "p99": 2.0}
    assert sl.ratios(stock | {"request_throughput": 0.0}, slower)["request_throughput"] is None


# -- checks ------------------------------------------------------------------------------------
def test_bench_and_exit_checks() -> None:
    fig = sl.bench_figures(RESULT_LINE)
    assert sl.check_bench({"figures": fig}, 320)["ok"]
    assert not sl.check_bench({"figures": fig}, 321)["ok"]
    assert not sl.check_bench({"error": "crashed"}, 320)["ok"]
    assert not sl.check_bench(None, 320)["ok"]
    assert sl.check_exit({"killed": False, "exit_s": 3.0, "returncode": 0})["ok"]
    assert not sl.check_exit({"killed": True, "exit_s": 90.0})["ok"]
    assert not sl.check_exit(None)["ok"]


def test_token_identity_is_request_by_request() -> None:
    stock = [{"key": f"subset-{i}", "output_ids": [i, i + 1]} for i in range(3)]
    assert sl.check_tokens(stock, [dict(o) for o in stock])["ok"]
    diverged = [dict(o) for o in stock]
    diverged[1] = {"key": "subset-1", "output_ids": [1, 9]}
    check = sl.check_tokens(stock, diverged)
    assert not check["ok"]
    assert check["diverged"] == [{"key": "subset-1", "first_diff": 1}]
    assert not sl.check_tokens(stock, stock[:2])["ok"]
    assert not sl.check_tokens(None, stock)["ok"]
    assert not sl.check_tokens([], [])["ok"]


def test_status_stop_and_listing_checks() -> None:
    up = {"status": 200, "body": {"state": "capturing", "run_id": "r"}}
    assert sl.check_status(up, "r", ["r", "r"])["ok"]
    assert not sl.check_status(up, "other", [])["ok"]
    assert not sl.check_status(up, "r", ["r", None])["ok"]
    assert not sl.check_status({"status": 200, "body": {"state": "stopped", "run_id": "r"}},
                               "r", [])["ok"]
    assert not sl.check_status({"status": 401, "body": "no"}, "r", [])["ok"]
    assert sl.check_stop({"state": "stopped", "seconds": 0.1})["ok"]
    assert not sl.check_stop({"state": "stopping"})["ok"]
    for body in (["a", "b"], {"requests": [{"request_id": "a"}, {"request_id": "b"}]},
                 {"data": [{"id": "a"}, "b"]}):
        assert sl.listed_ids(body) == {"a", "b"}
    assert sl.listed_ids("garbage") == set()
    listing = {"status": 200, "body": {"requests": ["a", "b", "c"]}}
    check = sl.check_listing(listing, ["a", "b"], ["a", "b", "c"])
    assert check["ok"]
    assert check["equals_store_listing"]
    assert sl.check_listing(listing, ["a"], ["a"])["equals_store_listing"] is False
    assert not sl.check_listing(listing, ["a", "z"], None)["ok"]
    assert not sl.check_listing({"status": 404, "body": {}}, ["a"], None)["ok"]


def _direct(missing: dict[str, list[str]], stored: list[str]) -> dict[str, Any]:
    return {"missing": missing, "stored": stored, "run_status": "committed"}


def test_finished_requests_complete_and_cancelled_ones_not() -> None:
    cancels = [{"rid": "cancel-0", "outcome": "cancelled"},
               {"rid": "cancel-1", "outcome": "finished"},
               {"rid": "cancel-2", "outcome": "cancelled"}]
    stored = ["b1", "b2", "b3", "subset-0", "warmup-0", "cancel-0", "cancel-2"]
    missing: dict[str, list[str]] = {r: [] for r in stored} | {"cancel-0": ["not committed"],
                                         "cancel-1": ["no manifest"],
                                         "cancel-2": ["not committed"]}
    direct = _direct(missing, stored)
    known = ["subset-0", "warmup-0"]
    good = sl.check_complete(direct, cancels=cancels, known=known, bench_completed=3)
    assert good["ok"], good
    assert good["bench_stored"] == 3
    assert not sl.check_complete(direct, cancels=cancels, known=known,
                                 bench_completed=4)["ok"]
    assert not sl.check_complete(direct, cancels=cancels, known=known,
                                 bench_completed=None)["ok"]
    gap = _direct(missing | {"b2": ["resid_pre layer 0: positions [3, 5) missing"]}, stored)
    bad = sl.check_complete(gap, cancels=cancels, known=known, bench_completed=3)
    assert not bad["ok"]
    assert list(bad["incomplete_examples"]) == ["b2"]
    unread = sl.check_complete(direct, cancels=cancels, known=[*known, "subset-1"],
                               bench_completed=3)
    assert not unread["ok"]
    cancelled = sl.check_cancelled(direct, cancels)
    assert cancelled["ok"]
    assert cancelled["cancelled"] == 2
    assert cancelled["outcomes"] == {"cancelled": 2, "finished": 1}
    complete = sl.check_cancelled(_direct(missing | {"cancel-2": []}, stored), cancels)
    assert not complete["ok"]
    assert complete["read_complete_count"] == 1
    assert not sl.check_cancelled(direct, cancels[1:2])["ok"]  # nothing was cancelled
    ignored = sl.check_cancelled(direct, [*cancels, {"rid": "cancel-3",
                                                     "outcome": "abort_ignored"}])
    assert not ignored["ok"]  # an abort sent and not taken
    assert ignored["abort_ignored"] == 1
    assert sl.check_committed(direct)["ok"]
    assert not sl.check_committed({"run_status": "interrupted"})["ok"]
    assert not sl.check_committed({"error": "StoreError: locked"})["ok"]


def test_the_status_and_the_exit_code() -> None:
    ok = {"a": {"ok": True, "required": True}, "b": {"ok": False, "required": False}}
    assert sl.overall_status(ok, []) == "passed"
    assert sl.overall_status(ok, ["hidden-states"]) == "skipped"
    assert sl.overall_status(ok | {"c": {"ok": False, "required": True}}, ["x"]) == "failed"
    assert sl.overall_status({}, []) == "failed"
    assert [sl.EXIT_STATUS.get(s, 1) for s in ("passed", "skipped", "failed", "error")] == [
        0, 3, 1, 1]


def test_the_table_shows_figures_ratios_and_checks() -> None:
    stock = sl.bench_figures(RESULT_LINE)
    mode = sl.bench_figures(RESULT_LINE | {"output_throughput": 2196.0})
    rows = sl.table_rows({"stock": stock, "hidden-states": mode})
    assert rows[0]["ratios"] is None
    assert rows[1]["ratios"]["output_tok_s"] == pytest.approx(0.9)
    text = sl.render(rows, {"stock.bench_complete": {"ok": True, "required": True},
                            "hidden-states.readback_equal": {"ok": False, "required": True}})
    for shown in ("2440", "0.900", "60.0/150.0/260.0"):
        assert shown in text
    assert "PASS  stock.bench_complete" in text
    assert "FAIL  hidden-states.readback_equal" in text
    assert "x stock" not in sl.render(sl.table_rows({"hidden-states": mode}), {})


# -- readback (torch) ----------------------------------------------------------------------------
def _readback_case() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    import torch

    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(1, 4, dtype=torch.bfloat16)
    listing = {"complete": True, "missing": [], "tensors": [
        {"name": "resid_pre.0", "hook": "resid_pre", "layer": 0, "dtype": "float32",
         "shape": [3, 4], "positions": [0, 3, 1]},
        {"name": "resid_final", "hook": "resid_final", "layer": None,
         "dtype": "torch.bfloat16", "shape": [1, 4], "positions": [2, 3, 1]}]}
    http = {"r": {"status": 200, "safetensors_status": 200, "listing": listing}}
    tensors = {"r": {"resid_pre.0": a.clone(), "resid_final": b.clone()}}
    direct = {"tensors": {"r": {"resid_pre.0": a, "resid_final": b}},
              "positions": {"r": {"resid_pre.0": [0, 3, 1], "resid_final": [2, 3, 1]}},
              "errors": {}}
    return http, tensors, direct


@pytest.mark.torch
def test_readback_equal_only_when_every_tensor_matches() -> None:
    _needs_torch()
    http, tensors, direct = _readback_case()
    check = sl.check_readback(["r"], http, tensors, direct)
    assert check["ok"], check
    assert check["tensors_compared"] == 2

    def problems(**change: Any) -> list[str]:
        h, t, d = _readback_case()
        if "value" in change:
            t["r"]["resid_pre.0"][1, 2] += 1
        if "dtype" in change:
            t["r"]["resid_final"] = t["r"]["resid_final"].float()
        if "dropped" in change:
            del t["r"]["resid_final"]
        if "positions" in change:
            d["positions"]["r"]["resid_pre.0"] = [2, 3, 1]
        if "incomplete" in change:
            h["r"]["listing"]["complete"] = False
        if "status" in change:
            h["r"]["safetensors_status"] = 404
        if "unread" in change:
            del d["tensors"]["r"]["resid_pre.0"]
            d["errors"] = {"r": {"resid_pre.0": "IncompleteCaptureError: gap"}}
        got = sl.check_readback(["r"], h, t, d)
        assert not got["ok"]
        return list(got["problems"])

    assert any("values differ" in p for p in problems(value=True))
    assert any("dtype float32, listed torch.bfloat16" in p for p in problems(dtype=True))
    assert any("tensors listed" in p for p in problems(dropped=True))
    assert any("positions" in p for p in problems(positions=True))
    assert any("incomplete" in p for p in problems(incomplete=True))
    assert any("safetensors 404" in p for p in problems(status=True))
    assert any("IncompleteCaptureError" in p for p in problems(unread=True))
    assert not sl.check_readback(["r"], {}, {}, {})["ok"]


# -- process records -----------------------------------------------------------------------------
def test_leftover_groups_are_killed_only_when_still_ours(tmp_path: Path) -> None:
    sleeper = "import time; time.sleep(120)"
    ours = subprocess.Popen([sys.executable, "-c", sleeper, "harness.serve_fake"],
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)
    try:
        record = sl.GroupRecord(tmp_path / "groups")
        record.add(ours.pid)
        record.add(other.pid)
        record.remove(12345678)
        assert record.kill_leftovers() == [ours.pid]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
        assert (tmp_path / "groups").read_text() == ""
    finally:
        for proc in (ours, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- the dry run's fake server through the real client code (torch, chdb) -------------------------
@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": 64}))
    return path


def _fake(tmp_path: Path, model_dir: Path, argv: list[str], name: str) -> sl.Server:
    wrapped = [sys.executable, "-m", "harness.serve_fake", "fake-server", *argv[1:]]
    return sl.Server(name, wrapped, sl.child_env(os.environ), port=int(_flag(argv, "--port")),
                     log=tmp_path / f"{name}.log", api_key="key")


@pytest.mark.torch
def test_the_fake_server_speaks_the_api_the_benchmark_reads(tmp_path: Path,
                                                            model_dir: Path) -> None:
    _needs_torch()
    plan = sl.Plan(api_key="key")
    store = f"chdb://{tmp_path / 'store'}"
    argv = sl.monitored_argv(plan, model_dir, sl.free_port(), "resid_pre:last",
                             store_url=store, run_id="run-1")
    server = _fake(tmp_path, model_dir, argv, "fake")
    server.start(60.0)
    try:
        assert sl.Server("nokey", [], {}, port=server.port, log=tmp_path / "x",
                         api_key=None).call("GET", "/dmi/status").status == 401
        reply = server.call("POST", "/generate", sl.generate_body([5, 6, 7], "subset-0", 4))
        body = reply.json()
        assert reply.status == 200
        assert body["meta_info"]["id"] == "subset-0"
        assert body["output_ids"] == fake.fake_output_ids([5, 6, 7], 4, 64)
        assert reply.headers["x-dmi-run-id"] == "run-1"
        cut = sl.stream_and_close(server, sl.generate_body([5, 6], "cancel-0", 500,
                                                           stream=True), 3, 30.0)
        # aborted through /abort_request after 3 events; its last event says so
        assert (cut["outcome"], cut["finish"], cut["abort_status"]) == (
            "cancelled", "abort", 200)
        assert cut["events"] >= 3
        whole = sl.stream_and_close(server, sl.generate_body([5], "cancel-1", 2, stream=True),
                                    3, 30.0)
        assert (whole["outcome"], whole["finish"], whole["abort_status"]) == (
            "finished", "length", None)
        status = server.answer("GET", "/dmi/status")
        assert sl.check_status(status, "run-1", ["run-1"])["ok"]
        assert server.answer("POST", "/dmi/stop")["body"]["state"] == "stopped"
        listing = server.answer("GET", "/dmi/runs/run-1/requests/subset-0")["body"]
        blob = server.call("GET", "/dmi/runs/run-1/requests/subset-0/safetensors")
        assert sl.listed_ids(server.answer("GET", "/dmi/runs/run-1/requests")["body"]) == {
            "subset-0", "cancel-0", "cancel-1"}
    finally:
        stopped = server.stop(30.0)
    assert sl.check_exit(stopped)["ok"], server.tail()
    direct = sl.direct_read(store, "run-1", ["subset-0", "cancel-0"], {"subset-0": listing})
    assert sl.check_committed(direct)["ok"]
    http = {"subset-0": {"status": 200, "safetensors_status": blob.status, "listing": listing}}
    check = sl.check_readback(["subset-0"], http,
                              {"subset-0": sl.load_safetensors(blob.body)}, direct)
    assert check["ok"], check
    assert check["tensors_compared"] == fake.FAKE_LAYERS
    cancels = [cut, whole]
    assert sl.check_cancelled(direct, cancels)["ok"]
    assert sl.check_complete(direct, cancels=cancels, known=["subset-0"],
                             bench_completed=0)["ok"]
    tampered = {"subset-0": {k: v + 1 for k, v in sl.load_safetensors(blob.body).items()}}
    assert not sl.check_readback(["subset-0"], http, tampered, direct)["ok"]


def test_a_monitored_fake_refuses_an_incomplete_command_line(tmp_path: Path,
                                                            model_dir: Path) -> None:
    argv = sl.monitored_argv(sl.Plan(), model_dir, sl.free_port(), "hidden-states",
                             store_url="chdb:///s", run_id="r")
    argv[argv.index("--request-sample") + 1] = "0.5"
    done = subprocess.run([sys.executable, "-m", "harness.serve_fake", "fake-server",
                           *argv[1:]], capture_output=True, text=True, timeout=60,
                          check=False, cwd=REPO)
    assert done.returncode == 2
    assert "--request-sample 1" in done.stderr


# -- the whole dry run, with faults the checks must see -----------------------------------------
@pytest.mark.torch
@pytest.mark.sglang
def test_a_dry_run_with_faults_fails_exactly_the_checks_they_break(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _needs_torch()
    _sglang_file("sglang")
    monkeypatch.setenv(fake.FAKE_FAULT_ENV, "tokens,readback")
    out = tmp_path / "serve-load.json"
    code = sl.main(["--dry-run", "--out", str(out), "--work", str(tmp_path / "work"),
                    "--modes", "resid_pre:last", "--num-prompts", "8", "--max-concurrency",
                    "4", "--input-len", "32", "--output-len", "16", "--api-key", "s3cret",
                    "--export-gb", "0.00001"])
    data = json.loads(out.read_text())
    assert code == 1
    assert data["status"] == "failed"
    failed = sorted(k for k, c in data["checks"].items() if c["required"] and not c["ok"])
    assert failed == ["resid_pre:last.readback_equal", "resid_pre:last.token_identity"]
    assert any("values differ" in p
               for p in data["checks"]["resid_pre:last.readback_equal"]["problems"])
    # one cancel per bench (8 prompts: 10 % rounds up to 1), three benches (plain, export,
    # after), each with ids of its own, all checked
    assert data["checks"]["resid_pre:last.cancelled_incomplete"]["cancelled"] == 3
    assert data["checks"]["resid_pre:last.captures_complete"]["bench_stored"] >= 8
    assert set(data["figures"]["servers"]) == {"stock", "resid_pre:last"}
    assert data["figures"]["ratios"]["resid_pre:last"]["output_tok_s"] > 0
    export = data["servers"]["resid_pre:last"]["export"]
    (only,) = export["rounds"]
    # committed requests' files downloaded during the 2nd bench's main run (a short one
    # may end while the first file is still on its way: it then counts apart)
    # (how many files fit in the bench's main run depends on the machine's load: a loaded
    # one ended it with its first file of 6.7 kB on its way, under the 10 kB asked for)
    assert only["files"] >= 1 or only["bytes_after_stop"] > 0
    assert only["bytes"] + only["bytes_after_stop"] > 0
    assert (export["bytes"], export["files"]) == (only["bytes"], only["files"])
    assert len({c["rid"] for c in export["cancels"]}) == 2
    assert export["errors"] == 0
    assert export["throughput_ratio"] == only["throughput_ratio"] > 0
    assert export["cost_spread"] == 0
    assert only["after"]["completed"] == 8  # the plain bench after the export's
    assert len(only["plain_request_throughputs"]) == 2
    assert "s3cret" not in out.read_text()
    assert "FAIL  resid_pre:last.token_identity" in capsys.readouterr().out


def test_each_export_round_is_bracketed_by_the_plain_benches_on_either_side() -> None:
    """Round n's export bench against the plain bench before it (the mode's own bench
    for the first round, the previous round's plain bench after) and the one after it."""
    def bench(rate: float, *, exported: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {"figures": {"request_throughput": rate},
                               "cancels": [{"rid": f"c-{rate}"}], "cpu_seconds": {"p": 1.0}}
        if exported:
            out["export"] = {"bytes": exported, "files": 2}
        return out

    first = sl._export_round(bench(30.0, exported=700), {"request_throughput": 40.0},
                             bench(20.0))
    assert first["throughput_ratio"] == pytest.approx(1.0)  # 30 / mean(40, 20)
    assert first["plain_request_throughputs"] == [40.0, 20.0]
    assert (first["bytes"], first["files"]) == (700, 2)
    assert [c["rid"] for c in first["cancels"]] == ["c-30.0", "c-20.0"]
    second = sl._export_round(bench(15.0), first["after"], bench(40.0))
    assert second["plain_request_throughputs"] == [20.0, 40.0]
    assert second["cost"] == pytest.approx(0.5)
    assert sl._export_round(bench(15.0), None, bench(40.0))["throughput_ratio"] is None


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_export_rounds_below_one_are_refused(rounds: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sl.parse_args(["--export-gb", "1", "--export-rounds", rounds])
    assert exc.value.code == 2
    assert f"--export-rounds {rounds}: expected >= 1" in capsys.readouterr().err


def test_past_the_deadline_nothing_starts_and_every_mode_is_skipped(tmp_path: Path) -> None:
    from harness.results import Deadline

    load = sl.ServeLoad(sl.Plan(), tmp_path, Deadline(budget_s=sl.RESERVE_S / 2), None)
    load.model_dir = tmp_path
    started = time.monotonic()
    data, skipped = load.run()
    assert time.monotonic() - started < 10
    assert skipped == list(sl.DEFAULT_MODES)
    assert "deadline" in data["checks"]["stock.ran"]["error"]
    assert not data["checks"]["stock.ran"]["ok"]
    assert data["skipped_modes"] == skipped
    assert not list(tmp_path.glob("server-*.log"))  # no server was started
    load.mode_s = 100.0
    assert load.mode_estimate() == pytest.approx(120.0)


KEY = "S3CRET-key"


def test_a_result_records_its_command_without_the_api_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.results import result

    monkeypatch.setattr(sys, "argv", ["/repo/harness/__main__.py", "serve-load",
                                      "--api-key", KEY, "--db", f"http://u:{KEY}@h/db",
                                      "--modes", "resid_pre@0-3"])
    recorded = json.dumps(result("serve-load", "serve-load", {}))
    assert KEY not in recorded
    assert "resid_pre@0-3" in recorded  # a hook selection is not a URL


@pytest.mark.parametrize("flags", [("--admin-api-key", KEY), ("--api-key", KEY),
                                   (f"--api-key={KEY}",), (f"--admin-api-key={KEY}",)])
def test_no_form_of_a_server_key_reaches_the_settings_or_the_argv(
        flags: tuple[str, ...]) -> None:
    assert KEY not in json.dumps(sl.Plan(extra_flags=flags).settings())
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m", *flags]
    assert KEY not in " ".join(sl.masked(argv))


@pytest.mark.parametrize("words", [["--server-flags", f"--api-key {KEY}"],
                                   ["--server-flags", f"--admin-api-key {KEY} --tp 1"],
                                   [f"--server-flags=--admin-api-key={KEY}"],
                                   ["--server-flags", f"--api-key '{KEY}"]])
def test_a_key_inside_one_argument_of_several_words_is_hidden_too(
        words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--server-flags`` is the only way to pass ``--admin-api-key`` to the servers."""
    from harness.results import result

    monkeypatch.setattr(sys, "argv", ["/repo/harness/__main__.py", "serve-load", *words])
    recorded = json.dumps(result("serve-load", "serve-load", {}))
    assert KEY not in recorded
    assert "--server-flags" in recorded


def test_an_abbreviated_key_flag_is_refused_not_recorded(
        capsys: pytest.CaptureFixture[str]) -> None:
    """argparse took ``--api KEY`` for ``--api-key`` and the result recorded the key."""
    with pytest.raises(SystemExit) as exc:
        sl.parse_args(["--api", KEY])
    assert exc.value.code == 2
    assert KEY not in capsys.readouterr().out


@pytest.mark.parametrize("gb", ["inf", "nan"])
def test_a_non_finite_export_size_is_refused_before_any_work(gb: str) -> None:
    """``inf`` crashed every monitored server's run at ``int(inf * 1e9)`` after its load
    was measured; ``nan`` ran no export and wrote NaN (not JSON) into the settings."""
    with pytest.raises(SystemExit) as exc:
        sl.parse_args(["--export-gb", gb])
    assert exc.value.code == 2


# -- the checks of a monitored server, on a scenario where every one passes ----------------------
SUBSET = ["subset-0", "subset-1"]
PROMPTS = 8


def _bench(completed: int, cancel: str, *, exported: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"figures": {"completed": completed, "request_throughput": 10.0},
                           "cancels": [{"rid": cancel, "outcome": "cancelled"}],
                           "cpu_seconds": {}}
    if exported:
        out["export"] = {"bytes": exported, "files": 1, "errors": 0, "bytes_after_stop": 0}
    return out


def _checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, bench_stored: int,
             export: tuple[int, int] | None = None) -> dict[str, Any]:
    """``check_mode`` of a monitored server whose main bench completed :data:`PROMPTS`
    requests; ``export``: one round whose export bench and plain bench completed that many;
    ``bench_stored``: bench requests the store holds (bench_serving's warm-ups included)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save

    run_id = "run-1"
    tensors = {rid: torch.arange(4, dtype=torch.float32).reshape(2, 2) + i
               for i, rid in enumerate(SUBSET)}
    subset = [{"key": rid, "id": rid, "output_ids": [5, 6, 7], "run_id_header": run_id}
              for rid in SUBSET]
    stock = sl.ServerRun("stock", None, subset=[dict(o) for o in subset])
    run = sl.ServerRun("resid_pre:last", "resid_pre:last", subset=subset)
    main = _bench(PROMPTS, "cancel-m-00000")
    run.detail = {"run_id": run_id, "warmup": {"ids": ["warmup-0"]}, "bench": main, "http": {},
                  "exit": {"exit_s": 1.0, "returncode": 0, "killed": False, "leftover": False,
                           "exited_before_stop": False}}
    run.figures = main["figures"]
    cancels = [main["cancels"][0]["rid"]]
    if export is not None:
        rnd = sl._export_round(_bench(export[0], "cancel-e-00000", exported=100),
                               run.figures, _bench(export[1], "cancel-a-00000"))
        run.detail["export"] = {"rounds": [rnd], "cancels": rnd["cancels"]}
        cancels += [c["rid"] for c in rnd["cancels"]]
    meta = [{"name": "resid_pre.0", "hook": "resid_pre", "layer": 0, "dtype": "float32",
             "shape": [2, 2], "positions": [0, 2, 1]}]
    requests = {}
    for rid in SUBSET:
        file = tmp_path / f"{rid}.st"
        file.write_bytes(save({"resid_pre.0": tensors[rid]}))
        requests[rid] = {"status": 200, "safetensors_status": 200, "file": str(file),
                         "fetched": "before stop", "bytes": file.stat().st_size,
                         "listing": {"complete": True, "missing": [], "tensors": meta}}
    stored = [*SUBSET, "warmup-0", *(f"bench-{i}" for i in range(bench_stored)), *cancels]
    direct = {"run_status": "committed", "stored": stored,
              "missing": {r: [] for r in stored} | {c: ["not committed"] for c in cancels},
              "tensors": {rid: {"resid_pre.0": tensors[rid]} for rid in SUBSET},
              "positions": {rid: {"resid_pre.0": [0, 2, 1]} for rid in SUBSET},
              "errors": {}, "read_s": 0.0}
    monkeypatch.setattr(sl, "direct_read", lambda *_a, **_k: direct)
    web = {"status": {"status": 200, "body": {"state": "capturing", "run_id": run_id}},
           "stop": {"state": "stopped"}, "before_stop": dict.fromkeys(SUBSET, True),
           "list": {"status": 200, "ids": sorted(stored), "body_head": ""},
           "requests": requests}
    load = sl.ServeLoad(sl.Plan(num_prompts=PROMPTS), tmp_path, sl.Deadline(), None)
    load.check_mode(run, stock, web, "chdb:///unused")
    return run.checks


def test_the_checks_scenario_passes_when_every_bench_request_is_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _checked(tmp_path, monkeypatch, bench_stored=PROMPTS + 1)
    assert sl.overall_status(checks, []) == "passed", checks
    checks = _checked(tmp_path, monkeypatch, bench_stored=3 * (PROMPTS + 1),
                      export=(PROMPTS, PROMPTS))
    assert sl.overall_status(checks, []) == "passed", checks


@pytest.mark.parametrize(("stored", "export"), [(PROMPTS, None),
                                                (PROMPTS + 1, (PROMPTS, PROMPTS))],
                         ids=["warm-up-stands-in", "export-benches-uncounted"])
def test_every_bench_request_must_be_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: int,
        export: tuple[int, int] | None) -> None:
    """Each bench stores its completed requests and bench_serving's own warm-up: the check
    once asked only for the main bench's count, so bench_serving's warm-up stood in for a
    missing request, and an export round's two benches (18 requests here) went unchecked."""
    checks = _checked(tmp_path, monkeypatch, bench_stored=stored, export=export)
    assert not checks["captures_complete"]["ok"], checks["captures_complete"]


def test_a_failed_request_of_an_export_bench_fails_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _checked(tmp_path, monkeypatch, bench_stored=40, export=(PROMPTS - 3, PROMPTS))
    assert not checks["export_benches_complete"]["ok"]
    assert sl.overall_status(checks, []) == "failed"


def test_a_cancelling_client_request_that_finished_must_read_complete() -> None:
    """``finished``: its stream ended before the abort was sent; it was not cancelled."""
    stored = ["b-0", "cancel-0", "cancel-1"]
    direct = {"run_status": "committed", "stored": stored,
              "missing": {"b-0": [], "cancel-0": ["not committed"],
                          "cancel-1": ["resid_pre layer 0: positions [0, 40) missing"]}}
    cancels = [{"rid": "cancel-0", "outcome": "cancelled"},
               {"rid": "cancel-1", "outcome": "finished"}]
    assert not sl.check_complete(direct, cancels=cancels, known=[], bench_completed=1)["ok"]


@pytest.mark.parametrize(("exit_", "ok"), [
    ({"exit_s": 1.0, "returncode": 0, "killed": False, "exited_before_stop": False}, True),
    ({"exit_s": 0.0, "returncode": 1, "killed": False, "exited_before_stop": True}, False),
    ({"exit_s": 1.0, "returncode": 4, "killed": False, "exited_before_stop": False}, False),
], ids=["clean", "died-before-the-sigint", "stop-not-durable"])
def test_the_exit_check_needs_a_server_that_ran_until_the_sigint_and_exited_0(
        exit_: dict[str, Any], ok: bool) -> None:
    assert sl.check_exit(exit_)["ok"] is ok


def test_stop_reports_a_server_that_was_gone_before_its_sigint(tmp_path: Path) -> None:
    server = sl.Server("s", [], {}, port=0, log=tmp_path / "log", api_key=None)
    server.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"],
                                   start_new_session=True)
    server.proc.wait(timeout=30)
    stopped = server.stop(2.0)
    assert stopped["exited_before_stop"] is True
    assert not sl.check_exit(stopped)["ok"]
