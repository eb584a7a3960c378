"""run_engine.py's workload loop on a fake engine (the legacy single-generate spec too)."""

from __future__ import annotations

from typing import Any

import pytest


class FakeEngine:
    """Returns one output per request; records RPCs."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.rpcs: list[str] = []
        self.fail_on = fail_on

    def generate(self, **kw: Any) -> list[dict[str, Any]]:
        self.calls.append(kw)
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise RuntimeError("scheduler died")
        prompts = kw.get("input_ids") or kw.get("prompt")
        params = kw["sampling_params"]
        outs = []
        for i, p in enumerate(prompts):
            sp = params[i] if isinstance(params, list) else params
            n = sp["max_new_tokens"]
            meta = {"id": kw["rid"][i] if kw.get("rid") else f"auto{i}",
                    "prompt_tokens": len(p) if isinstance(p, list) else len(p.split()),
                    "completion_tokens": n, "num_retractions": 0}
            if kw.get("return_hidden_states"):
                meta["hidden_states"] = [[[0.0] * 4] * meta["prompt_tokens"]] + \
                    [[0.0] * 4] * (n - 1)
            outs.append({"output_ids": list(range(n)), "meta_info": meta, "text": None})
        return outs

    def collective_rpc(self, method: str, **kw: Any) -> None:
        self.rpcs.append(method)


class Clock:
    def __init__(self, step: float) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_legacy_spec(run_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMX_MODEL_ID", "run-1")
    eng = FakeEngine()
    spec = {"prompts": ["w1 w2", "w3"], "rids": ["a", "b"], "monitored": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    result: dict[str, Any] = {}
    run_engine.execute(eng, spec, result)
    assert eng.calls[0]["prompt"] == ["w1 w2", "w3"]
    assert eng.calls[0]["rid"] == ["a", "b"]
    assert eng.rpcs == ["dmi_stop_monitoring"]
    assert result["run_id"] == "run-1"
    assert [o["id"] for o in result["outputs"]] == ["a", "b"]
    assert result["outputs"][0]["output_ids"] == [0, 1, 2]
    assert result["outputs"][0]["prompt_tokens"] == 2
    assert result["generate_s"] >= 0
    assert result["durable_s"] >= result["generate_s"]


def test_workloads_waves_and_hidden_states(run_engine: Any) -> None:
    eng = FakeEngine()
    spec = {"workloads": [
        {"name": "warmup", "input_ids": [[1, 2]], "rids": ["warm-0"], "timed": False,
         "sampling_params": [{"max_new_tokens": 2}]},
        {"name": "main", "input_ids": [[1, 2, 3], [4]], "rids": ["main-0", "main-1"],
         "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 4}],
         "min_seconds": 2.5, "max_waves": 100, "return_hidden_states": True,
         "keep_outputs": False},
    ], "monitored": False}
    result: dict[str, Any] = {}
    run_engine.execute(eng, spec, result, clock=Clock(0.5))
    warm, main = result["workloads"]
    assert not warm["timed"]
    assert warm["waves"] == 1
    # each generate takes 0.5 s on this clock: 5 waves reach 2.5 s
    assert main["waves"] == 5
    assert main["seconds"] == pytest.approx(2.5)
    assert [c["rid"] for c in eng.calls[1:3]] == [["main-0.w0", "main-1.w0"],
                                                  ["main-0.w1", "main-1.w1"]]
    assert all(c.get("return_hidden_states") for c in eng.calls[1:])
    assert main["output_tokens"] == 5 * 8
    assert main["hidden_state_numbers"] == 5 * ((3 + 3) * 4 + (1 + 3) * 4)
    assert result["outputs"] == [{"id": "warm-0", "output_ids": [0, 1], "prompt_tokens": 2,
                                  "completion_tokens": 2, "text": None,
                                  "num_retractions": 0, "workload": "warmup"}]
    assert result["output_tokens"] == main["output_tokens"]
    assert result["generate_s"] == pytest.approx(2.5)
    assert eng.rpcs == []


def test_max_waves_bounds_the_loop(run_engine: Any) -> None:
    wl = {"name": "w", "input_ids": [[1]], "rids": ["w-0"], "max_waves": 3,
          "sampling_params": [{"max_new_tokens": 2}]}
    assert run_engine.run_workload(FakeEngine(), wl, Clock(0.1))["waves"] == 3
    wl["min_seconds"] = 1000.0
    assert run_engine.run_workload(FakeEngine(), wl, Clock(0.1))["waves"] == 3


def test_failure_keeps_what_was_measured(run_engine: Any) -> None:
    eng = FakeEngine(fail_on=2)
    spec = {"workloads": [
        {"name": f"w{i}", "input_ids": [[1]], "rids": [f"w{i}-0"],
         "sampling_params": [{"max_new_tokens": 2}]} for i in range(3)]}
    result: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="scheduler died"):
        run_engine.execute(eng, spec, result)
    assert [w["name"] for w in result["workloads"]] == ["w0"]


def test_count_numbers(run_engine: Any) -> None:
    assert run_engine._count_numbers(None) == 0
    assert run_engine._count_numbers([[1.0, 2.0], [[3.0], [4.0, 5.0]]]) == 5
