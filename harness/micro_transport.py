"""Component benchmark of the capture transport: ``python -m harness transport``.

* overhead: the per-step cost of capture under CUDA-graph replay: a decoder-shaped stack
  (``--layers`` x ``--hidden``, bf16) replayed without capture points (baseline) and with
  them plus ``commit`` + ``seal``, for ``hidden-states`` and 7 hooks per layer at batch 1,
  8 and 64, a device sync after every step. Each repetition runs the blocks baseline,
  capture, baseline; its overhead is capture minus the mean of the two baselines; reported
  are the median (us per step) and the spread (max - min); also the scheduler thread's
  CPU time in ``commit`` + ``seal`` per step (median, ``host CPU µs``) and, with
  ``--profile``, a cProfile of one more block of capture steps, untimed (a profiled run
  is a diagnostic: ``python -m harness docs`` never shows it). Every row must reach the
  sink.
  Bound (:func:`harness.bounds.bound`): needed = the step's ring bytes / baseline step
  time, bound = min(1, D2H / needed); ``of_bound`` = (baseline / capture step time) / bound.
* drain: a steady stream of padded decode steps at Qwen3-0.6B sizes (the defaults) for
  ``hidden-states`` and ``sglang-full`` at batch 64: payload bytes/s from the first commit
  until ``stop()`` returns, and ``drain_counters()``. No rate is asked of it (steps are
  committed back to back), so it has no bound: ``of_d2h`` = drain B/s / D2H B/s. Also per
  run: records and batches per step, the drain thread's CPU per step, host bytes copied
  per captured byte (``host_copied_bytes / bytes``: what the host's CPU copied between the
  device and the sink), and the lateness of a Python thread that asks to wake every
  millisecond beside the drain (p50 / p99 / max: what the drain's GIL holding costs the
  scheduler thread).

D2H: pinned device-to-host copies probed before the first drain run and after each
repetition (CUDA only; None on CPU, where the replay is an eager forward: a dry run). The
result's ``bound`` is that of ``hidden-states`` at the largest batch; ``figures["table"]``
holds the rows ``python -m harness docs`` renders.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Self

import torch

from dmi_sglang.adapters.transport import Capturer, TorchCaptureTransport, TransportOptions
from dmi_sglang.domain.capacity import RingCapacity
from dmi_sglang.domain.hooks import CATALOG, ModelHooks, Selection, parse_selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import CommitPlan, make_plan
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.testing import MemorySink
from harness.bounds import bound, measure_d2h_bps, spread_of
from harness.constants import D2H_PROBE_BYTES
from harness.docs import table_lines
from harness.models import MODELS
from harness.results import Json, run_benchmark

Q06 = MODELS["0.6b"]

SEVEN = ("resid_pre", "ln1", "attn_out", "resid_mid", "ln2", "mlp_in", "mlp_out")
OVERHEAD_PRESETS = {"hidden-states": "hidden-states", "7-hooks": ",".join(SEVEN),
                    "last": "resid_pre:last"}
"""Selections of the overhead benchmark (``last``: every layer's residual stream kept in
device slots; no request finishes there, so it measures the per-step slot index)."""
DRAIN_PRESETS = ("hidden-states", "sglang-full")
DRAIN_BATCH = 64
ROWS = {True: "delivered", False: "LOST"}
TARGET_US = 100.0
"""Most capture overhead per decode step allowed for ``hidden-states`` at batch 64 (CUDA)."""
DENSE = frozenset(h.name for h in CATALOG if not h.attention_matrix) - {
    "pos_embed", "router_logits", "topk_ids", "topk_weights"}
"""The hooks a dense Qwen3 offers in SGLang."""


def model_shape(layers: int, hidden: int, vocab: int) -> ModelShape:
    """Qwen3-0.6B's proportions at ``layers`` x ``hidden`` (its own sizes: Qwen3-0.6B)."""
    return ModelShape(layers, hidden, max(hidden * Q06.heads // Q06.hidden, 1),
                      max(hidden * Q06.kv_heads // Q06.hidden, 1), Q06.head_dim,
                      hidden * Q06.intermediate // Q06.hidden, vocab)


def positive_ints(text: str) -> tuple[int, ...]:
    """An argument of positive integers separated by commas (``--batches``)."""
    values = tuple(int(x) for x in text.split(",") if x.strip().isdigit())
    if len(values) != len(text.split(",")) or min(values) <= 0:
        msg = f"{text!r}: expected positive integers separated by commas, e.g. 1,8,64"
        raise argparse.ArgumentTypeError(msg)
    return values


def preset_names(accepted: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type for ``--presets``: names of ``accepted`` separated by commas."""
    names = tuple(accepted)

    def parse(text: str) -> tuple[str, ...]:
        if unknown := [n for n in text.split(",") if n not in names]:
            msg = (f"unknown preset {', '.join(map(repr, unknown))}: accepted "
                   f"{', '.join(names)} (one or more, separated by commas)")
            raise argparse.ArgumentTypeError(msg)
        return tuple(text.split(","))

    return parse


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def stack(weights: list[torch.Tensor], cap: Capturer | None, x: torch.Tensor) -> torch.Tensor:
    """A decoder-shaped forward firing the seven per-layer capture points."""

    def point(name: str, layer: int, t: torch.Tensor) -> torch.Tensor:
        if cap is not None and cap.wants(name, layer):
            cap.capture(name, layer, t)
        return t

    def norm(t: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(t.dtype)

    for i in range(len(weights) // 2):
        h = point("ln1", i, norm(point("resid_pre", i, x)))
        x = point("resid_mid", i, x + point("attn_out", i, h @ weights[2 * i]))
        h = point("mlp_in", i, point("ln2", i, norm(x)))
        x = x + point("mlp_out", i, h @ weights[2 * i + 1])
    if cap is not None:
        cap.join()  # the forward's end (its residuals are never changed in place)
    return x


def replayer(weights: list[torch.Tensor], cap: Capturer | None,
             x: torch.Tensor) -> Callable[[], None]:
    """One step: a CUDA graph replay on CUDA, an eager forward on CPU."""

    def forward() -> None:
        with torch.no_grad():
            stack(weights, cap, x)

    if x.device.type != "cuda":
        return forward
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-ups: no step committed, nothing captured
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def decode_plans(sel: Selection, shape: ModelShape, bs: int,
                 n: int) -> tuple[list[CommitPlan], float]:
    """``n`` padded decode plans of ``bs`` requests, and what one cost to make (us)."""
    rids = [f"req-{i}" for i in range(bs)]
    started = time.perf_counter()
    plans = [make_plan(BatchLayout.decode(rids, [100 + s] * bs, padded_batch_size=bs), sel,
                       shape, padded=True) for s in range(n)]
    return plans, (time.perf_counter() - started) / max(n, 1) * 1e6


def engine_options(max_prefill_tokens: int) -> TransportOptions:
    """The transport's tuning from the ``DMX_DRAIN_*``, ``DMX_ARENA_SLOTS_MB``,
    ``DMX_TOPK_*``, ``DMX_GPU_PADDING_STRIP`` and ``DMX_GRAPH_SIDE_STREAM`` settings in
    the environment, read as an engine reads them (their defaults when unset); see
    :func:`engine_env`."""
    return TransportOptions.for_engine(Settings.from_env(),
                                       max_prefill_tokens=max_prefill_tokens)


def engine_env() -> dict[str, str]:
    """The settings :func:`engine_options` read from the environment, for the result's
    ``settings.env``."""
    return {k: v for k, v in os.environ.items()
            if k.startswith(("DMX_DRAIN_", "DMX_TOPK_"))
            or k in ("DMX_ARENA_SLOTS_MB", "DMX_GPU_PADDING_STRIP", "DMX_GRAPH_SIDE_STREAM")}


def transport_for(args: argparse.Namespace, sel: Selection, shape: ModelShape, bs: int,
                  run_id: str, *, probe: Callable[[], bool] | None = None,
                  ) -> tuple[TorchCaptureTransport, MemorySink]:
    """A transport of ``--ring-mb`` into a counting :class:`MemorySink`, tuned by the
    environment's drain settings (:func:`engine_options`)."""
    sink = MemorySink(keep_records=False)
    transport = TorchCaptureTransport(
        capacity=RingCapacity.from_mb(args.ring_mb, args.ring_mb, 1 << 20), selection=sel,
        shape=shape, max_graph_batch=bs, sink=sink, run_id=run_id, device=args.device,
        options=engine_options(bs), capture_probe=probe)
    return transport, sink


def overhead(args: argparse.Namespace, preset: str, bs: int) -> Json:
    """Replay without vs with capture at one batch size (see the module docstring)."""
    dev = torch.device(args.device)
    shape = model_shape(args.layers, args.hidden, args.vocab)
    sel = parse_selection(OVERHEAD_PRESETS[preset]).resolve(
        ModelHooks("Bench", frozenset(SEVEN), args.layers))
    transport, sink = transport_for(args, sel, shape, bs, f"overhead-{preset}-{bs}")
    torch.manual_seed(0)
    weights = [torch.randn(args.hidden, args.hidden, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(2 * args.layers)]
    x = torch.randn(bs, args.hidden, device=dev, dtype=torch.bfloat16)
    base, cap = replayer(weights, None, x), replayer(weights, transport.capturer, x)
    blocks = args.reps + (1 if args.profile else 0)
    plans, plan_us = decode_plans(sel, shape, bs, blocks * (args.warmup + args.steps))
    done = 0

    def base_steps(n: int) -> None:
        for _ in range(n):
            base()
            _sync(dev)

    host_cpu: list[float] = []
    timing = [False]  # only the timed blocks' steps count in host_cpu

    def capture_steps(n: int) -> None:
        nonlocal done
        for _ in range(n):
            c0 = time.thread_time()
            transport.commit(plans[done], step=done + 1)
            c1 = time.thread_time()
            cap()
            c2 = time.thread_time()
            transport.seal()
            if timing[0]:
                host_cpu.append(time.thread_time() - c2 + c1 - c0)
            done += 1
            _sync(dev)

    def block(steps: Callable[[int], None]) -> float:
        steps(args.warmup)
        timing[0] = True
        started = time.perf_counter()
        steps(args.steps)
        elapsed = time.perf_counter() - started
        timing[0] = False
        return float(elapsed / args.steps * 1e6)

    bases, caps, overheads = list[float](), list[float](), list[float]()
    for _ in range(args.reps):
        before, captured, after = block(base_steps), block(capture_steps), block(base_steps)
        bases += [before, after]
        caps.append(captured)
        overheads.append(captured - (before + after) / 2)
    profile = None
    if args.profile:  # an untimed block of its own: the profiler slows what it watches
        profile = cProfile.Profile()
        profile.enable()
        capture_steps(args.steps)
        profile.disable()
    stats = transport.stop()
    expected = done * sum(seg.kept_rows for seg in plans[0].segments)
    return {"preset": preset, "batch": bs, "captures": len(sel.captures()),
        "step_bytes": plans[0].total_bytes, "base_us": statistics.median(bases),
        "base_spread": spread_of(bases), "capture_us": statistics.median(caps),
        "overhead_us": statistics.median(overheads),
        "overhead_spread_us": max(overheads) - min(overheads), "overheads_us": overheads,
        "make_plan_us": plan_us, "host_cpu_us": statistics.median(host_cpu) * 1e6,
        "profile": top_functions(profile) if profile is not None else None, "steps": done,
        "rows": stats.rows, "rows_expected": expected,
        "delivered": stats.rows == expected == sink.rows, "stalls": stats.stalls,
        "stall_seconds": stats.stall_seconds, "ring_high_water": stats.ring_high_water}


def p50_p99_max(values: Iterable[float]) -> tuple[float, float, float]:
    """The median, the 99th percentile (nearest rank: the ``ceil(0.99 n)``-th smallest)
    and the largest of ``values`` (at least one)."""
    s = sorted(values)
    return statistics.median(s), s[-(-99 * len(s) // 100) - 1], s[-1]


class BackgroundThread:
    """A daemon thread running :meth:`_run` for the length of a ``with`` block (``_run``
    returns once ``_stop`` is set)."""

    def __init__(self, name: str, period_s: float) -> None:
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class LatenessProbe(BackgroundThread):
    """A Python thread that sleeps ``period_s`` in a loop and records how late it wakes:
    beside a thread that holds the GIL, the lateness is what that costs the others."""

    def __init__(self, period_s: float = 0.001) -> None:
        super().__init__("lateness-probe", period_s)
        self.late_s: list[float] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            due = time.perf_counter() + self._period
            time.sleep(self._period)
            self.late_s.append(max(0.0, time.perf_counter() - due))

    def summary(self) -> Json:
        """Lateness p50 / p99 / max in milliseconds, and the number of wake-ups."""
        p50, p99, top = p50_p99_max(self.late_s or [0.0])
        return {"wakeups": len(self.late_s), "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
                "max_ms": top * 1e3}


class SpinProbe(BackgroundThread):
    """A busy pure-Python thread (a stand-in for a serving scheduler's): it counts the
    slices of work it gets done. Its rate while something else runs in the process,
    against its rate alone, is the share of the GIL (and the CPU) left to it."""

    SLICE = 1000
    """Loop iterations per counted slice."""

    def __init__(self) -> None:
        super().__init__("spin-probe", 0.0)
        self.slices = 0

    def _run(self) -> None:
        total = 0
        while not self._stop.is_set():
            for k in range(self.SLICE):  # pure Python: it needs the GIL throughout
                total ^= k
            self.slices += 1

    def rate(self, seconds: float) -> float:
        """Slices per second over the next ``seconds`` (the caller sleeps meanwhile)."""
        before = self.slices
        time.sleep(seconds)
        return (self.slices - before) / seconds

    def taken_s(self, work: Callable[[], object], alone_rate: float) -> tuple[float, float]:
        """Run ``work``; its wall seconds, and the seconds of this thread's work it took
        (wall x the fraction of the rate it lost; below 0 when it ran faster: noise)."""
        before, started = self.slices, time.perf_counter()
        work()
        wall = time.perf_counter() - started
        rate = (self.slices - before) / wall if wall > 0 else alone_rate
        return wall, wall * (1.0 - rate / alone_rate) if alone_rate > 0 else 0.0


def drain(args: argparse.Namespace, preset: str, steps: int) -> Json:
    """``steps`` padded decode steps in a steady stream through the drain (module docstring)."""
    dev, bs = torch.device(args.device), DRAIN_BATCH
    shape = model_shape(args.layers, args.hidden, args.vocab)
    sel = parse_selection(preset).resolve(ModelHooks("Qwen3ForCausalLM", DENSE, args.layers))
    recording = [False]
    transport, sink = transport_for(args, sel, shape, bs, f"drain-{preset}",
                                    probe=lambda: recording[0])
    recording[0] = True  # fill the arena once, as capturing the decode graph would
    for hook, layer in sel.captures():
        row = shape.capture_row(sel, hook, layer)
        dtype: torch.dtype = getattr(torch, row.dtype.value.removeprefix("torch."))
        filled = torch.randint(0, 100, (bs, math.prod(row.dims)), device=dev).to(dtype)
        transport.capturer.capture(hook.name, layer, filled)
    transport.capturer.join()
    recording[0] = False
    plans, _ = decode_plans(sel, shape, bs, steps)
    _sync(dev)
    with LatenessProbe() as probe:
        started = time.perf_counter()
        for s, plan in enumerate(plans):
            transport.commit(plan, step=s + 1)
            transport.seal()
        stats = transport.stop()
        seconds = time.perf_counter() - started
    expected = len(plans) * bs * len(sel.captures())
    counters = dict(transport.drain_counters())
    n = max(len(plans), 1)
    return {"preset": preset, "batch": bs, "captures": len(sel.captures()), "steps": len(plans),
        "step_bytes": plans[0].total_bytes, "bytes": stats.bytes, "seconds": seconds,
        "bps": stats.bytes / seconds, "rows": stats.rows, "rows_expected": expected,
        "delivered": stats.rows == expected == sink.rows, "stalls": stats.stalls,
        "stall_seconds": stats.stall_seconds, "counters": counters,
        "records_per_step": counters["records"] / n, "batches_per_step": counters["batches"] / n,
        "drain_cpu_ms_per_step": counters["build_cpu_seconds"] / n * 1e3,
        "host_copies_per_byte": counters["host_copied_bytes"] / max(stats.bytes, 1),
        "lateness": probe.summary()}


def run(args: argparse.Namespace, data: Json) -> None:
    """Both measurements into ``data`` (figures, bound, checks); prints the tables."""
    dev = torch.device(args.device)
    rows = []
    for preset in args.presets:
        for bs in args.batches:
            rows.append(overhead(args, preset, bs))
            gc.collect()  # frees the previous transport's ring and staging
    for preset in DRAIN_PRESETS if args.warmup > 0 else ():  # warm-up runs, not reported
        drain(args, preset, args.warmup)
    probes = [_d2h(dev, args.d2h_bytes)]  # the bound brackets every repetition of the drain
    drains: dict[str, list[Json]] = {p: [] for p in DRAIN_PRESETS}
    for _ in range(args.reps):
        for preset in DRAIN_PRESETS:
            drains[preset].append(drain(args, preset, args.drain_steps or args.steps))
            gc.collect()
        probes.append(_d2h(dev, args.d2h_bytes))
    measured = [p for p in probes if p is not None]
    d2h = statistics.median(measured) if measured else None
    for r in rows:  # needed: the step's bytes at baseline speed (a decode step: a token each)
        r["bound"] = bound(captured_bytes_per_token=r["step_bytes"] / r["batch"],
                           stock_tok_s=r["batch"] / (r["base_us"] * 1e-6), d2h_bps=d2h)
        r["x_base"] = r["base_us"] / r["capture_us"]
        r["of_bound"] = r["x_base"] / r["bound"]["ratio"] if r["bound"]["ratio"] else None
    summary = {p: {"bps": (bps := statistics.median(r["bps"] for r in runs)), "runs": runs,
                   "spread": spread_of(r["bps"] for r in runs),
                   "of_d2h": bps / d2h if d2h else None} for p, runs in drains.items()}
    reason = None if d2h else "no CUDA device: the pinned device-to-host bound needs one"
    headline = max(rows, key=lambda r: (r["preset"] == "hidden-states", r["batch"]))
    data["bound"] = headline["bound"]
    table = [{"test": "overhead", "preset": r["preset"], "batch": r["batch"],
              "captures": r["captures"], "step MB": r["step_bytes"] / 1e6,
              "base µs": r["base_us"], "+capture µs": r["capture_us"],
              "overhead µs": r["overhead_us"], "spread µs": r["overhead_spread_us"],
              "host CPU µs": r["host_cpu_us"],
              "x base": r["x_base"], "need GB/s": r["bound"]["needed_bps"] / 1e9,
              "bound": r["bound"]["ratio"], "of bound": r["of_bound"], "stalls": r["stalls"],
              "rows": ROWS[r["delivered"]]} for r in rows]
    table += [{"test": "drain", "preset": p, "batch": DRAIN_BATCH,
               "captures": s["runs"][0]["captures"], "step MB": s["runs"][0]["step_bytes"] / 1e6,
               "GB/s": s["bps"] / 1e9, "spread": s["spread"], "of D2H": s["of_d2h"],
               "records/step": s["runs"][0]["records_per_step"],
               "drain CPU ms/step": statistics.median(
                   r["drain_cpu_ms_per_step"] for r in s["runs"]),
               "host copies/B": max(r["host_copies_per_byte"] for r in s["runs"]),
               "late p99 ms": max(r["lateness"]["p99_ms"] for r in s["runs"]),
               "stalls": max(r["stalls"] for r in s["runs"]),
               "rows": ROWS[all(r["delivered"] for r in s["runs"])]} for p, s in summary.items()]
    note = ((f"D2H {d2h / 1e9:.1f} GB/s (pinned, median of {len(measured)} probes, spread "
             f"{spread_of(measured):.2f})" if d2h else f"D2H none ({reason})") +
            f"; {args.layers} x {args.hidden}, median of {args.reps}; x base = base / capture "
            "step time, need = step bytes / base step time, bound = min(1, D2H / need), of "
            "bound = x base / bound; drain: steps back to back (no rate asked, no bound), of "
            f"D2H = GB/s / D2H; headline: {headline['preset']} at batch {headline['batch']}")
    print("\n".join(table_lines(table)) + f"\n{note}")
    for r in rows:
        if r["profile"]:
            print(f"-- profile of the capture steps: {r['preset']} at batch {r['batch']}\n"
                  f"{r['profile']}")
    data["figures"] = {"overhead": rows, "drain": summary, "table": table, "note": note,
                       "d2h": {"bps": d2h, "probes_bps": probes, "reason": reason,
                               "spread": spread_of(measured)}}
    data["checks"]["overhead_delivered"] = {
        "ok": all(r["delivered"] for r in rows), "required": True,
        "lost": [f"{r['preset']}@{r['batch']}" for r in rows if not r["delivered"]]}
    data["checks"]["drain_delivered"] = {"required": True, "ok": all(
        r["delivered"] for s in summary.values() for r in s["runs"])}
    target = [r["overhead_us"] for r in rows
              if r["preset"] == "hidden-states" and r["batch"] == 64]
    data["checks"]["hidden_states_bs64_overhead"] = {
        "ok": bool(target) and max(target) < TARGET_US, "target_us": TARGET_US,
        "required": dev.type == "cuda" and bool(target), "overhead_us": target}


def top_functions(profile: cProfile.Profile, n: int = 25) -> str:
    """The ``n`` functions with the most own time, as ``pstats`` prints them."""
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(n)
    return text.getvalue()


def _d2h(dev: torch.device, nbytes: int) -> float | None:
    return measure_d2h_bps(nbytes) if dev.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    """Run the transport benchmark; 0 when every required check passed, else 1."""
    p = argparse.ArgumentParser(prog="python -m harness transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=Q06.layers)
    p.add_argument("--hidden", type=int, default=Q06.hidden)
    p.add_argument("--vocab", type=int, default=Q06.vocab, help="final_logits width (drain)")
    p.add_argument("--batches", type=positive_ints, default="1,8,64", help="positive, e.g. 1,8,64")
    p.add_argument("--presets", type=preset_names(OVERHEAD_PRESETS),
                   default="hidden-states,7-hooks",
                   help=f"of {', '.join(OVERHEAD_PRESETS)} (default: hidden-states,7-hooks)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before each block")
    p.add_argument("--reps", type=int, default=3, help="repetitions (median and spread)")
    p.add_argument("--drain-steps", type=int, default=0, help="steps per drain run (0: --steps)")
    p.add_argument("--ring-mb", type=int, default=1024)
    p.add_argument("--profile", action="store_true",
                   help="profile one more block of capture steps (cProfile; printed, and in "
                        "the JSON); a diagnostic, not shown by python -m harness docs")
    p.add_argument("--d2h-bytes", type=int, default=D2H_PROBE_BYTES)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default $OUT/transport.json, else ./transport.json)")
    args = p.parse_args(argv)
    if min(args.layers, args.hidden, args.steps, args.reps, args.ring_mb) <= 0:
        p.error("--layers, --hidden, --steps, --reps and --ring-mb must be positive")
    if min(args.warmup, args.drain_steps) < 0:
        p.error("--warmup and --drain-steps must be at least 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --device cpu for a dry run")
        return 2
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    settings = {**vars(args), "out": str(args.out), "device_name": device,
                "env": engine_env(), "torch": torch.__version__,
                "python": sys.version.split()[0]}
    return run_benchmark("transport", settings, lambda data: run(args, data), args.out)
