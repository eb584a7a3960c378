"""Run one SGLang engine in its own process and write what it generated as JSON.

Used by the GPU tests and the qualification runner so that stock and monitored SGLang
never share a process::

    python tests/gpu/run_engine.py spec.json result.json

``spec.json``: ``{"engine": {...ServerArgs keywords...}, "env": {...}, "prompts": [...],
"rids": [...], "sampling_params": {...}, "monitored": bool, "dmi_engine": bool}``.
The result holds output ids, meta info, timings and, for monitored runs, the run id.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(spec.get("env", {}))
    import sglang

    kwargs = dict(spec["engine"])
    started = time.perf_counter()
    if spec.get("dmi_engine"):
        from dmi_sglang import DMIEngine

        engine = DMIEngine(**kwargs)
    else:
        engine = sglang.Engine(**kwargs)
    ready = time.perf_counter()
    result: dict[str, Any] = {"startup_s": ready - started}
    try:
        gen_args: dict[str, Any] = {"sampling_params": spec["sampling_params"]}
        if "input_ids" in spec:
            gen_args["input_ids"] = spec["input_ids"]
        else:
            gen_args["prompt"] = spec["prompts"]
        if spec.get("rids"):
            gen_args["rid"] = spec["rids"]
        t0 = time.perf_counter()
        outs = engine.generate(**gen_args)
        t1 = time.perf_counter()
        if spec.get("monitored"):
            if spec.get("dmi_engine"):
                engine.dmi_stop_monitoring()
                result["run_id"] = engine.dmi_run_id
            else:
                engine.collective_rpc("dmi_stop_monitoring")
                result["run_id"] = os.environ.get("DMX_MODEL_ID", "")
        t2 = time.perf_counter()
        result.update(
            generate_s=t1 - t0,
            durable_s=t2 - t0,
            outputs=[
                {
                    "id": o["meta_info"]["id"],
                    "output_ids": list(o["output_ids"]),
                    "prompt_tokens": o["meta_info"]["prompt_tokens"],
                    "completion_tokens": o["meta_info"]["completion_tokens"],
                    "text": o.get("text"),
                }
                for o in outs
            ],
        )
    finally:
        engine.shutdown()
    return result


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = _run(spec)
        result["ok"] = True
    except BaseException as exc:  # report every failure to the parent as data
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
