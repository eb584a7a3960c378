"""Digest of a torch profiler trace (Chrome trace JSON, as SGLang's profiler exports it).

``run_engine.py`` asks SGLang's scheduler for a torch profile of the first decode steps of
the timed workload (``Engine.start_profile(profile_by_stage=True, num_steps=N)``); the
scheduler writes ``*-DECODE.trace.json.gz``. A trace is tens of MB; what comes back is
:func:`summarize_trace`'s digest, which answers the question the py-spy profiles cannot:
is the GPU waiting for the host, and do the capture copies run under the model's kernels?

* the span from the first to the last GPU event, the share of it with any GPU work (the
  union over streams) and with kernels; the rest is the GPU waiting for the host;
* device-to-host and other copies: time, bytes, and the share of copy time that ran
  while a kernel ran (hidden), per copy kind;
* per stream its busy time; the kernels with the most time;
* CUDA runtime and driver calls (launches, synchronisations, copies) by total time, and
  per host thread the time in top-level operators (nested operators are not counted
  twice);
* the forward steps in the trace by mode, from SGLang's own step spans
  (``step[DECODE bs=64]``, ``step[EXTEND ...]``): prefills that arrive while decode steps
  are profiled land in the same trace.

Kernels inside CUDA graphs are recorded by CUPTI as kernels of their own; a trace with
graph launches and no kernels at all (a CUPTI that missed them) is flagged
``kernels_missing``, since its busy shares would then count copies only.

Profiled runs are not timing results: the profiler slows the host.
"""

from __future__ import annotations

import collections
import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})
STEP_PREFIX = "step["

Interval = tuple[float, float]


def load_events(path: Path) -> list[dict[str, Any]]:
    """The trace's events (a ``.gz`` file is decompressed)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    data = json.loads(raw)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of half-open intervals, as sorted disjoint intervals."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def covered(intervals: list[Interval]) -> float:
    """Total length of sorted disjoint intervals."""
    return sum(b - a for a, b in intervals)


def overlap(xs: list[Interval], ys: list[Interval]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _span(e: dict[str, Any]) -> Interval:
    ts = float(e["ts"])
    return ts, ts + float(e["dur"])


def _thread_names(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], str]:
    return {(e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def _top_level_ops(ops: list[dict[str, Any]]) -> tuple[float, collections.Counter[str]]:
    """Time in operators not nested in another operator of the same thread, and per name."""
    total, by_name = 0.0, collections.Counter[str]()
    end = float("-inf")
    for e in sorted(ops, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        a, b = _span(e)
        if a >= end:
            total += b - a
            by_name[str(e.get("name"))] += b - a
            end = b
    return total, by_name


def _gpu_digest(gpu: list[dict[str, Any]], top: int) -> dict[str, Any]:
    start = min(float(e["ts"]) for e in gpu)
    end = max(_span(e)[1] for e in gpu)
    span = end - start
    busy = merged(_span(e) for e in gpu)
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    kernel_busy = merged(_span(e) for e in kernels)
    streams: dict[tuple[Any, Any], list[Interval]] = collections.defaultdict(list)
    for e in gpu:
        streams[(e.get("pid"), e.get("tid"))].append(_span(e))
    by_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        k = by_kernel[str(e.get("name"))]
        k[0] += 1
        k[1] += float(e["dur"])
    copies: dict[str, dict[str, Any]] = {}
    for e in gpu:
        if e.get("cat") == "kernel":
            continue
        c = copies.setdefault(str(e.get("name")), {"count": 0, "us": 0.0, "bytes": 0,
                                                   "spans": []})
        c["count"] += 1
        c["us"] += float(e["dur"])
        c["bytes"] += int(e.get("args", {}).get("bytes", 0) or 0)
        c["spans"].append(_span(e))
    copy_rows = []
    for name, c in sorted(copies.items(), key=lambda kv: -kv[1]["us"]):
        union = merged(c.pop("spans"))
        hidden = overlap(union, kernel_busy)
        copy_rows.append({"name": name, **c,
                          "hidden_share": hidden / covered(union) if union else 0.0,
                          "gb_per_s": c["bytes"] / c["us"] / 1e3 if c["us"] else None})
    return {
        "span_us": span,
        "kernels_missing": not kernels,
        "gpu_busy_share": covered(busy) / span if span else 0.0,
        "kernel_busy_share": covered(kernel_busy) / span if span else 0.0,
        "gpu_idle_us": span - covered(busy),
        "streams": sorted(({"stream": f"{pid}/{tid}", "busy_share": covered(merged(s)) / span
                            if span else 0.0, "events": len(s)}
                           for (pid, tid), s in streams.items()),
                          key=lambda r: -r["busy_share"]),
        "kernels": [{"name": n[:120], "count": int(c), "us": us}
                    for n, (c, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
        "copies": copy_rows[:top],
    }


def summarize_trace(path: Path, top: int = 12) -> dict[str, Any]:
    """The digest described in the module docstring. ``gpu`` is None for a trace without
    GPU events (a CPU-only profile)."""
    events = load_events(path)
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = [e for e in timed if e.get("cat") in GPU_CATS]
    runtime: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    steps: collections.Counter[str] = collections.Counter()
    for e in timed:
        name = str(e.get("name"))
        if e.get("cat") in RUNTIME_CATS:
            r = runtime[name]
            r[0] += 1
            r[1] += float(e["dur"])
        elif e.get("cat") == "user_annotation" and name.startswith(STEP_PREFIX):
            steps[name[len(STEP_PREFIX):].split(" ", 1)[0].rstrip("]")] += 1
    names = _thread_names(events)
    per_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = collections.defaultdict(list)
    for e in timed:
        if e.get("cat") == "cpu_op":
            per_thread[(e.get("pid"), e.get("tid"))].append(e)
    threads = []
    for key, ops in per_thread.items():
        total, by_name = _top_level_ops(ops)
        threads.append({"thread": names.get(key) or f"{key[0]}/{key[1]}", "op_us": total,
                        "top": [[n, us] for n, us in by_name.most_common(top)]})
    threads.sort(key=lambda t: -t["op_us"])
    return {
        "file": path.name,
        "events": len(timed),
        "gpu": _gpu_digest(gpu, top) if gpu else None,
        "steps": dict(steps),
        "graph_launches": int(sum(c for n, (c, _) in runtime.items()
                                  if n.startswith("cudaGraphLaunch"))),
        "runtime": [{"name": n, "count": int(c), "us": us}
                    for n, (c, us) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:top]],
        "threads": threads[:top],
    }


def decode_trace(directory: Path) -> Path | None:
    """The newest decode-stage trace SGLang's profiler wrote into ``directory``, else the
    newest trace of no stage (a profile stopped by request), else the newest prefill
    trace, else None."""
    traces = sorted(directory.glob("*.trace.json*"), key=lambda p: p.stat().st_mtime)
    decode = [p for p in traces if "DECODE" in p.name]
    unstaged = [p for p in traces if "DECODE" not in p.name and "EXTEND" not in p.name]
    return (decode or unstaged or traces or [None])[-1]
