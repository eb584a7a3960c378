"""Load the GPU tools (scripts, not packages) by path for their CPU-side tests.

``tests/gpu/qualify.py`` and ``bench/bench_serving.py`` put ``tests/gpu`` on ``sys.path``
and import ``engine_proc`` from there; the fixtures here load them the same way. Nothing
here starts an engine or needs a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"


def load(name: str, path: Path) -> ModuleType:
    """Import ``path`` as module ``name`` (cached in ``sys.modules``)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ep() -> Any:
    """tests/gpu/engine_proc.py."""
    return load("engine_proc", GPU / "engine_proc.py")


@pytest.fixture(scope="session")
def qualify(ep: Any) -> Any:
    """tests/gpu/qualify.py."""
    return load("qualify", GPU / "qualify.py")


@pytest.fixture(scope="session")
def run_engine() -> Any:
    """tests/gpu/run_engine.py."""
    return load("run_engine", GPU / "run_engine.py")


@pytest.fixture(scope="session")
def bench(ep: Any) -> Any:
    """bench/bench_serving.py."""
    return load("bench_serving", ROOT / "bench" / "bench_serving.py")


@pytest.fixture(scope="session")
def docs_tables() -> Any:
    """scripts/make_docs_tables.py."""
    return load("make_docs_tables", ROOT / "scripts" / "make_docs_tables.py")


class FakeEngines:
    """Stands in for ``engine_proc.launch``: results computed from the spec, no engine.

    Output ids are a function of the prompt ids and lengths only, so stock, monitored and
    ``again-*`` runs agree unless ``diverge`` names a request id. Monitored runs report
    ``dmi.stopped`` / ``store.closed`` statistics equal to the expected capture; the
    ``read_back`` method answers like a complete store for such a run.
    """

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail: set[str] = set()
        self.diverge: set[str] = set()
        self.specs: dict[str, dict[str, Any]] = {}
        self.clock: Any = None
        self.seconds_per_engine = 0.0

    def model_of(self, spec: dict[str, Any]) -> Any:
        name = Path(spec["engine"]["model_path"]).name
        return next(m for m in self.ep.MODELS.values() if m.name == name)

    def __call__(self, spec: dict[str, Any], workdir: Path, name: str,
                 timeout_s: float) -> dict[str, Any]:
        self.calls.append((name, spec))
        if self.clock is not None:
            self.clock.now += self.seconds_per_engine
        if name in self.fail:
            return {"ok": False, "error": "RuntimeError: boom", "log_tail": "boom"}
        monitored = bool(spec.get("monitored"))
        outputs, workloads, reqs = [], [], []
        for wl in spec["workloads"]:
            min_s, max_waves = float(wl.get("min_seconds") or 0), int(wl.get("max_waves") or 1)
            repeat = min_s > 0 or max_waves > 1
            waves = min(max_waves, 3) if min_s > 0 else max_waves
            entry = {"name": wl["name"], "timed": wl.get("timed", True), "waves": waves,
                     "seconds": 0.5 * waves, "wave_seconds": [0.5] * waves, "requests": 0,
                     "prompt_tokens": 0, "output_tokens": 0, "hidden_state_numbers": 0}
            for wave in range(waves):
                for i, ids in enumerate(wl["input_ids"]):
                    rid = wl["rids"][i] + (f".w{wave}" if repeat else "")
                    n = wl["sampling_params"][i]["max_new_tokens"]
                    out = [(sum(ids) + j) % 1000 for j in range(n)]
                    if monitored and rid in self.diverge:
                        out[-1] += 1
                    entry["requests"] += 1
                    entry["prompt_tokens"] += len(ids)
                    entry["output_tokens"] += n
                    if wl.get("return_hidden_states"):
                        entry["hidden_state_numbers"] += (len(ids) + n - 1) * 8
                    reqs.append((len(ids), n))
                    if wl.get("keep_outputs", True):
                        outputs.append({"id": rid, "output_ids": out, "prompt_tokens": len(ids),
                                        "completion_tokens": n, "workload": wl["name"],
                                        "text": None, "num_retractions": 0})
            workloads.append(entry)
        timed = [w for w in workloads if w["timed"]]
        result: dict[str, Any] = {
            "ok": True, "startup_s": 12.0, "workloads": workloads, "outputs": outputs,
            "generate_s": sum(w["seconds"] for w in timed),
            "durable_s": sum(w["seconds"] for w in timed) + (0.25 if monitored else 0.0),
            "stop_s": 0.25 if monitored else 0.0,
            "output_tokens": sum(w["output_tokens"] for w in timed),
            "env_info": {"sglang": "0.5.19"}, "events": {}, "log": str(workdir / name),
            "wall_s": 20.0, "timed_out": False, "leftover_processes": False,
        }
        if monitored:
            env = spec["env"]
            run_id = env["DMX_MODEL_ID"]
            result["run_id"] = run_id
            overlap = not spec["engine"].get("disable_overlap_schedule")
            exp = self.ep.expected_capture(env["DMX_HOOK_SELECTION"], self.model_of(spec),
                                           [(p, c, overlap) for p, c in reqs])
            result["events"]["dmi.stopped"] = {"rows": exp.rows, "bytes": exp.bytes,
                                               "forced_eager": 0, "stalls": 0,
                                               "run_id": run_id}
            if env["DMX_DB_URL"] != "none":
                result["events"]["store.closed"] = {"bytes_stored": exp.bytes,
                                                    "insert_seconds": 2.0}
            self.specs[run_id] = {"spec": spec, "overlap": overlap}
        return result

    def read_back(self, store: Path, run_id: str, outputs: Any) -> dict[str, Any]:
        known = self.specs[run_id]
        spec = known["spec"]
        manifests = {o["id"]: [o["prompt_tokens"], o["completion_tokens"], known["overlap"], 0]
                     for o in outputs}
        exp = self.ep.expected_capture(spec["env"]["DMX_HOOK_SELECTION"], self.model_of(spec),
                                       [(m[0], m[1], m[2]) for m in manifests.values()])
        return {"run_status": "committed", "incomplete": {}, "manifests": manifests,
                "store_requests": sorted(manifests),
                "hook_totals": {a: [1, 1, v[0], v[1]] for a, v in exp.by_act.items()},
                "read_s": 0.01}


class FakeClock:
    """A settable ``time.time``."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engines(ep: Any) -> FakeEngines:
    """A fresh fake launcher."""
    return FakeEngines(ep)


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at a fixed epoch."""
    return FakeClock()
