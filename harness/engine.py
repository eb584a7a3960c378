"""Engine process control: one SGLang engine per child process, driven by JSON commands.

The parent (:class:`EngineProcess`) starts ``python -m harness.engine SPEC FD`` in its own
process group; the child builds the engine from ``SPEC`` (ServerArgs keywords, ``DMX_*``
environment, ``DMIEngine`` or plain ``sglang.Engine``), answers ``ready``, then runs one
command per line read from stdin and answers each as one JSON line on file descriptor
``FD`` (stdout and stderr go to the engine's log). ``SPEC["factory"]`` names the engine
class (``sglang:Engine`` by default, ``dmi_sglang:DMIEngine``):

* ``{"op": "run", "workload": {...}}``: one workload (:meth:`Workload.spec`), in waves;
* ``{"op": "d2h"}``: the pinned device-to-host copy rate (:mod:`harness.bounds`);
* ``{"op": "freeze_gc"}``: SGLang's ``Engine.freeze_gc()`` (after the warm-ups): the
  engine's processes (this one's tokenizer side, the scheduler, the detokenizer) leave
  every object made so far out of later garbage collections, as SGLang advises for
  serving, so that collections of what an engine made at start-up do not fall into the
  timed waves of a freshly started engine and not of one that ran on. SGLang sends the
  scheduler its part without waiting; a ``get_server_info()`` after it, answered by the
  scheduler after the freeze, keeps that part out of the first timed wave. Its reply:
  the seconds both took;
* ``{"op": "profile", "workload": {...}, "steps": N, "dir": D}``: one wave of the workload
  while SGLang's ``start_profile`` records ``N`` forwards of the scheduler with torch's
  profiler (CPU and GPU, Python stacks) into ``D``; the trace's summary
  (:mod:`harness.trace`);
* ``{"op": "stop"}``: ``dmi_stop_monitoring()`` (the run becomes durable);
* ``{"op": "shutdown"}``: the engine shuts down and the child exits.

A child that dies or overruns its timeout is killed with its whole group (one that
overran first has its processes write their Python stacks to its log, which the error
quotes); the result of every command says ``ok`` and, when not, why. Nothing here
imports torch or SGLang in the parent.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dmi_sglang.app.gc_pauses import GcPauses
from harness.constants import (
    GPU_BUSY_PERIOD_S,
    SHUTDOWN_GRACE_S,
    STACK_DUMP_GRACE_S,
    STACK_DUMP_LINES,
    THREADS_REPORTED,
    TRITON_CACHE_DIR,
)
from harness.results import REPO, Json

STAT_EVENTS = ("dmi.stopped", "dmi.timing", "store.closed", "dmi.store_owner_ended",
               "capture transport ready")
"""Structlog events of the scheduler (and of its store owner) whose statistics the checks
and figures use (the last: what the transport ran with, its copies and top-k included)."""


class EngineError(RuntimeError):
    """The engine child failed, died or overran its timeout."""


class EngineProcess:
    """One engine in a child process (see the module docstring)."""

    def __init__(self, name: str, spec: Mapping[str, Any], workdir: Path,
                 pgid_file: Path | None = None) -> None:
        self.name = name
        self.spec = dict(spec)
        self.log = workdir / f"{name}.log"
        self.pgid_file = pgid_file
        self.proc: subprocess.Popen[bytes] | None = None
        self._reply = -1
        self._buffer = b""
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / f"{name}.spec.json").write_text(json.dumps(self.spec))

    def start(self, timeout_s: float | None) -> Json:
        """Start the child and wait for the engine: its ``ready`` reply."""
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMX_")}
        env.setdefault("TRITON_CACHE_DIR", TRITON_CACHE_DIR)
        env.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **self.spec.get("env", {}))
        try:
            with self.log.open("w") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "harness.engine",
                     str(self.log.with_suffix(".spec.json")), str(write_fd)],
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                    cwd=REPO, pass_fds=(write_fd,), start_new_session=True)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._reply = read_fd
        track_group(self.pgid_file, self.proc.pid, add=True)
        return self._wait(timeout_s)

    def request(self, op: str, timeout_s: float | None, **fields: Any) -> Json:
        """Send one command and wait for its reply."""
        if self.proc is None or self.proc.stdin is None:
            raise EngineError(f"{self.name}: not started")
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise EngineError(f"{self.name}: the child is gone ({exc!r}){self._tail()}") \
                from None
        return self._wait(timeout_s)

    def close(self, grace_s: float = SHUTDOWN_GRACE_S) -> Json:
        """Shut the engine down (politely within ``grace_s``, then by killing its group);
        the statistics events of its log."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(EngineError):
                self.request("shutdown", grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        leftover = self._kill_group()
        if self._reply >= 0:
            os.close(self._reply)
            self._reply = -1
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return {"events": parse_log_events(text, STAT_EVENTS), "leftover_processes": leftover}

    def _wait(self, timeout_s: float | None) -> Json:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                dumped = self._dump_stacks()
                self._kill_group()
                raise EngineError(f"{self.name}: no reply within {timeout_s:.0f} s "
                                  f"(killed){self._stacks() if dumped else self._tail()}")
            poller = select.poll()  # not select(): a busy process's descriptors pass 1024
            poller.register(self._reply, select.POLLIN | select.POLLHUP)
            ready = poller.poll(min(wait or 1.0, 1.0) * 1000)
            chunk = os.read(self._reply, 1 << 20) if ready else None
            gone = self.proc is not None and self.proc.poll() is not None and not ready
            if chunk == b"" or gone:  # the pipe closed, or the child died (a grandchild
                code = self.proc.wait() if self.proc else None  # may hold the pipe open)
                self._kill_group()
                raise EngineError(f"{self.name}: the child exited (status {code}) without "
                                  f"replying{self._tail()}")
            if chunk is None:
                continue
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply: Json = json.loads(line)
        if not reply.get("ok"):
            raise EngineError(f"{self.name}: {reply.get('error')}{self._tail()}")
        return reply

    def _dump_stacks(self) -> bool:
        """Have every Python process of the group write its threads' stacks to the log
        before it dies (``PYTHONFAULTHANDLER`` is set in the child's environment, which
        SGLang's processes inherit; ``SIGABRT`` makes each dump its stacks and abort), so
        that an engine which did not reply shows where it waited; whether it was sent."""
        if self.proc is None or not group_alive(self.proc.pid):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGABRT)
        deadline = time.monotonic() + STACK_DUMP_GRACE_S
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            self.proc.poll()  # reap the child, so that an exited group reads as gone
            time.sleep(0.1)
        return True

    def _kill_group(self) -> bool:
        if self.proc is None:
            return False
        pgid = self.proc.pid
        alive = group_alive(pgid)
        if alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            time.sleep(2.0)  # let the driver release the GPU memory
        track_group(self.pgid_file, pgid, add=False)
        return alive

    def _stacks(self) -> str:
        """The engine log from the first stack dump on (:meth:`_dump_stacks`), at most
        :data:`STACK_DUMP_LINES` lines; its tail where no process wrote one."""
        if not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(lines)
                      if line.startswith("Fatal Python error")), None)
        if first is None:
            return self._tail()
        return (f"\n--- stacks from {self.log}\n"
                + "\n".join(lines[first : first + STACK_DUMP_LINES]))

    def _tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        tail = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "\n--- log tail " + str(self.log) + "\n" + "\n".join(tail)


class GpuBusy:
    """The share of time the GPU ran a kernel while a ``with`` block ran: NVML's
    utilization (each reading: the share of the driver's last sample period, a sixth of
    a second to a second, in which a kernel ran), read every ``period_s`` on a thread of
    its own and averaged. An engine whose scheduler thread cannot keep the GPU fed
    shows it here (stock SGLang at batch 64 on a small model, say). ``read`` returns one
    reading in percent; None (the default) reads the first visible GPU through NVML,
    and :attr:`summary` is None where NVML is not there (no GPU, no ``pynvml``)."""

    def __init__(self, period_s: float = GPU_BUSY_PERIOD_S,
                 read: Callable[[], float] | None = None) -> None:
        self._period = period_s
        self._read = read if read is not None else _nvml_reader()
        self._readings: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)

    def __enter__(self) -> GpuBusy:
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10 * self._period + 5)  # a hung NVML call: let it be

    def _run(self) -> None:
        assert self._read is not None
        while not self._stop.wait(self._period):
            try:
                self._readings.append(float(self._read()))
            except Exception:  # a reading that failed is not a reading
                continue

    @property
    def summary(self) -> Json | None:
        """``{"mean_pct", "readings"}``, or None without readings."""
        if not self._readings:
            return None
        return {"mean_pct": round(sum(self._readings) / len(self._readings), 1),
                "readings": len(self._readings)}


def _nvml_reader() -> Callable[[], float] | None:
    """NVML's GPU utilization of the first visible device, or None without NVML."""
    try:
        pynvml: Any = importlib.import_module("pynvml")  # SGLang's dependency on a GPU host
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
    except Exception:  # no pynvml, no driver, no device: not measured
        return None

    def read() -> float:
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    return read


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a process."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_cpu(pgid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """CPU seconds (user + system) each live process of group ``pgid`` has used so far,
    keyed ``"NAME PID"`` (``NAME``: the last part of the process's first argument, which
    is its title where it set one, e.g. SGLang's ``sglang::scheduler``; else its short
    name); empty where ``/proc`` is not there."""
    found: dict[str, float] = {}
    try:
        entries = [e for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return found
    for entry in entries:
        stat = _stat(entry)
        if stat is None or int(stat[1][2]) != pgid:  # ended meanwhile, or another group
            continue
        comm, fields = stat
        title = _cmdline(entry).replace(b"\0", b" ").split()
        name = os.path.basename(title[0].decode(errors="replace")) if title else comm
        found[f"{name} {entry.name}"] = _cpu_seconds(fields)
    return found


Reading = tuple[float, int, int, str]
"""One thread's reading: CPU seconds, voluntary and involuntary context switches, its
name (:func:`group_threads`)."""


def group_threads(pgid: int, proc: Path = Path("/proc")) -> dict[str, Reading]:
    """Every thread of process group ``pgid`` so far: ``(CPU seconds, voluntary context
    switches, involuntary ones, the thread's own name)`` keyed ``"NAME PID/TID"``
    (``NAME`` as in :func:`group_cpu`; a process's main thread has ``TID == PID``). A
    thread that waits for a lock (Python's GIL, say) gives up its core voluntarily; one
    preempted while runnable, involuntarily. The thread's name is its ``comm``: the
    capture's threads name themselves (``dmi-capture-dra``, ``dmi-sink-0``, ...), libzmq's
    and ClickHouse's threads too (``ZMQbg/IO/0``, ``ThreadPool``), other Python threads
    carry the process's. Empty where ``/proc`` is not there."""
    found: dict[str, Reading] = {}
    for key in group_cpu(pgid, proc):
        name, _, pid = key.rpartition(" ")
        try:
            tasks = [t for t in (proc / pid / "task").iterdir() if t.name.isdigit()]
        except OSError:
            continue
        for task in tasks:
            stat = _stat(task)
            switches = _switches(task)
            if stat is not None and switches is not None:
                found[f"{name} {pid}/{task.name}"] = (_cpu_seconds(stat[1]), *switches, stat[0])
    return found


def _switches(task: Path) -> tuple[int, int] | None:
    """A thread's ``voluntary_ctxt_switches`` and ``nonvoluntary_ctxt_switches``."""
    try:
        lines = task.joinpath("status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.partition(":")[::2] for line in lines)
    try:
        return (int(fields["voluntary_ctxt_switches"]),
                int(fields["nonvoluntary_ctxt_switches"]))
    except (KeyError, ValueError):
        return None


Readings = Mapping[str, Reading]
"""What :func:`group_threads` reads."""


def _thread_deltas(before: Readings,
                   after: Readings) -> Iterator[tuple[str, str, str, float, int, int, str]]:
    """``(process name, pid, tid, CPU seconds, voluntary, involuntary switches, thread
    name)`` each thread used between two :func:`group_threads` readings (a thread that
    started in between counts from zero; its name is the later reading's)."""
    for key, (cpu, vol, invol, thread) in after.items():
        was = before.get(key, (0.0, 0, 0, thread))
        name, _, ids = key.rpartition(" ")
        pid, _, tid = ids.partition("/")
        yield name, pid, tid, cpu - was[0], vol - was[1], invol - was[2], thread


def processes_between(before: Readings, after: Readings) -> list[Json]:
    """Per process, between two :func:`group_threads` readings: its main thread's CPU
    seconds and context switches, and the CPU seconds of all its other threads
    together (a thread that started in between counts from zero)."""
    procs: dict[str, Json] = {}
    for name, pid, tid, cpu, vol, invol, _ in _thread_deltas(before, after):
        row = procs.setdefault(pid, {"process": name, "pid": int(pid), "main_cpu_s": 0.0,
                                     "main_voluntary": 0, "main_involuntary": 0,
                                     "others_cpu_s": 0.0, "threads": 0})
        row["threads"] += 1
        if pid == tid:
            row.update(main_cpu_s=round(cpu, 2), main_voluntary=vol, main_involuntary=invol)
        else:
            row["others_cpu_s"] = round(row["others_cpu_s"] + cpu, 2)
    return sorted(procs.values(), key=lambda r: -(r["main_cpu_s"] + r["others_cpu_s"]))


def threads_between(before: Readings, after: Readings,
                    top: int = THREADS_REPORTED) -> list[Json]:
    """The ``top`` threads by CPU seconds used between two :func:`group_threads`
    readings (a thread that started in between counts from zero), each with its name
    and its context switches in that time."""
    rows: list[Json] = [{"process": name, "pid": int(pid), "tid": int(tid), "main": pid == tid,
                         "thread": thread, "cpu_s": round(cpu, 2), "voluntary": vol,
                         "involuntary": invol}
                        for name, pid, tid, cpu, vol, invol, thread
                        in _thread_deltas(before, after)]
    rows.sort(key=lambda r: -r["cpu_s"])
    return rows[:top]


def process_cpu(pid: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (0 when it is gone or
    ``/proc`` is not there)."""
    stat = _stat(proc / str(pid))
    return 0.0 if stat is None else _cpu_seconds(stat[1])


def process_minor_faults(pid: int, proc: Path = Path("/proc")) -> int:
    """Minor page faults process ``pid`` has taken so far (pages it touched for the first
    time, or again after they were unmapped; 0 when it is gone or ``/proc`` is not
    there)."""
    stat = _stat(proc / str(pid))
    return 0 if stat is None else int(stat[1][7])


def _stat(entry: Path) -> tuple[str, list[str]] | None:
    """A process's short name and its ``stat`` fields from the state on (field 3 of
    proc(5) is the first), or None when it cannot be read."""
    try:
        stat = entry.joinpath("stat").read_text()
    except OSError:
        return None
    comm, _, rest = stat.partition("(")[2].rpartition(")")
    fields = rest.split()
    return (comm, fields) if len(fields) >= 13 else None


def _cpu_seconds(fields: list[str]) -> float:
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (int(fields[11]) + int(fields[12])) / ticks


def cpu_between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each process used between two :func:`group_cpu` readings (a process
    that started in between counts from zero), most first."""
    spent = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def track_group(path: Path | None, pgid: int, *, add: bool) -> None:
    """Record (or forget) a child's process group in ``path``."""
    if path is None:
        return
    pids = [int(x) for x in path.read_text().split()] if path.exists() else []
    pids = [*pids, pgid] if add else [p for p in pids if p != pgid]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{p}\n" for p in pids))


ENGINE_MARKERS = (b"harness.engine",)
"""What an engine child's command line holds."""


def _leader_is_ours(pgid: int, markers: tuple[bytes, ...]) -> bool:
    """Whether the group's leader still runs a command line holding one of ``markers``
    (its id was not reused)."""
    cmdline = _cmdline(Path(f"/proc/{pgid}"))
    return any(m in cmdline for m in markers)


def _cmdline(process: Path) -> bytes:
    """The NUL-separated command line of the process whose ``/proc`` directory is
    ``process``; empty when it is gone or shows none (a kernel thread, a zombie)."""
    try:
        return (process / "cmdline").read_bytes()
    except OSError:
        return b""


def kill_leftovers(path: Path, markers: tuple[bytes, ...] = ENGINE_MARKERS) -> list[int]:
    """Kill the process groups an earlier invocation recorded in ``path`` and did not
    close (it was cut off), where the group's leader still runs one of our children
    (``markers``, default an engine child's); the groups killed."""
    try:
        recorded = [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        recorded = []
    killed = [g for g in recorded if group_alive(g) and _leader_is_ours(g, markers)]
    for pgid in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    if killed:
        time.sleep(3.0)  # let the driver release the GPU memory
    return killed


# -- structlog lines of the engine's log ------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PAIR = re.compile(r"""([A-Za-z_]\w*)=('[^']*'|"[^"]*"|\{[^}]*\}|\[[^\]]*\]|\S+)""")


def _value(raw: str) -> Any:
    if raw[:1] in "'\"" and raw[-1:] == raw[:1]:
        return raw[1:-1]
    for conv in (int, float):
        with contextlib.suppress(ValueError):
            return conv(raw)
    return {"True": True, "False": False, "None": None}.get(raw, raw)


def parse_log_events(text: str, events: Iterable[str]) -> dict[str, Json]:
    """The last occurrence of each structlog event in a log, its ``key=value`` pairs
    (console lines) or fields (JSON lines)."""
    wanted = set(events)
    found: dict[str, Json] = {}
    for line in _ANSI.sub("", text).splitlines():
        stripped = line.strip()
        if stripped.startswith("{"):
            with contextlib.suppress(ValueError):
                data = json.loads(stripped)
                if isinstance(data, dict) and data.get("event") in wanted:
                    found[str(data["event"])] = data
            continue
        for event in wanted:
            match = re.search(rf"\]\s+{re.escape(event)}(\s|$)", line)
            if match:
                pairs = _PAIR.findall(line[match.end():])
                found[event] = {k: _value(v) for k, v in pairs}
    return found


# -- the child ---------------------------------------------------------------------------------
def run_workload(engine: Any, wl: Mapping[str, Any]) -> Json:
    """Run one workload in waves; timings, counts and (when kept) outputs, with the
    engine processes' busiest threads (:func:`threads_between`), each process's main
    thread and other threads (:func:`processes_between`), the GPU's busy share
    (:class:`GpuBusy`) over the waves, and the full garbage collections of this process
    (the engine's tokenizer side) during them: ``gc_full_waves``, ``[wave, seconds]`` per
    wave with one (their seconds added)."""
    waves = max(int(wl.get("max_waves") or 1), 1)
    repeat = bool(wl.get("named_waves")) or float(wl.get("min_seconds") or 0.0) > 0 \
        or waves > 1
    res: Json = {"name": wl["name"], "timed": bool(wl.get("timed", True)), "waves": 0,
                 "seconds": 0.0, "wave_seconds": [], "requests": 0, "output_tokens": 0,
                 "hidden_state_values": 0, "outputs": [], "gc_full_waves": []}
    threads = group_threads(os.getpgid(0))
    pauses = GcPauses()
    pauses.start()
    try:
        with GpuBusy() as busy:
            _waves(engine, wl, res, waves, repeat, pauses=pauses)
    finally:
        pauses.stop()
    after = group_threads(os.getpgid(0))
    res["threads"] = threads_between(threads, after)
    res["processes"] = processes_between(threads, after)
    res["gpu_busy"] = busy.summary
    return res


def _waves(engine: Any, wl: Mapping[str, Any], res: Json, waves: int, repeat: bool, *,
           pauses: GcPauses) -> None:
    """The workload's waves into ``res``, until ``max_waves`` or ``min_seconds``."""
    while True:
        rids = wl["rids"] if not repeat else [f"{r}.w{res['waves']}" for r in wl["rids"]]
        args: Json = {"sampling_params": wl["sampling_params"], "rid": rids}
        if "prompts" in wl:  # text prompts (a checkpoint with a tokenizer)
            args["prompt"] = wl["prompts"]
        else:
            args["input_ids"] = wl["input_ids"]
        if wl.get("return_hidden_states"):
            args["return_hidden_states"] = True
        count, seconds = pauses.collections[2], pauses.seconds[2]
        started = time.perf_counter()
        outs = engine.generate(**args)
        elapsed = time.perf_counter() - started
        if pauses.collections[2] != count:
            res["gc_full_waves"].append([res["waves"], pauses.seconds[2] - seconds])
        res["waves"] += 1
        res["seconds"] += elapsed
        res["wave_seconds"].append(elapsed)
        for out in outs if isinstance(outs, list) else [outs]:
            meta = out["meta_info"]
            res["hidden_state_values"] += _count(meta.pop("hidden_states", None))
            res["requests"] += 1
            res["output_tokens"] += int(meta["completion_tokens"])
            if wl.get("keep_outputs", True):
                res["outputs"].append({
                    "id": meta["id"], "output_ids": list(out["output_ids"]),
                    "prompt_tokens": meta["prompt_tokens"],
                    "completion_tokens": meta["completion_tokens"], "text": out.get("text"),
                    "num_retractions": meta.get("num_retractions")})
        if res["waves"] >= waves or res["seconds"] >= float(wl.get("min_seconds") or 0.0):
            return


PROFILE_WAIT_S = 300.0
"""Longest wait for the profiler's trace file after the profiled wave."""


def profile_workload(engine: Any, wl: Mapping[str, Any], out_dir: Path, steps: int) -> Json:
    """One wave of ``wl`` with ``steps`` forwards profiled (see the module docstring)."""
    from harness.trace import summarize_trace

    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.trace.json*"))
    engine.start_profile(output_dir=str(out_dir), num_steps=steps, activities=["CPU", "GPU"],
                         with_stack=True, record_shapes=False)
    ran = run_workload(engine, {**wl, "min_seconds": 0, "max_waves": 1})
    ran.pop("outputs", None)
    try:
        path = _new_file(out_dir, before)
    except TimeoutError:
        engine.stop_profile()  # fewer forwards than asked for: the profiler still runs
        raise
    return {"run": ran, "trace": str(path), "trace_bytes": path.stat().st_size,
            "summary": summarize_trace(path)}


def _new_file(directory: Path, before: set[Path]) -> Path:
    """The trace file that appeared in ``directory``, once its size stopped changing."""
    deadline = time.monotonic() + PROFILE_WAIT_S
    sizes: dict[Path, int] = {}
    while time.monotonic() < deadline:
        for path in set(directory.glob("*.trace.json*")) - before:
            size = path.stat().st_size
            if size and sizes.get(path) == size:
                return path
            sizes[path] = size
        time.sleep(1.0)
    msg = f"no trace file appeared in {directory} within {PROFILE_WAIT_S:.0f} s"
    raise TimeoutError(msg)


def _count(value: Any) -> int:
    """Numbers in SGLang's nested ``hidden_states`` lists."""
    if value is None:
        return 0
    if isinstance(value, int | float):
        return 1
    if hasattr(value, "numel"):
        return int(value.numel())
    if value and isinstance(value[0], int | float):
        return len(value)
    return sum(_count(v) for v in value)


def _env_info() -> Json:
    import importlib.metadata as md

    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "sglang": md.version("sglang"), "dmi_sglang": md.version("dmi-sglang"),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _send(reply: Any, data: Json) -> None:
    reply.write(json.dumps(data, default=str) + "\n")
    reply.flush()


def _serve(spec: Json, reply: Any) -> None:
    """Build the engine and answer commands; a failure is answered before the engine is
    shut down (a shutdown that hangs must not swallow it)."""
    started = time.perf_counter()
    module, _, name = spec.get("factory", "sglang:Engine").partition(":")
    engine = None
    try:
        engine = getattr(importlib.import_module(module), name)(**spec["engine"])
        info = engine.get_server_info()
        _send(reply, {"ok": True, "event": "ready", "startup_s": time.perf_counter() - started,
                      "env_info": _env_info(),
                      "max_total_num_tokens": info.get("max_total_num_tokens")})
        _commands(engine, reply)
    except BaseException as exc:  # every failure reaches the parent as data, first
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        print(error, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            _send(reply, {"ok": False, "error": error})
        raise
    finally:
        if engine is not None:
            engine.shutdown()
    _send(reply, {"ok": True, "event": "shut down"})


def _commands(engine: Any, reply: Any) -> None:
    """Answer commands read from stdin until ``shutdown`` (or the parent closes it)."""
    def send(data: Json) -> None:
        _send(reply, {"ok": True, **data})

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "run":
            send(run_workload(engine, command["workload"]))
        elif op == "profile":
            send(profile_workload(engine, command["workload"], Path(command["dir"]),
                                  int(command["steps"])))
        elif op == "d2h":
            from harness.bounds import measure_d2h_bps

            send({"d2h_bps": measure_d2h_bps()})
        elif op == "freeze_gc":
            t0 = time.perf_counter()
            engine.freeze_gc()
            engine.get_server_info()  # the scheduler answers after its own freeze
            send({"frozen": True, "seconds": time.perf_counter() - t0})
        elif op == "stop":
            t0 = time.perf_counter()
            if hasattr(engine, "dmi_stop_monitoring"):  # DMIEngine
                engine.dmi_stop_monitoring()
                run_id = engine.dmi_run_id
            else:
                engine.collective_rpc("dmi_stop_monitoring")
                run_id = os.environ.get("DMX_MODEL_ID", "")
            send({"stop_s": time.perf_counter() - t0, "run_id": run_id})
        elif op == "shutdown":
            return
        else:
            raise ValueError(f"unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.engine SPEC FD``: serve commands until ``shutdown``."""
    spec_path, fd = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    # no core files: SIGABRT (the stacks of an engine that overran) must not leave
    # gigabytes of an engine's memory behind; SGLang's processes inherit the limit
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with os.fdopen(int(fd), "w") as reply:
        try:
            _serve(spec, reply)
        except BaseException:  # already answered and logged by _serve
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
