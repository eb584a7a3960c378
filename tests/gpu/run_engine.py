"""Run one SGLang engine in its own process and write what it generated as JSON.

Used by the GPU tests, the qualification runner (tests/gpu/qualify.py) and the serving
benchmark (bench/bench_serving.py) so that stock and monitored SGLang never share a
process::

    python tests/gpu/run_engine.py spec.json result.json

``spec.json``: ``{"engine": {...ServerArgs keywords...}, "env": {...}, "monitored": bool,
"dmi_engine": bool}`` plus either one generate call (``"prompts"`` or ``"input_ids"``,
``"rids"``, ``"sampling_params"``) or ``"workloads"``: a list of generate calls run in
order, each ``{"name", "input_ids" | "prompts", "rids", "sampling_params" (one dict or one
per request), "return_hidden_states": bool, "timed": bool (default true), "min_seconds":
float, "max_waves": int, "keep_outputs": bool}``. A workload with ``min_seconds`` > 0 or
``max_waves`` > 1 is repeated in waves (request ids suffixed ``.wN``) until it generated for
``min_seconds`` or ran ``max_waves`` waves. Untimed workloads (a warm-up) come first.
A spec's ``"profile"`` entry (``{"seconds", "delay_s", "passes", "dir"}``) runs py-spy over
this process and its children during the timed workloads (tests/gpu/profiling.py); the
digest is the result's ``"profile"``. A ``"torch_profile"`` entry (``{"decode_steps",
"dir"}``) asks SGLang's scheduler for a torch profile of the first ``decode_steps`` decode
steps of the timed workloads; the digest of that trace (tests/gpu/torch_trace.py) is the
result's ``"torch_profile"``.

The result holds output ids, meta info, per-workload timings and counts, and for monitored
runs the run id; ``durable_s`` runs from the first timed generate until
``dmi_stop_monitoring`` returned (for stock runs: until the last generate returned).
Returned hidden states (``return_hidden_states``) are counted, never stored. A failure is
reported as ``{"ok": false, "error": ...}`` with whatever was measured before it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _count_numbers(value: Any) -> int:
    """Numbers in a nested list (SGLang's ``meta_info["hidden_states"]``)."""
    if value is None:
        return 0
    if isinstance(value, int | float):
        return 1
    if hasattr(value, "numel"):  # a tensor, should SGLang ever return one
        return int(value.numel())
    if isinstance(value, list | tuple):
        if value and isinstance(value[0], int | float):
            return len(value)
        return sum(_count_numbers(v) for v in value)
    return 0


def workloads_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The spec's workloads; a legacy single-generate spec is one workload."""
    if "workloads" in spec:
        return list(spec["workloads"])
    wl: dict[str, Any] = {"name": "generate", "sampling_params": spec["sampling_params"]}
    for key in ("input_ids", "prompts", "rids"):
        if spec.get(key) is not None:
            wl[key] = spec[key]
    return [wl]


def _gen_args(wl: dict[str, Any], wave: int | None) -> dict[str, Any]:
    args: dict[str, Any] = {"sampling_params": wl["sampling_params"]}
    if wl.get("input_ids") is not None:
        args["input_ids"] = wl["input_ids"]
    else:
        args["prompt"] = wl["prompts"]
    rids = wl.get("rids")
    if rids:
        args["rid"] = list(rids) if wave is None else [f"{r}.w{wave}" for r in rids]
    if wl.get("return_hidden_states"):
        args["return_hidden_states"] = True
    return args


def run_workload(engine: Any, wl: dict[str, Any],
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Run one workload (in waves when asked); timings, counts and outputs."""
    min_s = float(wl.get("min_seconds") or 0.0)
    max_waves = max(int(wl.get("max_waves") or 1), 1)
    repeat = min_s > 0 or max_waves > 1
    keep = bool(wl.get("keep_outputs", True))
    res: dict[str, Any] = {
        "name": wl.get("name", "generate"), "timed": bool(wl.get("timed", True)),
        "waves": 0, "seconds": 0.0, "wave_seconds": [], "requests": 0,
        "prompt_tokens": 0, "output_tokens": 0, "hidden_state_numbers": 0, "outputs": [],
    }
    while True:
        args = _gen_args(wl, res["waves"] if repeat else None)
        t0 = clock()
        outs = engine.generate(**args)
        dt = clock() - t0
        if isinstance(outs, dict):
            outs = [outs]
        res["waves"] += 1
        res["seconds"] += dt
        res["wave_seconds"].append(dt)
        for o in outs:
            meta = o["meta_info"]
            res["hidden_state_numbers"] += _count_numbers(meta.pop("hidden_states", None))
            res["requests"] += 1
            res["prompt_tokens"] += int(meta["prompt_tokens"])
            res["output_tokens"] += int(meta["completion_tokens"])
            if keep:
                res["outputs"].append({
                    "id": meta["id"],
                    "output_ids": list(o["output_ids"]),
                    "prompt_tokens": meta["prompt_tokens"],
                    "completion_tokens": meta["completion_tokens"],
                    "text": o.get("text"),
                    "num_retractions": meta.get("num_retractions"),
                    "workload": res["name"],
                })
        if res["waves"] >= max_waves or (min_s > 0 and res["seconds"] >= min_s):
            return res


def execute(engine: Any, spec: dict[str, Any], result: dict[str, Any],
            clock: Callable[[], float] = time.perf_counter) -> None:
    """Run the spec's workloads on a started engine, then stop monitoring; fills ``result``.

    ``result`` is filled as it goes, so a failure leaves what was measured before it.
    """
    result["workloads"] = []
    first_timed: float | None = None
    profiler: threading.Thread | None = None
    for wl in workloads_of(spec):
        if wl.get("timed", True) and first_timed is None:
            if spec.get("torch_profile"):
                _start_torch_profile(engine, spec["torch_profile"])
            first_timed = clock()
            if spec.get("profile"):
                profiler = _start_profile(spec["profile"], result)
        result["workloads"].append(run_workload(engine, wl, clock))
    t1 = clock()
    if first_timed is None:
        first_timed = t1
    if spec.get("monitored"):
        if spec.get("dmi_engine"):
            engine.dmi_stop_monitoring()
            result["run_id"] = engine.dmi_run_id
        else:
            engine.collective_rpc("dmi_stop_monitoring")
            result["run_id"] = os.environ.get("DMX_MODEL_ID", "")
    t2 = clock()
    if profiler is not None:  # after the timing: a profile outliving the workload costs none
        profiler.join()
    if spec.get("torch_profile"):
        result["torch_profile"] = _torch_profile_digest(engine, spec["torch_profile"])
    timed = [w for w in result["workloads"] if w["timed"]]
    outputs = [o for w in result["workloads"] for o in w.pop("outputs")]
    result.update(
        generate_s=sum(w["seconds"] for w in timed),
        durable_s=t2 - first_timed,
        stop_s=t2 - t1,
        output_tokens=sum(w["output_tokens"] for w in timed),
        outputs=outputs,
    )


def _start_profile(profile: dict[str, Any], result: dict[str, Any]) -> threading.Thread:
    """Profile this process and its children with py-spy in the background
    (tests/gpu/profiling.py); the digest lands in ``result["profile"]``."""
    import profiling

    workdir = Path(profile.get("dir") or tempfile.mkdtemp(prefix="dmi-py-spy-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def run() -> None:
        try:
            result["profile"] = profiling.profile_engine(os.getpid(), profile, workdir)
        except Exception as exc:  # a profile is information only
            result["profile"] = {"error": repr(exc)}

    thread = threading.Thread(target=run, name="dmi-bench-profiler", daemon=True)
    thread.start()
    return thread


def _start_torch_profile(engine: Any, profile: dict[str, Any]) -> None:
    """Ask the scheduler to profile the next ``decode_steps`` decode steps (and the
    prefill steps before them: SGLang profiles by stage). Stacks and shapes are off, to
    keep the trace small and the slow-down low. The directory is emptied first: a trace
    left by an earlier run must not pass for this one."""
    shutil.rmtree(profile["dir"], ignore_errors=True)
    Path(profile["dir"]).mkdir(parents=True)
    engine.start_profile(output_dir=profile["dir"], num_steps=int(profile["decode_steps"]),
                         profile_by_stage=True, activities=["CPU", "GPU"], with_stack=False,
                         record_shapes=False, profile_id="dmi")


def _torch_profile_digest(engine: Any, profile: dict[str, Any]) -> dict[str, Any]:
    """The digest of the decode trace; a profile that never reached its step count (a
    short workload) is stopped here first. Information only: errors are reported."""
    import torch_trace

    directory = Path(profile["dir"])
    stop_error = None
    trace = torch_trace.decode_trace(directory)
    if trace is None or "DECODE" not in trace.name:
        try:  # still profiling (fewer decode steps than asked for), or never started
            engine.stop_profile()
        except Exception as exc:  # SGLang raises when no profile is in progress
            stop_error = repr(exc)
        trace = torch_trace.decode_trace(directory)
    try:
        if trace is None:
            return {"error": f"no trace was written to {directory} (stop: {stop_error})"}
        return {"decode_steps": profile["decode_steps"], "stop_error": stop_error,
                **torch_trace.summarize_trace(trace)}
    except Exception as exc:  # a profile is information only
        return {"error": repr(exc)}


def _env_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import importlib.metadata as md

        import torch

        info.update(torch=torch.__version__, sglang=md.version("sglang"))
        try:
            info["dmi_sglang"] = md.version("dmi-sglang")
        except md.PackageNotFoundError:
            info["dmi_sglang"] = None
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # information only
        info["error"] = repr(exc)
    return info


def _run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    os.environ.update(spec.get("env", {}))
    import sglang

    kwargs = dict(spec["engine"])
    started = time.perf_counter()
    if spec.get("dmi_engine"):
        from dmi_sglang import DMIEngine

        engine = DMIEngine(**kwargs)
    else:
        engine = sglang.Engine(**kwargs)
    result["startup_s"] = time.perf_counter() - started
    result["env_info"] = _env_info()
    try:
        execute(engine, spec, result)
    finally:
        engine.shutdown()


def main() -> int:
    """``run_engine.py SPEC OUT``: exit 0 when the engine ran every workload."""
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict[str, Any] = {}
    try:
        _run(spec, result)
        result["ok"] = True
    except BaseException as exc:  # report every failure to the parent as data
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(out_path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
