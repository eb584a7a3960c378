"""tests/gpu/torch_trace.py: the digest of a torch profiler trace, and run_engine's use
of SGLang's profiler (a fake engine; no GPU)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import GPU, load  # type: ignore[import-not-found]


@pytest.fixture(scope="module")
def torch_trace() -> Any:
    return load("torch_trace", GPU / "torch_trace.py")


def _x(cat: str, name: str, ts: float, dur: float, pid: Any, tid: Any,
       **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": args}


TRACE = {"traceEvents": [
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 100, "args": {"name": "scheduler"}},
    _x("kernel", "gemm", 1000, 10, 0, 7),
    _x("kernel", "rmsnorm", 1020, 10, 0, 7),
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1005, 10, 0, 20, bytes=1000),
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1040, 10, 0, 20, bytes=2000),
    _x("cuda_runtime", "cudaGraphLaunch", 990, 2, 1, 100),
    _x("cuda_runtime", "cudaGraphLaunch_v10000", 1015, 2, 1, 100),
    _x("cuda_driver", "cuLaunchKernelEx", 1030, 1, 1, 100),
    _x("user_annotation", "step[DECODE bs=64]", 985, 30, 1, 100),
    _x("user_annotation", "step[DECODE bs=64]", 1015, 30, 1, 100),
    _x("user_annotation", "step[EXTEND bs=1 toks=300]", 1046, 3, 1, 100),
    _x("gpu_user_annotation", "step[DECODE bs=64]", 1000, 30, 0, 7),
    _x("cuda_runtime", "cudaStreamSynchronize", 1016, 20, 1, 100),
    _x("cpu_op", "seal", 1000, 10, 1, 100),
    _x("cpu_op", "aten::copy_", 1002, 3, 1, 100),  # nested in seal: not counted twice
    _x("cpu_op", "forward", 1012, 2, 1, 100),
    _x("cpu_op", "aten::copy_", 1001, 4, 1, 200),
]}


def test_digest_of_a_known_trace(torch_trace: Any, tmp_path: Path) -> None:
    path = tmp_path / "dmi-TP-0-DECODE.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(TRACE).encode()))
    d = torch_trace.summarize_trace(path)
    gpu = d["gpu"]
    assert gpu["span_us"] == 50  # first GPU event at 1000, last ends at 1050
    assert gpu["kernels_missing"] is False
    assert gpu["gpu_busy_share"] == pytest.approx(35 / 50)  # [0,15) [20,30) [40,50)
    assert gpu["kernel_busy_share"] == pytest.approx(20 / 50)
    assert gpu["gpu_idle_us"] == pytest.approx(15)
    (copy,) = gpu["copies"]
    assert (copy["count"], copy["us"], copy["bytes"]) == (2, 20, 3000)
    assert copy["hidden_share"] == pytest.approx(5 / 20)  # [5,10) ran under gemm
    assert copy["gb_per_s"] == pytest.approx(3000 / 20 / 1e3)
    assert [k["name"] for k in gpu["kernels"]] == ["gemm", "rmsnorm"]
    assert [s["stream"] for s in gpu["streams"]] == ["0/7", "0/20"]
    assert d["graph_launches"] == 2
    assert d["steps"] == {"DECODE": 2, "EXTEND": 1}  # host step spans only
    assert d["runtime"][0] == {"name": "cudaStreamSynchronize", "count": 1, "us": 20}
    assert {"name": "cuLaunchKernelEx", "count": 1, "us": 1} in d["runtime"]
    sched = next(t for t in d["threads"] if t["thread"] == "scheduler")
    assert sched["op_us"] == 12
    assert sched["top"] == [["seal", 10], ["forward", 2]]
    assert any(t["thread"] == "1/200" for t in d["threads"])


def test_graph_launches_without_kernels_are_flagged(torch_trace: Any, tmp_path: Path) -> None:
    events = [e for e in TRACE["traceEvents"] if e.get("cat") != "kernel"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    d = torch_trace.summarize_trace(path)
    assert d["graph_launches"] == 2
    assert d["gpu"]["kernels_missing"] is True


def test_interval_helpers(torch_trace: Any) -> None:
    m = torch_trace.merged([(5, 7), (0, 2), (1, 3), (7, 8)])
    assert m == [(0, 3), (5, 8)]
    assert torch_trace.covered(m) == 6
    assert torch_trace.overlap(m, [(2, 6), (7.5, 20)]) == pytest.approx(1 + 1 + 0.5)


def test_a_real_cpu_profile_is_read(torch_trace: Any, tmp_path: Path) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a = torch.ones(64, 64)
        for _ in range(5):
            a = torch.mm(a, a) / 64
    path = tmp_path / "cpu.trace.json"
    prof.export_chrome_trace(str(path))
    d = torch_trace.summarize_trace(path)
    assert d["gpu"] is None
    names = {n for t in d["threads"] for n, _ in t["top"]}
    assert "aten::mm" in names or "aten::div" in names


class ProfilingEngine:
    """Records profiler calls and writes traces as SGLang 0.5.19 names them. ``stage``:
    the name the decode trace gets (SGLang writes a decode profile that a prefill count
    ends as ``EXTEND``), or None when the profile is still running at the end."""

    def __init__(self, stage: str | None) -> None:
        self.stage = stage
        self.started: dict[str, Any] = {}
        self.stops = 0

    def start_profile(self, **kw: Any) -> None:
        self.started = kw
        out = Path(kw["output_dir"])
        assert not list(out.iterdir())  # an earlier run's traces were removed
        if self.stage is not None:
            (out / f"dmi-TP-0-{self.stage}.trace.json.gz").write_bytes(
                gzip.compress(json.dumps(TRACE).encode()))

    def stop_profile(self) -> None:
        self.stops += 1
        if self.stage is not None:  # SGLang: the stage profile already stopped itself
            raise RuntimeError("Profiling is not in progress. Call /start_profile first.")
        (Path(self.started["output_dir"]) / "dmi-TP-0.trace.json.gz").write_bytes(
            gzip.compress(json.dumps(TRACE).encode()))

    def generate(self, **kw: Any) -> list[dict[str, Any]]:
        return [{"output_ids": [1, 2], "text": None,
                 "meta_info": {"id": r, "prompt_tokens": 1, "completion_tokens": 2}}
                for r in kw["rid"]]


@pytest.mark.parametrize(("stage", "file", "stops"), [
    ("DECODE", "dmi-TP-0-DECODE.trace.json.gz", 0),
    ("EXTEND", "dmi-TP-0-EXTEND.trace.json.gz", 1),  # stop raises: the trace is read anyway
    (None, "dmi-TP-0.trace.json.gz", 1),  # still running: stopped, then read
])
def test_run_engine_profiles_the_timed_decode_steps(run_engine: Any, tmp_path: Path,
                                                    stage: str | None, file: str,
                                                    stops: int) -> None:
    directory = tmp_path / "torch"
    directory.mkdir()
    (directory / "old-TP-0-DECODE.trace.json.gz").write_bytes(b"an earlier run's trace")
    eng = ProfilingEngine(stage)
    spec = {"workloads": [
        {"name": "warm", "timed": False, "input_ids": [[1]], "rids": ["w"],
         "sampling_params": {"max_new_tokens": 2}},
        {"name": "main", "input_ids": [[1]], "rids": ["m"],
         "sampling_params": {"max_new_tokens": 2}}],
        "torch_profile": {"decode_steps": 16, "dir": str(directory)}}
    result: dict[str, Any] = {}
    run_engine.execute(eng, spec, result)
    assert eng.started["num_steps"] == 16
    assert eng.started["profile_by_stage"] is True
    assert eng.started["with_stack"] is False
    digest = result["torch_profile"]
    assert digest["decode_steps"] == 16
    assert digest["gpu"]["span_us"] == 50
    assert eng.stops == stops
    assert digest["file"] == file
    assert (digest["stop_error"] is not None) == (stage == "EXTEND")
