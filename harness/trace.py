"""Summary of a torch profiler trace of SGLang's scheduler (``Engine.start_profile``).

The trace (Chrome trace JSON, gzipped or not) holds complete events (``"ph": "X"``,
microseconds): CUDA kernels and copies (``cat`` ``kernel`` / ``gpu_memcpy`` /
``gpu_memset``), the Python functions each thread ran (``python_function``, named
``path(line): function``, with ``with_stack``) and torch operators (``cpu_op``). The summary
answers where a step's time goes:

* ``window_s``: from the first to the last event; ``gpu_busy``: the share of it with a
  kernel or copy running (a GPU that waits for the host shows low);
* ``forwards``: calls of ``ModelRunner.forward``;
* per thread (its name from the trace's metadata): seconds inside any Python function and
  inside dmi_sglang's functions (nested calls counted once);
* ``dmi``: dmi_sglang's functions, each with its inclusive seconds (a recursive call
  counted once, the threads' seconds added), the most first;
* ``dmi_ops``: torch operators run inside dmi_sglang's functions, by name, seconds.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from harness.results import Json

__all__ = ["summarize_trace"]

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
OURS = "dmi_sglang/"
FORWARD = ("model_runner.py", ": forward")
"""A ``python_function`` event of ``ModelRunner.forward`` (file, then function)."""

Interval = tuple[float, float]


def _union(intervals: Iterable[Interval]) -> float:
    """Total length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _inside(spans: Sequence[Interval], a: float, b: float) -> bool:
    """True when ``[a, b)`` lies within one of ``spans`` (sorted, disjoint)."""
    lo, hi = 0, len(spans)
    while lo < hi:  # the last span starting at or before a
        mid = (lo + hi) // 2
        if spans[mid][0] <= a:
            lo = mid + 1
        else:
            hi = mid
    return lo > 0 and spans[lo - 1][1] >= b


def _merged(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's events."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def summarize_trace(path: Path, top: int = 20) -> Json:
    """The summary of one trace file (see the module docstring)."""
    return summarize_events(load_trace(path), top=top)


def summarize_events(events: Sequence[dict[str, Any]], top: int = 20) -> Json:
    """:func:`summarize_trace` of events already loaded."""
    names: dict[Any, str] = {}
    gpu: list[Interval] = []
    python: dict[Any, list[Interval]] = defaultdict(list)
    ours: dict[Any, list[Interval]] = defaultdict(list)
    by_function: dict[tuple[str, Any], list[Interval]] = defaultdict(list)
    ops: list[tuple[Any, str, float, float]] = []
    first, last, forwards = float("inf"), float("-inf"), 0
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e.get("tid")] = str((e.get("args") or {}).get("name", ""))
            continue
        if e.get("ph") != "X" or "ts" not in e:
            continue
        a = float(e["ts"])
        b = a + float(e.get("dur", 0.0))
        first, last = min(first, a), max(last, b)
        cat, name, tid = e.get("cat"), str(e.get("name", "")), e.get("tid")
        if cat in GPU_CATEGORIES:
            gpu.append((a, b))
        elif cat == "python_function":
            python[tid].append((a, b))
            if f"{FORWARD[0]}(" in name and name.endswith(FORWARD[1]):
                forwards += 1
            if OURS in name:
                ours[tid].append((a, b))
                by_function[_short(name), tid].append((a, b))
        elif cat == "cpu_op":
            ops.append((tid, name, a, b))
    window = max(last - first, 0.0)
    ours_merged = {tid: _merged(spans) for tid, spans in ours.items()}
    op_seconds: dict[str, float] = defaultdict(float)
    for tid, name, a, b in ops:
        spans = ours_merged.get(tid)
        if spans and _inside(spans, a, b):
            op_seconds[name] += (b - a) / 1e6
    threads = [{"tid": tid, "name": names.get(tid, ""),
                "python_s": _union(spans) / 1e6,
                "dmi_s": _union(ours.get(tid, ())) / 1e6}
               for tid, spans in python.items()]
    threads.sort(key=lambda t: -float(t["python_s"]))
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for (function, _tid), spans in by_function.items():  # recursion once, threads summed
        seconds[function] += _union(spans) / 1e6
        calls[function] += len(spans)
    functions = sorted(((f, s, calls[f]) for f, s in seconds.items()), key=lambda x: -x[1])
    return {
        "window_s": window / 1e6,
        "gpu_busy": _union(gpu) / window if window else None,
        "forwards": forwards,
        "threads": threads,
        "dmi": [{"function": f, "seconds": s, "calls": n} for f, s, n in functions[:top]],
        "dmi_ops": [{"op": k, "seconds": v} for k, v in
                    sorted(op_seconds.items(), key=lambda kv: -kv[1])[:top]],
    }


def _short(name: str) -> str:
    """``.../dmi_sglang/app/session.py(210): commit_graph`` -> ``app/session.py:
    commit_graph`` (the line number dropped: one entry per function)."""
    path, _, func = name.partition(": ")
    path = path.split(OURS, 1)[-1]
    return f"{path.split('(')[0]}: {func}"
