"""``python -m harness hooks``: the scheduler thread's time in the capture hooks, per forward.

A monitored SGLang engine runs its scheduler on one Python thread, and at batch 64 on
Qwen3-0.6B that thread is the bottleneck: every microsecond the runtime hooks spend per
forward is a microsecond of serving time. This benchmark drives the library's capture
session (:class:`~dmi_sglang.app.session.SchedulerMonitor`) and its transport the way
the SGLang adapter's hooks do, without SGLang and without a model: waves of ``--batch``
requests, each an eager prefill of ``--prompt-len`` tokens (every capture point fired
with a tensor of its real shape) and ``--output-len`` decode forwards as decode-graph
replays (the capture points were recorded once, into a real CUDA graph on a GPU, which
each decode forward replays between its commit and its seal, as SGLang does), the
requests finishing after the last one. Between forwards the thread sleeps until ``--step-ms``
has passed since the forward began (a stand-in for the GPU step and SGLang's own
Python, during which the drain thread runs), so the drain sees the capture rate of a
real run.

``--busy`` stands in for a scheduler that is the bottleneck (SGLang's at batch 64 on
Qwen3-0.6B) instead: between forwards the thread does a fixed amount of Python work
that releases the GIL at every small torch call, as SGLang's does (calibrated to take
about ``--step-ms`` alone), never sleeping, and the figures are the thread's time off
the CPU and its voluntary context switches per decode forward: its waits for the GIL
the drain holds, which a scheduler-bound server loses on top of the hooks' own time.
The work's own speed is not a figure: it follows the CPU's clock, which other load
moves.

It reports, per selection, the scheduler-thread microseconds per decode forward of
each hook (``requests``: the worker's batch hook; ``begin``: the forward starting,
finish notices; ``layout``: the ForwardBatch read into a layout; ``preflight``: the
padded plan checked against the ring; ``commit``: the plan committed; ``end``: the step
sealed), their sum, the same sum per prefill forward, the GPU time of one decode
graph replay (``replay GPU µs``: what the capture adds to each decode step on the GPU,
CUDA events around the replay; the graph holds nothing but the capture's own work) and
the thread's time launching it (``replay launch µs``, not counted in the hooks' sum: in
SGLang these nodes are part of the decode graph, so this bounds what they add to its
launch), the
drain thread's CPU per forward, and the lateness of a thread that asks to wake every
millisecond (the drain's hold on the GIL). Every row a complete capture of the captured
requests holds must reach the sink (``rows``: the domain's count,
:func:`~dmi_sglang.domain.bandwidth.capture_bytes`).

The drain runs with the engine's ``DMX_DRAIN_*``, ``DMX_ARENA_SLOTS_MB``,
``DMX_TOPK_*``, ``DMX_GPU_PADDING_STRIP`` and ``DMX_GRAPH_SIDE_STREAM`` settings from the
environment (``DMX_DRAIN_LINGER_US=20000 python -m harness hooks``), recorded in the
result's ``settings.env``.

``--cold-mb N`` writes N MiB of host memory between forwards, evicting the hooks' code
and data from the CPU's caches as SGLang's own work between two forwards does in a
server (where a decode step's hooks cost about twice what they cost here with warm
caches): a stand-in for that, to compare changes of the hooks with each other.

``--device cpu`` is a dry run (CPU tensor operations cost differently from CUDA
launches: compare selections with each other there, not with a GPU).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import resource
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import torch

from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch
from dmi_sglang.adapters.transport import TorchCaptureTransport
from dmi_sglang.app.session import SchedulerMonitor
from dmi_sglang.domain.bandwidth import capture_bytes
from dmi_sglang.domain.capacity import RingCapacity
from dmi_sglang.domain.hooks import (
    ModelHooks,
    RowBasis,
    Selection,
    parse_selection,
)
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.records import RunInfo
from dmi_sglang.domain.sampling import RequestSample
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.testing import MemorySink
from harness.docs import table_lines
from harness.micro_transport import (
    DENSE,
    Q06,
    BackgroundThread,
    LatenessProbe,
    engine_env,
    engine_options,
    model_shape,
    preset_names,
    top_functions,
)
from harness.results import Json, run_benchmark

PRESETS: dict[str, tuple[str, float]] = {
    "hidden-states": ("hidden-states", 1.0),
    "last": ("resid_pre:last", 1.0),
    "topk64": ("final_logits:topk(64)", 1.0),
    "sample0.1": ("hidden-states", 0.1),
    "sample0": ("hidden-states", 0.0),
    "sglang-full": ("sglang-full", 1.0),
}
"""Selections measured (``--presets``): a name, the hook selection and the request
sample rate, as in the serving benchmark's selective cells."""
PARTS = ("requests", "begin", "layout", "preflight", "commit", "end")
"""The hooks' parts, in the order a forward runs them."""
PREFILL_PARTS = ("requests", "begin", "commit", "captures", "end")
"""A prefill forward's parts: the batch hook, the forward starting (finish notices), the
layout read and its plan committed (with the reads of finished requests' ``last`` rows),
every capture point fired once with its prefill rows (the eager captures), the seal."""


class _Mode:
    """A ``ForwardMode`` as the adapter reads it."""

    def __init__(self, name: str) -> None:
        self.name = name


class _ForwardBatch:
    """The fields of SGLang's ``ForwardBatch`` the adapter reads."""

    def __init__(self, mode: str, rids: list[str], seq_lens: torch.Tensor,
                 prefix: list[int] | None = None, extend: list[int] | None = None) -> None:
        self.forward_mode = _Mode(mode)
        self.rids = rids
        self.seq_lens_cpu = seq_lens
        self.seq_lens = None
        self.seq_lens_sum = int(seq_lens.sum())
        self.extend_prefix_lens_cpu = prefix
        self.extend_prefix_lens = None
        self.extend_seq_lens_cpu = extend
        self.extend_seq_lens = None


class _Req:
    """A request as the session reads SGLang's ``Req``."""

    sampling_params = None

    def __init__(self, rid: str, prompt: int) -> None:
        self.rid = rid
        self.origin_input_ids = [0] * prompt
        self.output_ids: list[int] = []
        self.done = False

    def finished(self) -> bool:
        return self.done


class _Model:
    """Fires the capture points of a forward with tensors of their computed shapes."""

    def __init__(self, transport: TorchCaptureTransport, selection: Selection,
                 shape: ModelShape, *, token_rows: int, request_rows: int,
                 device: torch.device) -> None:
        self.capturer = transport.capturer
        self.tensors: dict[tuple[str, int], tuple[torch.Tensor, bool]] = {}
        for hook, layer in selection.capture_points():
            name = hook.name
            spec = shape.row(hook)
            by_token = hook.row_basis is RowBasis.TOKEN
            dtype = getattr(torch, spec.dtype.value.removeprefix("torch."))
            rows = token_rows if by_token else request_rows
            self.tensors[(name, layer)] = (
                torch.zeros((rows, *spec.dims), dtype=dtype, device=device), by_token)

    def fire(self, token_rows: int, request_rows: int) -> None:
        """Call every capture point as a forward of these rows would."""
        for (name, layer), (t, by_token) in self.tensors.items():
            self.capturer.capture(name, layer, t[: token_rows if by_token else request_rows])
        self.capturer.join()  # the forward's end (a model's capture points join there)


class BusyWork:
    """A scheduler thread's own Python between forwards, as a fixed amount of work: units
    of a short pure-Python loop and one small torch call (which releases the GIL and
    retakes it, as SGLang's calls do), never a sleep."""

    LOOP = 50
    """Pure-Python iterations per unit."""

    def __init__(self, step_s: float) -> None:
        self._a = torch.zeros(16)
        self._b = torch.zeros(16)
        self.units = 1
        unit_s = min(self._timed(2000) / 2000 for _ in range(3))
        self.units = max(1, round(step_s / unit_s))
        """Units per forward: ``step_s`` of work on an idle process."""

    def run(self) -> None:
        """One forward's work."""
        a, b, total = self._a, self._b, 0
        for _ in range(self.units):
            for k in range(self.LOOP):
                total ^= k
            torch.add(a, 1, out=b)

    def _timed(self, units: int) -> float:
        saved, self.units = self.units, units
        t0 = time.perf_counter()
        self.run()
        took = time.perf_counter() - t0
        self.units = saved
        return took


class _Waves:
    """One selection's session, transport and model, driven wave by wave."""

    def __init__(self, args: argparse.Namespace, preset: str,
                 busy: BusyWork | None = None) -> None:
        dev = torch.device(args.device)
        self.busy = busy
        self.evict = np.zeros(args.cold_mb << 20, dtype=np.uint8) if args.cold_mb else None
        """Written between forwards (``--cold-mb``), as SGLang's own work between two
        forwards evicts what the hooks touched from the CPU's caches."""
        self.forward_s = 0.0
        """Wall seconds of the decode forwards, each from its first hook to the end of the
        work after it (``--busy``)."""
        self.forward_cpu_s = 0.0
        """The thread's CPU seconds in them."""
        self.forward_waits = 0
        """The thread's voluntary context switches in them."""
        shape = model_shape(args.layers, args.hidden, args.vocab)
        text, rate = PRESETS[preset]
        sel = parse_selection(text).resolve(ModelHooks("Qwen3ForCausalLM", DENSE, args.layers))
        capturing = [False]
        self.args, self.preset, self.bs = args, preset, args.batch
        self.sink = MemorySink(keep_records=False)
        options = engine_options(self.bs * args.prompt_len)  # as an engine reads it
        self.transport = TorchCaptureTransport(
            capacity=RingCapacity.from_mb(args.ring_mb, args.ring_mb, 1 << 20),
            selection=sel, shape=shape, max_graph_batch=self.bs, sink=self.sink,
            run_id=f"hooks-{preset}", device=dev, options=options,
            capture_probe=lambda: capturing[0])
        self.monitor = SchedulerMonitor(
            run=RunInfo(f"hooks-{preset}", "bench", (), (), "t"), selection=sel, shape=shape,
            transport=self.transport, sink=self.sink, strip=True, sample=RequestSample(rate))
        self.model = _Model(self.transport, sel, shape, token_rows=self.bs * args.prompt_len,
                            request_rows=self.bs, device=dev)
        capturing[0] = True  # the decode graph's recording: every point writes the arena
        self.graph: torch.cuda.CUDAGraph | None = None
        if dev.type == "cuda":
            self.model.fire(self.bs, self.bs)  # a warm-up run of the recorded work
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.model.fire(self.bs, self.bs)
        else:
            self.model.fire(self.bs, self.bs)  # a CPU "recording" runs its ops at once
        capturing[0] = False
        self.replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        """CUDA events around each timed decode replay (read after the wave)."""
        self.replay_us: list[float] = []
        self.launch_s = 0.0
        """The scheduler thread's time launching the replays (not a hook's time)."""
        self.spent = dict.fromkeys(PARTS, 0.0)
        self.prefill_us: list[float] = []
        self.prefill_cpu_us: list[float] = []
        """The thread's CPU µs in each prefill forward's hooks (of its wall µs above)."""
        self.prefill_parts: dict[str, list[float]] = {k: [] for k in PREFILL_PARTS}
        self.decode_forwards = 0

    def wave(self, number: int) -> None:
        """A prefill forward and ``--output-len`` decode forwards of new requests."""
        args, bs, monitor = self.args, self.bs, self.monitor
        reqs = [_Req(f"wave{number:03d}-req{i:03d}-{self.preset}", args.prompt_len)
                for i in range(bs)]
        rids = [r.rid for r in reqs]
        clock = time.perf_counter
        self._evict()
        cpu = time.thread_time()
        marks = [clock()]
        started = marks[0]
        monitor.add_requests(reqs, frozenset())
        marks.append(clock())
        monitor.begin_forward()
        marks.append(clock())
        fb = _ForwardBatch("EXTEND", rids, torch.full((bs,), args.prompt_len),
                           [0] * bs, [args.prompt_len] * bs)
        monitor.commit_eager(layout_from_forward_batch(fb))
        marks.append(clock())
        self.model.fire(bs * args.prompt_len, bs)
        marks.append(clock())
        monitor.end_forward()
        marks.append(clock())
        self.prefill_us.append((marks[-1] - started) * 1e6)
        self.prefill_cpu_us.append((time.thread_time() - cpu) * 1e6)
        for part, t0, t1 in zip(PREFILL_PARTS, marks, marks[1:], strict=False):
            self.prefill_parts[part].append((t1 - t0) * 1e6)
        self._rest(started, args.step_ms * 4e-3, 4)
        for s in range(args.output_len):
            for r in reqs:
                r.output_ids.append(1)
            self.decode(reqs, _ForwardBatch("DECODE", rids,
                                            torch.full((bs,), args.prompt_len + 1 + s)))
        for r in reqs:
            r.done = True
        if self.replays:
            self.replays[-1][1].synchronize()
            self.replay_us += [a.elapsed_time(b) * 1e3 for a, b in self.replays]
            self.replays.clear()

    def decode(self, reqs: list[_Req], fb: _ForwardBatch) -> None:
        """One decode forward's hooks, each part timed, then the rest of the period."""
        monitor, bs, clock = self.monitor, self.bs, time.perf_counter
        self._evict()
        waits = _voluntary_switches()
        marks = [clock()]
        cpu = time.thread_time()
        monitor.add_requests(reqs, frozenset())
        marks.append(clock())
        monitor.begin_forward()
        marks.append(clock())
        layout = layout_from_forward_batch(fb, padded_batch_size=bs)
        marks.append(clock())
        monitor.graph_allowed(layout, bs)
        marks.append(clock())
        monitor.commit_graph(monitor.graph_plan(bs, functools.partial(_same, layout)))
        marks.append(clock())
        if self.graph is not None:  # the replay: not the hooks' time
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            self.graph.replay()
            end.record()
            self.replays.append((start, end))
        launch = clock() - marks[-1]
        self.launch_s += launch
        monitor.end_forward()
        marks.append(clock() - launch)  # the seal's own time
        for part, t0, t1 in zip(PARTS, marks, marks[1:], strict=False):
            self.spent[part] += t1 - t0
        self.decode_forwards += 1
        self._rest(marks[0], self.args.step_ms * 1e-3, 1)
        self.forward_s += time.perf_counter() - marks[0]
        self.forward_cpu_s += time.thread_time() - cpu
        self.forward_waits += _voluntary_switches() - waits

    def _evict(self) -> None:
        """``--cold-mb``: one pass over that much memory, on this thread alone (numpy's
        add runs no thread pool), before a forward's clock starts: the hooks' code and
        data leave the caches."""
        if self.evict is not None:
            np.add(self.evict, 1, out=self.evict)

    def _rest(self, started: float, period: float, forwards: int) -> None:
        """The rest of the step: ``forwards`` forwards' busy work, else a sleep until
        ``period`` passed since ``started``."""
        if self.busy is None:
            _pace(started, period)
            return
        for _ in range(forwards):
            self.busy.run()

    def reset(self) -> None:
        """Forget the warm-up's times."""
        self.spent = dict.fromkeys(PARTS, 0.0)
        self.prefill_us.clear()
        self.prefill_cpu_us.clear()
        for times in self.prefill_parts.values():
            times.clear()
        self.replay_us.clear()
        self.launch_s = 0.0
        self.decode_forwards = 0
        self.forward_s = self.forward_cpu_s = 0.0
        self.forward_waits = 0


class StackSampler(BackgroundThread):
    """Where the library's threads are: every ``period_s`` the innermost frames of each
    thread named ``dmi-*`` (the drain, the sink writers) are counted, as
    ``function (file:line)`` of the top frame under its two callers. A sampler, not a
    tracer: it only wakes while it can take the GIL, so a thread that holds the GIL
    long is seen less often than it runs; compare functions, not threads."""

    def __init__(self, period_s: float = 0.0005) -> None:
        super().__init__("stack-sampler", period_s)
        self.counts: dict[str, collections.Counter[str]] = {}
        self.samples = 0

    def _run(self) -> None:
        names: dict[int, str] = {}
        while not self._stop.wait(self._period):
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                name = names.get(ident)
                if name is None:
                    thread = next((t for t in threading.enumerate() if t.ident == ident), None)
                    name = names[ident] = thread.name if thread is not None else "?"
                if not name.startswith("dmi-"):
                    continue
                chain: list[str] = []
                f: types.FrameType | None = frame
                while f is not None and len(chain) < 3:
                    code = f.f_code
                    chain.append(f"{code.co_name} ({Path(code.co_filename).name}:{f.f_lineno})")
                    f = f.f_back
                self.counts.setdefault(name.rstrip("0123456789"), collections.Counter())[
                    " < ".join(chain)] += 1

    def top(self, n: int = 12) -> dict[str, list[tuple[str, float]]]:
        """Per thread (sink writers together), its ``n`` most seen stacks and their share
        of that thread's samples."""
        out = {}
        for name, counter in sorted(self.counts.items()):
            total = sum(counter.values())
            out[name] = [(stack, c / total) for stack, c in counter.most_common(n)]
        return out


def measure(args: argparse.Namespace, preset: str) -> Json:
    """One selection: a warm-up wave, then ``--waves`` timed ones; per forward figures."""
    busy = BusyWork(args.step_ms * 1e-3) if args.busy else None
    bench = _Waves(args, preset, busy)
    bench.wave(0)
    bench.reset()
    transport, monitor = bench.transport, bench.monitor
    before = transport.drain_counters()
    sampler = StackSampler() if args.sample else contextlib.nullcontext()
    # a busy thread's waits are the figure: no probe waking every millisecond beside it
    probe = LatenessProbe() if not busy else None
    with probe if probe is not None else contextlib.nullcontext(), sampler:
        for w in range(1, args.waves + 1):
            bench.wave(w)
        monitor.begin_forward()  # the last wave's finish notices
        monitor.abort_forward()
    after = transport.drain_counters()
    drain = {k: after[k] - before[k] for k in after}
    waits = bench.forward_waits / max(bench.decode_forwards, 1)
    forward_s = bench.forward_s / max(bench.decode_forwards, 1)
    off_cpu_s = (bench.forward_s - bench.forward_cpu_s) / max(bench.decode_forwards, 1)
    # the timed waves' figures, before an untimed profiled wave adds to the counts
    forwards, n = bench.decode_forwards, max(bench.decode_forwards, 1)
    per = {k: v / n * 1e6 for k, v in bench.spent.items()}
    prefill_us, replay_us, launch_s = list(bench.prefill_us), list(bench.replay_us), \
        bench.launch_s
    prefill_parts = {k: statistics.median(v) for k, v in bench.prefill_parts.items()}
    prefill_cpu_us = statistics.median(bench.prefill_cpu_us)
    profile = None
    if args.profile:  # one more wave of its own: the profiler slows what it watches
        profile = cProfile.Profile()
        profile.enable()
        bench.wave(args.waves + 1)
        profile.disable()
    stats = monitor.stop()
    text, rate = PRESETS[preset]
    captured = monitor.requests.captured_requests
    # each request: the prompt, then output_len decode forwards, the last one the overlap
    # scheduler's extra forward (its tokens: output_len)
    expected = capture_bytes(monitor.selection, monitor.shape,
                             [(args.prompt_len, args.output_len, True)] * captured).rows
    return {"preset": preset, "selection": text, "sample": rate, "batch": bench.bs,
            "decode_forwards": forwards, "parts_us": per,
            "decode_us": sum(per.values()), "prefill_us": statistics.median(prefill_us),
            "prefill_parts_us": prefill_parts, "prefill_cpu_us": prefill_cpu_us,
            "replay_gpu_us": statistics.median(replay_us) if replay_us else None,
            "replay_launch_us": launch_s / n * 1e6 if replay_us else None,
            "drain_cpu_us": drain["build_cpu_seconds"] / (n + args.waves) * 1e6,
            "drain": drain, "rows": stats.rows,
            "busy": {"units": busy.units, "forward_us": forward_s * 1e6,
                     "off_cpu_us": off_cpu_s * 1e6, "waits": waits} if busy else None,
            "rows_expected": expected, "sink_rows": bench.sink.rows,
            "delivered": stats.rows == expected == bench.sink.rows,
            "captured_requests": captured,
            "lateness": probe.summary() if probe is not None else None,
            "profile": top_functions(profile, 45) if profile else None,
            "stacks": sampler.top() if isinstance(sampler, StackSampler) else None}


def _same(layout: BatchLayout) -> BatchLayout:
    return layout


def _voluntary_switches() -> int:
    """The calling thread's voluntary context switches so far (its waits)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def _pace(started: float, period: float) -> None:
    left = started + period - time.perf_counter()
    if left > 0:
        time.sleep(left)


def run(args: argparse.Namespace, data: Json) -> None:
    """Every preset into ``data``; prints the table."""
    rows = [measure(args, p) for p in args.presets]
    table = [{"selection": r["preset"], **{f"{k} µs": r["parts_us"][k] for k in PARTS},
              "decode µs": r["decode_us"], "prefill µs": r["prefill_us"],
              "replay launch µs": r["replay_launch_us"], "replay GPU µs": r["replay_gpu_us"],
              "drain CPU µs": r["drain_cpu_us"],
              "late p99 ms": r["lateness"]["p99_ms"] if r["lateness"] else None,
              **({"off CPU µs": r["busy"]["off_cpu_us"],
                  "waits": r["busy"]["waits"]} if args.busy else {}),
              "rows": "delivered" if r["delivered"] else "LOST"} for r in rows]
    note = (f"{args.layers} x {args.hidden}, batch {args.batch}, {args.prompt_len} + "
            f"{args.output_len} tokens, {args.waves} timed waves, "
            + (f"about {args.step_ms} ms of busy scheduler work a forward (off CPU / "
               "waits: the thread's time off the CPU and its voluntary context switches, "
               "per decode forward)" if args.busy else
               f"a forward every {args.step_ms} ms")
            + "; µs of the scheduler thread per decode forward (prefill: "
            "per prefill forward); replay launch / GPU: the thread's time launching a graph of "
            "the capture's own work alone / its GPU time (median); "
            "drain CPU: per forward"
            + (f"; {args.cold_mb} MiB written between forwards (the caches evicted)"
               if args.cold_mb else ""))
    print("\n".join(table_lines(table)) + f"\n{note}")
    for r in rows:
        d = r["drain"]
        print(f"-- drain of the timed waves ({r['preset']}): device-to-host, direct and "
              f"staged {d['d2h_bytes'] / 1e9:.2f} GB, windows {d['window_bytes'] / 1e9:.2f} GB "
              f"in {d['window_flushes']:.0f} flushes; queueing copies "
              f"{d['d2h_call_seconds']:.3f} s, waiting for the drain's stream "
              f"{d['d2h_wait_seconds']:.3f} s (window copies included); the drain's CPU "
              f"{d['build_cpu_seconds']:.3f} s, of it appending to the window "
              f"{d['window_append_cpu_seconds']:.3f} s and flushing it "
              f"{d['window_flush_cpu_seconds']:.3f} s")
        parts = ", ".join(f"{k} {v:,.0f}" for k, v in r["prefill_parts_us"].items())
        print(f"-- prefill forward ({r['preset']}, median µs): {parts}; the thread's CPU "
              f"{r['prefill_cpu_us']:,.0f} of {r['prefill_us']:,.0f}")
        if r["profile"]:
            print(f"-- profile of one more wave: {r['preset']}\n{r['profile']}")
        for thread, stacks in (r["stacks"] or {}).items():
            print(f"-- where {thread} was ({r['preset']}, share of its samples)")
            for stack, share in stacks:
                print(f"  {share:6.1%}  {stack}")
    data["figures"] = {"hooks": rows, "table": table, "note": note}
    data["checks"]["rows_delivered"] = {"ok": all(r["delivered"] for r in rows),
                                        "required": True}


def main(argv: list[str] | None = None) -> int:
    """Run the hooks benchmark; 0 when every row was delivered."""
    p = argparse.ArgumentParser(prog="python -m harness hooks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--presets", type=preset_names(PRESETS),
                   default="hidden-states,last,topk64,sample0.1,sample0",
                   help=f"of {', '.join(PRESETS)}")
    p.add_argument("--layers", type=int, default=Q06.layers)
    p.add_argument("--hidden", type=int, default=Q06.hidden)
    p.add_argument("--vocab", type=int, default=Q06.vocab)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--waves", type=int, default=3, help="timed waves (one more untimed)")
    p.add_argument("--step-ms", type=float, default=3.0,
                   help="a decode forward's period (stock's step at batch 64: about 3 ms)")
    p.add_argument("--busy", action="store_true",
                   help="between forwards the thread works --step-ms of Python releasing "
                        "the GIL at each small torch call instead of sleeping (a "
                        "scheduler-bound server); reports its time off the CPU and its "
                        "waits")
    p.add_argument("--ring-mb", type=int, default=1024)
    p.add_argument("--cold-mb", type=int, default=0,
                   help="MiB of host memory written between forwards (0: none): the "
                        "hooks then run with the CPU's caches evicted, as in a server, "
                        "where SGLang's own work between forwards evicts them")
    p.add_argument("--profile", action="store_true",
                   help="profile one more wave per selection (cProfile of the scheduler "
                        "thread's calls, and from Python 3.12 on every other thread's "
                        "too; printed, and in the JSON), untimed")
    p.add_argument("--sample", action="store_true",
                   help="sample where the library's threads (drain, sink writers) are "
                        "during the timed waves (printed, and in the JSON)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default $OUT/hooks.json, else ./hooks.json)")
    args = p.parse_args(argv)
    if min(args.layers, args.hidden, args.vocab, args.batch, args.prompt_len,
           args.output_len, args.waves, args.ring_mb) <= 0 or args.step_ms < 0 or (
               args.cold_mb < 0):
        p.error("sizes, --waves and --ring-mb must be positive, --step-ms and --cold-mb at "
                "least 0")
    if args.busy and args.sample:
        p.error("--busy with --sample: the sampler takes the GIL every 0.5 ms beside the "
                "busy thread, whose waits are the figure; give one of them")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --device cpu for a dry run")
        return 2
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    settings = {**vars(args), "out": str(args.out), "device_name": device, "env": engine_env(),
                "torch": torch.__version__, "python": sys.version.split()[0]}
    return run_benchmark("hooks", settings, lambda data: run(args, data), args.out)
