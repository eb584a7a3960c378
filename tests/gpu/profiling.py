"""Sampling profiles of a running engine with py-spy (in the GPU kit), summarised small.

``run_engine.py`` starts :func:`profile_engine` in a thread when a spec asks for it: after
``delay_s`` into the first timed workload it records the engine process and its children
(the scheduler, the detokenizer) for ``seconds`` per pass:

* ``cpu``: where threads run on a CPU (py-spy's default: idle threads not sampled);
* ``gil``: only the thread holding the GIL, i.e. who keeps the scheduler thread waiting.

A raw profile is a few MB; what comes back is :func:`summarize_raw`'s digest: samples per
process and thread, and per thread the functions with the most samples on top of the
stack (self) and anywhere on it (inclusive). Sampling is ``--nonblocking`` (the target is
not paused), so it perturbs throughput a little: profiled runs are not timing results.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PASSES = ("cpu", "gil")


def py_spy() -> str | None:
    """The py-spy executable beside this Python, else on PATH, else None."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _split(frames: list[str]) -> tuple[str, list[str]]:
    """``(process | thread, code frames)`` of one sample. py-spy puts the chain of process
    labels (``process PID:"CMDLINE"``; a command line may contain ``;``) and then a thread
    label (``thread (TID): NAME``) before the code frames."""
    at = max((i for i, f in enumerate(frames) if f.startswith("thread (")), default=-1)
    thread = frames[at][len("thread "):] if at >= 0 else "?"
    procs = [f for f in frames[: max(at, 0)] if f.startswith("process ")]
    if not procs:
        return thread, frames[at + 1:]
    pid, _, cmd = procs[-1][len("process "):].replace('"', "").partition(":")
    return f"{pid} {cmd.strip()[:40]} | {thread}", frames[at + 1:]


def summarize_raw(path: Path, top: int = 15) -> dict[str, Any]:
    """Digest of a py-spy ``--format raw`` file recorded with ``--threads`` (and
    ``--subprocesses``): total samples; per thread (``process | thread``) its samples, share,
    top self frames and top inclusive frames with their shares of that thread."""
    per_thread: dict[str, int] = collections.Counter()
    self_c: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl_c: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        key, code = _split(stack.split(";"))
        total += n
        per_thread[key] += n
        if code:
            self_c[key][code[-1]] += n
            for f in set(code):
                incl_c[key][f] += n
    threads = []
    for key, n in sorted(per_thread.items(), key=lambda kv: -kv[1]):
        threads.append({
            "thread": key, "samples": n, "share": n / total if total else 0.0,
            "self": [[f, c / n] for f, c in self_c[key].most_common(top)],
            "inclusive": [[f, c / n] for f, c in incl_c[key].most_common(top)],
        })
    return {"samples": total, "threads": threads}


def record(pid: int, seconds: float, out: Path, *, gil: bool, rate: int = 100,
           exe: str | None = None) -> dict[str, Any]:
    """One py-spy pass over ``pid`` and its children; its digest (or why there is none)."""
    exe = exe or py_spy()
    if exe is None:
        return {"error": "py-spy not found (it comes with the GPU kit)"}
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking",
           "--rate", str(rate), "--duration", str(max(1, round(seconds))), "--format", "raw",
           "--output", str(out)]
    if gil:
        cmd.append("--gil")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60,
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": repr(exc), "command": cmd}
    if done.returncode != 0 or not out.exists():
        return {"error": f"py-spy exit status {done.returncode}: {done.stderr[-500:]}",
                "command": cmd}
    return {"command": cmd, **summarize_raw(out)}


def profile_engine(pid: int, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The passes a spec's ``profile`` entry asks for (``seconds``, ``delay_s``,
    ``passes``), one after the other; a digest per pass."""
    time.sleep(float(spec.get("delay_s", 3.0)))
    seconds = float(spec.get("seconds", 8.0))
    out: dict[str, Any] = {"seconds_per_pass": seconds}
    for name in spec.get("passes", PASSES):
        out[name] = record(pid, seconds, workdir / f"py-spy-{name}.txt", gil=name == "gil")
    return out
