"""Summary of a torch profiler trace of SGLang's scheduler (``Engine.start_profile``).

The trace (Chrome trace JSON, gzipped or not) holds complete events (``"ph": "X"``,
microseconds): CUDA kernels and copies (``cat`` ``kernel`` / ``gpu_memcpy`` /
``gpu_memset``), the Python functions each thread ran (``python_function``, named
``path(line): function``, with ``with_stack``) and torch operators (``cpu_op``). The summary
answers where a step's time goes:

* ``window_s``: from the first to the last event; ``gpu_busy``: the share of it with a
  kernel or copy running (a GPU that waits for the host shows low);
* ``kernel_s``, ``copy_s``, ``copy_kernel_overlap_s``: seconds with a kernel running, with
  a copy running (the copy engines: ``gpu_memcpy``), and with both at once (the drain's
  device-to-host copies are meant to run beside the model's kernels);
* ``forwards``: calls of ``ModelRunner.forward``;
* per thread (its name from the trace's metadata): seconds inside any Python function and
  inside dmi_sglang's functions (nested calls counted once), and inside CUDA calls
  (``cuda_s``: the thread releases the GIL there, so its Python time less this is about
  what it held the GIL for), and those calls by name (``cuda_calls``: seconds and count,
  the :data:`_THREAD_CALLS` that took the thread longest, the most first; a driver call
  made inside a runtime call is listed under both names, as in ``runtime``): which thread
  waits in ``cudaEventSynchronize``, which one launches the graphs. A thread with CUDA
  calls and no Python frames is listed too (its Python seconds 0);
* ``dmi``: dmi_sglang's functions, each with its inclusive seconds (a recursive call
  counted once, the threads' seconds added), the most first;
* ``dmi_ops``: torch operators run inside dmi_sglang's functions, by name, seconds;
* ``gpu_s``: seconds with a kernel or copy running; ``kernels``: the GPU work by kernel
  (or copy) name, its seconds and count, the most first (compare a monitored mode's with
  stock's to see what capture adds to the GPU's time);
* ``runtime``: the host's calls into the CUDA runtime and driver (``cat``
  ``cuda_runtime`` / ``cuda_driver``: ``cudaGraphLaunch``, ``cudaLaunchKernel``, ...) by
  name, their seconds and count, the most first (what a launch costs the thread that
  makes it: compare a monitored mode's with stock's to see what capture adds to a decode
  graph's launch); ``runtime_s``: seconds inside any of them (a call inside another, a
  driver call the runtime made say, counted once).
* ``graph_launches``: ``cudaGraphLaunch`` calls (decode graph replays); ``graph_kernels``
  and ``graph_gpu_s``: the GPU work those launches ran (each kernel or copy carries its
  launch's ``correlation`` id in its ``args``), by name, and its busy seconds: compare a
  monitored mode's per replay with stock's to see what the capture adds to a decode step's
  GPU time, prefills and eager work apart.
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
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
OURS = "dmi_sglang/"
GRAPH_LAUNCH = "cudaGraphLaunch"
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


_THREAD_CALLS = 6
"""CUDA calls kept per thread (``cuda_calls``), the most time first."""

_WAITS = ("threading.py", "queue.py", ": synchronize", ": sleep", ": wait")
"""Frames that block (a wait is not work): their own time is reported apart."""


class _Frame:
    """One ``python_function`` event in its thread's call tree."""

    __slots__ = ("a", "b", "child_s", "name", "ours", "root")

    def __init__(self, name: str, a: float, b: float, parent: _Frame | None) -> None:
        self.name, self.a, self.b = name, a, b
        self.child_s = 0.0
        self.root = parent is None
        mine = OURS in name
        sglang = "/sglang/" in name and not mine
        # dmi_sglang's frame this one works for: itself, or its caller's unless SGLang's
        # own code (the forward a hook wraps) runs here
        self.ours: _Frame | None = self if mine else (
            parent.ours if parent is not None and not sglang else None)

    @property
    def own(self) -> float:
        """Seconds in this frame itself (its calls excluded)."""
        return max(0.0, (self.b - self.a) - self.child_s) / 1e6


def _frames(events: Sequence[tuple[str, float, float]],
            ops: Sequence[tuple[str, float, float]]) -> tuple[list[_Frame], list[tuple[
                str, float, _Frame | None]]]:
    """The call tree of one thread's Python events, and each operator with the innermost
    frame it ran in (one pass over both, by start; at equal starts the longer first, a
    frame before an operator)."""
    items = sorted([(a, -(b - a), 0, name, b) for name, a, b in events]
                   + [(a, -(b - a), 1, name, b) for name, a, b in ops])
    frames: list[_Frame] = []
    owned: list[tuple[str, float, _Frame | None]] = []
    stack: list[_Frame] = []
    for a, _neg, kind, name, b in items:
        while stack and stack[-1].b <= a:
            stack.pop()
        parent = stack[-1] if stack else None
        if kind == 1:
            owned.append((name, (b - a) / 1e6, parent if parent is not None and
                          b <= parent.b else None))
            continue
        frame = _Frame(name, a, b, parent)
        if parent is not None:
            parent.child_s += b - a
        stack.append(frame)
        frames.append(frame)
    return frames, owned


def summarize_events(events: Sequence[dict[str, Any]], top: int = 20) -> Json:
    """:func:`summarize_trace` of events already loaded.

    dmi_sglang's time is what its frames run themselves plus the library calls they make
    (torch, numpy, the standard library), never SGLang's code they wrap (the forward
    inside ``around_forward``); waits (``threading``, ``queue``, ``synchronize``,
    ``sleep``) are reported apart.
    """
    names: dict[Any, str] = {}
    gpu: dict[str, list[Interval]] = defaultdict(list)
    """Kernels, copies and memsets by category."""
    kernel_s: dict[str, float] = defaultdict(float)
    kernel_n: dict[str, int] = defaultdict(int)
    runtime: list[tuple[Any, str, float, float]] = []
    """CUDA calls in the trace's order: thread, name, start, end."""
    launches: set[Any] = set()
    """The correlation ids of the graph launches."""
    work: list[tuple[str, float, float, Any]] = []
    """Every kernel or copy: its name, start, end and launch's correlation id."""
    python: dict[Any, list[tuple[str, float, float]]] = defaultdict(list)
    ops: dict[Any, list[tuple[str, float, float]]] = defaultdict(list)
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
            gpu[cat].append((a, b))
            kernel_s[_kernel(name)] += b - a
            kernel_n[_kernel(name)] += 1
            work.append((_kernel(name), a, b, (e.get("args") or {}).get("correlation")))
        elif cat == "python_function":
            python[tid].append((name, a, b))
            if f"{FORWARD[0]}(" in name and name.endswith(FORWARD[1]):
                forwards += 1
        elif cat == "cpu_op":
            ops[tid].append((name, a, b))
        elif cat in RUNTIME_CATEGORIES:
            runtime.append((tid, name, a, b))
            if name == GRAPH_LAUNCH:
                launches.add((e.get("args") or {}).get("correlation"))
    window = max(last - first, 0.0)
    threads: list[Json] = []
    by_function: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    op_seconds: dict[str, float] = defaultdict(float)
    # every thread with Python frames or CUDA calls (a thread the profiler recorded no
    # Python of still shows its calls)
    for tid in dict.fromkeys([*python, *(c[0] for c in runtime)]):
        threads.append({"tid": tid, "name": names.get(tid, ""), **_thread(
            python.get(tid, ()), ops.get(tid, ()), by_function, calls, op_seconds),
            **_cuda_calls([c[1:] for c in runtime if c[0] == tid])})
    threads.sort(key=lambda t: -float(t["python_s"]))
    functions = sorted(by_function.items(), key=lambda kv: -kv[1])
    return {
        "window_s": window / 1e6,
        **_gpu_time(gpu, window),
        # every kernel: a mode's are compared with stock's by name (harness.profile)
        "kernels": [{"kernel": k, "seconds": v / 1e6, "count": kernel_n[k]} for k, v in
                    sorted(kernel_s.items(), key=lambda kv: -kv[1])],
        **_runtime([c[1:] for c in runtime]),
        **_graph_work(work, launches - {None}),
        "forwards": forwards,
        "threads": threads,
        "dmi": [{"function": f, "seconds": s, "calls": calls.get(f, 0)}
                for f, s in functions[:top]],
        "dmi_ops": [{"op": k, "seconds": v} for k, v in
                    sorted(op_seconds.items(), key=lambda kv: -kv[1])[:top]],
    }


def _by_name(calls: Sequence[tuple[str, float, float]]) -> list[Json]:
    """CUDA calls (name, start, end) by name: seconds and count, the most time first."""
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for name, a, b in calls:
        seconds[name] += b - a
        count[name] += 1
    return [{"call": k, "seconds": v / 1e6, "count": count[k]}
            for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])]


def _runtime(calls: Sequence[tuple[str, float, float]]) -> Json:
    """``runtime`` and ``runtime_s`` (module docstring) of every thread's CUDA calls."""
    return {"runtime": _by_name(calls), "runtime_s": _union((a, b) for _, a, b in calls) / 1e6}


def _cuda_calls(calls: Sequence[tuple[str, float, float]]) -> Json:
    """One thread's ``cuda_s`` and ``cuda_calls`` (module docstring) of its CUDA calls
    (a call inside another counted once in ``cuda_s``)."""
    return {"cuda_s": _union((a, b) for _, a, b in calls) / 1e6,
            "cuda_calls": _by_name(calls)[:_THREAD_CALLS]}


def _gpu_time(gpu: dict[str, list[Interval]], window: float) -> Json:
    """``gpu_busy``, ``gpu_s``, ``kernel_s``, ``copy_s`` and ``copy_kernel_overlap_s``
    (module docstring) of the GPU's intervals by category, in a window of ``window`` µs."""
    busy = _union(iv for intervals in gpu.values() for iv in intervals)
    kernels, copies = gpu["kernel"], gpu["gpu_memcpy"]
    kernel, copy = _union(kernels), _union(copies)
    both = kernel + copy - _union([*kernels, *copies])
    return {"gpu_busy": busy / window if window else None, "gpu_s": busy / 1e6,
            "kernel_s": kernel / 1e6, "copy_s": copy / 1e6,
            "copy_kernel_overlap_s": max(both, 0.0) / 1e6}


def _graph_work(work: Sequence[tuple[str, float, float, Any]], launches: set[Any]) -> Json:
    """``graph_launches``, ``graph_kernels`` and ``graph_gpu_s`` (module docstring) of the
    kernels and copies whose correlation id is a graph launch's."""
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    busy: list[Interval] = []
    for name, a, b, correlation in work:
        if correlation in launches:
            seconds[name] += b - a
            count[name] += 1
            busy.append((a, b))
    return {"graph_launches": len(launches),
            "graph_kernels": [{"kernel": k, "seconds": v / 1e6, "count": count[k]}
                              for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])],
            "graph_gpu_s": _union(busy) / 1e6}


def _thread(evs: Sequence[tuple[str, float, float]], ops: Sequence[tuple[str, float, float]],
            by_function: dict[str, float], calls: dict[str, int],
            op_seconds: dict[str, float]) -> Json:
    """One thread's figures; adds its dmi_sglang functions and operators to the totals."""
    frames, owned = _frames(evs, ops)
    work = wait = 0.0
    for f in frames:
        if f.ours is None:
            continue
        if any(w in f.name for w in _WAITS):
            wait += f.own
        else:
            work += f.own
            by_function[_short(f.ours.name)] += f.own
        if f is f.ours:
            calls[_short(f.name)] += 1
    for name, seconds, inner in owned:  # an operator belongs to its innermost frame
        if inner is not None and inner.ours is not None:
            op_seconds[name] += seconds
    entry = max((f for f in frames if f.root), key=lambda f: f.b - f.a, default=None)
    return {"entry": _short(entry.name) if entry is not None else "",
            "python_s": _union((f.a, f.b) for f in frames) / 1e6, "dmi_s": work,
            "dmi_wait_s": wait}


def _kernel(name: str) -> str:
    """A kernel's name without its template arguments and parameter list (``void
    at::native::f<float, 4>(int)`` -> ``at::native::f``), at most 90 characters."""
    name = name.removeprefix("void ")
    for stop in ("<", "("):
        name = name.split(stop, 1)[0]
    return name[:90]


def _short(name: str) -> str:
    """``.../dmi_sglang/app/session.py(210): commit_graph`` -> ``app/session.py:
    commit_graph`` (the line number dropped: one entry per function)."""
    path, _, func = name.partition(": ")
    path = path.split(OURS, 1)[-1]
    return f"{path.split('(')[0]}: {func}"
