"""``python -m harness copies``: how long a small device-to-host copy waits behind large ones.

SGLang's scheduler brings each step's sampled tokens to the host and waits for them. The
capture's drain moves hundreds of MB a decode window with device-to-host copies on its
own stream (one copy of the whole window's rows a flush). Where the copy engine runs
copies in the order they were queued, across streams, a step's small copy waits for the
large copy queued before it, and the step with it.

This measures that wait. A "drain" thread copies ``--bulk-mb`` of device memory into
page-locked host memory again and again through the drain's own copy path
(:class:`~dmi_sglang.adapters.transport.DeviceOps`, on its own stream, with the
``DMX_DRAIN_COPY_*`` settings of the variant), cut into pieces of at
most P MiB (``--pieces-mb``; 0: one copy), with at most F pieces queued ahead of the copy
engine (``--in-flight``; 0: no limit; the thread waits for the oldest piece before it
queues one more) and waiting for the last piece of each round, as the drain waits for
its fence. Meanwhile the main thread (the "scheduler") queues every ``--period-ms`` a
copy of 64 int64 on another stream and waits for it. Per variant, first without the
drain: the small copy's latency (median, p99, max, µs) as the measuring thread saw it and
on the device (CUDA events around it on its stream: from the stream reaching it to its
end, so the thread's waits for the GIL after queueing it are left out), and the copying
thread's rate (GB/s).
A copy engine that lets the small copy through between another stream's pieces shows
latencies near the idle row's once pieces are small; one that does not shows them only
with few pieces in flight.

``--kernel-programs N,...`` adds one variant per N where the "drain" copies each round
with a kernel of N programs instead (``dmi_sglang.adapters.transport.kernel_copy``, what
``DMX_DRAIN_COPY_KERNEL`` uses: the GPU's cores store into the page-locked buffer; the copy
engine is not used), to see whether that leaves the small copy's latency at the idle row's
and what rate it reaches. ``--gap-pieces-mb P,...`` adds one variant per P where a
tiny kernel follows each piece of P MiB on the copying stream (``DMX_DRAIN_COPY_GAPS``):
while it runs that stream has no copy queued, which may let the copy engine serve the
small copy in between.

``--busy-ms M`` asks what the copies cost a scheduler whose Python is the bottleneck,
with no drain Python beside it: after the probes of each variant (the idle row too), the
main thread does ``--busy-forwards`` forwards of about M ms of Python work each (the work
of ``python -m harness hooks --busy``: short loops and small torch calls that release the
GIL, never a sleep), and the row gets its time a forward, the part of it on the CPU, and
its voluntary context switches a forward. The copying thread takes the GIL only to queue
a round and sleeps while it waits for it, so a forward slower than the idle row's, on the
CPU, is the host's memory and caches shared with the copies' writes, not the GIL.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dmi_sglang.adapters.transport import DeviceOps
from dmi_sglang.adapters.transport.kernel_copy import warm_up
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import UnsupportedConfigurationError
from harness.micro_hooks import BusyWork
from harness.micro_transport import BackgroundThread, p50_p99_max
from harness.results import Json, run_benchmark

__all__ = ["BulkCopier", "main", "no_suggestion_reason", "small_copy_latencies", "suggested_env",
           "variants"]

PROBE_ELEMENTS = 64
"""The small copy: a decode batch's sampled token ids (64 int64)."""

SUGGEST_P99_US = 1000.0
"""The small copy's p99 (as its thread saw it) a suggested variant keeps under: well
within one stock decode step (2.7 ms at batch 64 on Qwen3-0.6B)."""

SUGGEST_COMPUTE_SLOWDOWN = 1.05
"""The most a suggested variant may slow the probe's matmul (its device time, median)
against the idle row: the copy kernel's programs share the GPU with the model's."""

COMPUTE_SHAPES = {"cuda": (64, 1024, 32768), "cpu": (64, 128, 512)}
"""``m, k, n`` of the matmul timed beside each small copy, on its own stream: on the GPU
a decode step's memory-bound shape (64 rows by a 1024 x 32768 bf16 weight, 64 MiB), on
CPU a small one (the dry run)."""

SUGGEST_RATE_SHARE = 0.95
"""Variants within this share of the best qualifying rate count as equally fast; the
first measured of them (whole and larger pieces first, kernels by fewer programs) wins."""


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 0:
        msg = f"{text!r}: expected integers >= 0 separated by commas, e.g. 0,64,8"
        raise argparse.ArgumentTypeError(msg)
    return values


def variants(pieces_mb: Sequence[int], in_flight: Sequence[int]) -> list[tuple[int, int]]:
    """The (piece MiB, pieces in flight) pairs measured, in order: each piece size with
    each in-flight limit; a whole copy (piece 0) is one piece, so only with no limit."""
    out: list[tuple[int, int]] = []
    for piece in pieces_mb:
        for flight in in_flight if piece else (0,):
            if (piece, flight) not in out:
                out.append((piece, flight))
    return out


def _event(stream: torch.cuda.Stream | None, *, timing: bool = False) -> torch.cuda.Event | None:
    if stream is None:
        return None
    # blocking: a wait sleeps (as the drain's fences do) instead of spinning a core
    event = torch.cuda.Event(blocking=True, enable_timing=timing)  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def _wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()


class BulkCopier(BackgroundThread):
    """The drain's copies: rounds of ``src`` -> ``dst`` on the drain's own stream, made by
    the transport's own copy path (:class:`~dmi_sglang.adapters.transport.DeviceOps`, set
    as the ``DMX_DRAIN_COPY_*`` settings of the variant set it: pieces, pieces ahead, a
    copy kernel, gaps), each round waited for through a fence, as the drain waits before
    it reads a window flush; :attr:`copied` bytes in :attr:`seconds`. An exception of
    the thread is kept in :attr:`error` (and raised again when the block exits)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, piece_bytes: int,
                 in_flight: int, *, programs: int = 0, gaps: bool = False) -> None:
        super().__init__("bulk-copier", 0.0)
        self._src, self._dst = src, dst
        self._ops = DeviceOps(src.device, copy_piece_bytes=piece_bytes,
                              copies_ahead=in_flight, copy_kernel_programs=programs,
                              copy_gaps=gaps)
        self.copied = 0
        self.seconds = 0.0
        self.rounds = 0
        self.error: BaseException | None = None

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.error is not None and exc[0] is None:  # the block's own error goes first
            raise RuntimeError(f"the copying thread failed: {self.error!r}") from self.error

    @property
    def alive(self) -> bool:
        """True while the thread copies (not failed, not stopped)."""
        return self.error is None and self._thread.is_alive()

    @property
    def pieces(self) -> int:
        """Device-to-host copies queued so far (a round in pieces counts each)."""
        return self._ops.copy_pieces

    def _run(self) -> None:
        try:
            self._copy_rounds()
        except BaseException as exc:  # kept for the measuring thread, raised at exit
            self.error = exc

    def _copy_rounds(self) -> None:
        ops, src, dst = self._ops, self._src, self._dst
        started = time.perf_counter()
        while not self._stop.is_set():
            ops.on_drain_stream((), lambda: ops.to_host(dst, src))
            ops.wait(ops.fence())  # the round's end: the drain's fence
            self.rounds += 1
            self.copied += src.numel() * src.element_size()
            self.seconds = time.perf_counter() - started


def small_copy_latencies(device: torch.device, probes: int, period_s: float,
                         ) -> tuple[list[float], list[float], list[float]]:
    """``probes`` copies of :data:`PROBE_ELEMENTS` int64 to the host on a stream of their
    own, one every ``period_s``: for each, the seconds from queueing it until the thread
    waited for it (the thread's own GIL waits included), the seconds the device took
    from reaching it on its stream to finishing it (CUDA events; none on CPU), and the
    seconds a matmul of :data:`COMPUTE_SHAPES` queued beside it on a third stream took
    (CUDA events; on CPU, run after the copy and timed by the thread)."""
    cuda = device.type == "cuda"
    src = torch.arange(PROBE_ELEMENTS, dtype=torch.int64, device=device)
    dst = torch.empty(PROBE_ELEMENTS, dtype=torch.int64, pin_memory=cuda)
    m, k, n = COMPUTE_SHAPES[device.type]
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    product = torch.empty(m, n, device=device, dtype=dtype)
    stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
    compute = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
    if cuda:
        torch.cuda.synchronize(device)  # the inputs are made before other streams read them
    host: list[float] = []
    on_device: list[float] = []
    matmul: list[float] = []
    due = time.perf_counter()
    for _ in range(probes):
        due += period_s
        time.sleep(max(0.0, due - time.perf_counter()))
        t0 = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            start = _event(stream, timing=True)
            dst.copy_(src, non_blocking=stream is not None)
            end = _event(stream, timing=True)
        m0 = m1 = None
        if compute is not None:  # beside the small copy, on the GPU at once
            with torch.cuda.stream(compute):
                m0 = _event(compute, timing=True)
                torch.matmul(a, b, out=product)
                m1 = _event(compute, timing=True)
        _wait(end)
        host.append(time.perf_counter() - t0)
        if start is not None and end is not None and m0 is not None and m1 is not None:
            on_device.append(start.elapsed_time(end) / 1e3)
            m1.synchronize()
            matmul.append(m0.elapsed_time(m1) / 1e3)
        else:
            c0 = time.perf_counter()
            torch.matmul(a, b, out=product)
            matmul.append(time.perf_counter() - c0)
        if int(dst[-1]) != PROBE_ELEMENTS - 1:
            msg = f"the small copy delivered {int(dst[-1])}, expected {PROBE_ELEMENTS - 1}"
            raise RuntimeError(msg)
        dst.zero_()
    return host, on_device, matmul


def busy_forwards(work: BusyWork, forwards: int) -> Json:
    """``forwards`` of ``work``'s forwards on this thread, one after another: the wall
    time a forward, the part of it on the CPU (the thread's CPU time) and its voluntary
    context switches (its waits: for the GIL, a lock, a sleep) a forward."""
    work.run()  # warm
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    cpu, t0 = time.thread_time(), time.perf_counter()
    for _ in range(forwards):
        work.run()
    wall = (time.perf_counter() - t0) / forwards
    on_cpu = (time.thread_time() - cpu) / forwards
    waits = (resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - switches) / forwards
    return {"busy_forward_us": wall * 1e6, "busy_cpu_us": on_cpu * 1e6, "busy_waits": waits}


def _no_busy() -> Json:
    return {"busy_forward_us": None, "busy_cpu_us": None, "busy_waits": None}


def suggested_env(rows: Sequence[Json], intact: Sequence[bool],
                  idle_compute_us: float | None = None) -> str | None:
    """The drain settings of the fastest variant that left the small copy's p99 under
    :data:`SUGGEST_P99_US`, brought every byte and (given the idle row's
    ``idle_compute_us``) slowed the matmul beside it by at most
    :data:`SUGGEST_COMPUTE_SLOWDOWN`, as ``DMX_*=V`` words for each that differs from an
    engine's default (``""``: the defaults); ``None`` when no variant did. ``rows`` are
    the variants' rows (the idle row left out), ``intact`` their checks, in order."""
    good = _qualifying(rows, intact, idle_compute_us)[-1]
    if not good:
        return None
    best = max(r["bulk_gbps"] for r in good)
    row = next(r for r in good if r["bulk_gbps"] >= SUGGEST_RATE_SHARE * best)
    ran = {"DMX_DRAIN_COPY_PIECE_MB": 0 if row["piece_mb"] == row["bulk_mb"] else row["piece_mb"],
           "DMX_DRAIN_COPY_AHEAD": row["in_flight"] or 0,
           "DMX_DRAIN_COPY_KERNEL": row["kernel_programs"] or 0,
           "DMX_DRAIN_COPY_GAPS": 1 if row.get("gaps") else 0}
    defaults = Settings().to_env()
    return " ".join(f"{name}={value}" for name, value in ran.items()
                    if str(value) != defaults[name])


def _qualifying(rows: Sequence[Json], intact: Sequence[bool],
                idle_compute_us: float | None) -> list[list[Json]]:
    """The variants left after each test :func:`suggested_env` applies, in order: every
    byte brought; the small copy's p99 under :data:`SUGGEST_P99_US`; (given the idle
    row's ``idle_compute_us``) the matmul slowed by at most
    :data:`SUGGEST_COMPUTE_SLOWDOWN`."""
    stages = [[r for r, ok in zip(rows, intact, strict=True) if ok and r["bulk_gbps"]]]
    stages.append([r for r in stages[-1]
                   if r["p99_us"] is not None and r["p99_us"] < SUGGEST_P99_US])
    if idle_compute_us is not None:
        stages.append([r for r in stages[-1]
                       if r["compute_p50_us"] <= SUGGEST_COMPUTE_SLOWDOWN * idle_compute_us])
    return stages


def no_suggestion_reason(rows: Sequence[Json], intact: Sequence[bool],
                         idle_compute_us: float | None = None) -> str:
    """Why :func:`suggested_env` found no variant (same arguments): each test it applies,
    with the number of variants that passed it and those before it."""
    stages = _qualifying(rows, intact, idle_compute_us)
    words = [f"{len(stages[0])} of {len(rows)} variants brought every byte",
             f"{len(stages[1])} of them kept the small copy under {SUGGEST_P99_US:,.0f} µs "
             "at p99"]
    if idle_compute_us is not None:
        words.append(f"{len(stages[2])} of those slowed the matmul beside it by at most "
                     f"{SUGGEST_COMPUTE_SLOWDOWN:g}x its idle {idle_compute_us:,.0f} µs")
    return "; ".join(words)


def _percentiles_us(seconds: list[float], prefix: str = "") -> Json:
    if not seconds:
        return {f"{prefix}p50_us": None, f"{prefix}p99_us": None, f"{prefix}max_us": None}
    p50, p99, top = p50_p99_max(seconds)
    return {f"{prefix}p50_us": p50 * 1e6, f"{prefix}p99_us": p99 * 1e6,
            f"{prefix}max_us": top * 1e6}


def _probe_row(host: list[float], on_device: list[float], matmul: list[float]) -> Json:
    return {**_percentiles_us(host), **_percentiles_us(on_device, "device_"),
            "compute_p50_us": p50_p99_max(matmul)[0] * 1e6, "probes": len(host)}


def run(args: argparse.Namespace, data: Json) -> None:
    """Measure the idle row and every variant; fill ``data``'s figures and checks."""
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    nbytes = args.bulk_mb << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    if cuda:
        torch.cuda.synchronize(dev)  # src is filled before another stream reads it
    period = args.period_ms / 1e3
    work = BusyWork(args.busy_ms * 1e-3) if args.busy_ms else None

    def busy() -> Json:
        return busy_forwards(work, args.busy_forwards) if work is not None else _no_busy()

    rows: list[Json] = []
    small_copy_latencies(dev, 10, period)  # warm-up
    rows.append({"variant": "idle", "piece_mb": None, "in_flight": None, "gaps": None,
                 "kernel_programs": None, "bulk_gbps": None,
                 "bulk_rounds": None, "rounds_while_probing": None,
                 **_probe_row(*small_copy_latencies(dev, args.probes, period)), **busy()})
    expected = src.cpu()  # what every variant's copies must bring
    intact: list[bool] = []
    kernels = sorted({n for n in args.kernel_programs if n})  # fewer programs first
    kernel_error = None
    if kernels:
        try:
            warm_up(dev, kernels[0])  # compiled before any clock starts (and checked)
        except UnsupportedConfigurationError as exc:  # the other variants still run
            kernel_error, kernels = str(exc), []
            print(f"copy kernel variants left out: {exc}")
    measured = ([(*v, 0, False) for v in variants(args.pieces_mb, args.in_flight)]
                + [(p, 0, 0, True) for p in dict.fromkeys(args.gap_pieces_mb) if p]
                + [(0, 0, n, False) for n in kernels])
    for piece_mb, flight, programs, gaps in measured:
        dst.zero_()  # each variant's own copies must bring every byte
        with BulkCopier(src, dst, piece_mb << 20, flight, programs=programs, gaps=gaps) as bulk:
            while bulk.rounds < 1 and bulk.alive:  # copies flow before the first probe
                time.sleep(0.001)
            before = bulk.rounds
            lat = small_copy_latencies(dev, args.probes, period)
            during = bulk.rounds - before if bulk.alive else 0
            beside = busy()  # the copies still flow
        intact.append(bool(torch.equal(dst, expected)))
        size = piece_mb or args.bulk_mb
        name = (f"kernel, {programs} programs" if programs else
                f"{size} MiB pieces" + (f", {flight} in flight" if flight else "")
                + (", gaps" if gaps else ""))
        rows.append({"variant": name, "piece_mb": size, "bulk_mb": args.bulk_mb,
                     "in_flight": flight or None, "gaps": gaps,
                     "kernel_programs": programs or None,
                     "bulk_gbps": bulk.copied / bulk.seconds / 1e9 if bulk.seconds else None,
                     "bulk_rounds": bulk.rounds, "rounds_while_probing": during,
                     **_probe_row(*lat), **beside})
    idle_compute = rows[0]["compute_p50_us"] if cuda else None
    suggested = suggested_env(rows[1:], intact, idle_compute)
    data["figures"] = {"rows": rows, "suggested_env": suggested}
    if suggested is None:
        data["figures"]["no_suggestion"] = no_suggestion_reason(rows[1:], intact, idle_compute)
    copying = [r["rounds_while_probing"] for r in rows[1:]]
    data["checks"] = {
        **({"copy_kernel_works": {
            "ok": kernel_error is None, "required": True, "error": kernel_error,
            "what": "the copy kernel compiled and copied exactly before its variants ran"}}
           if args.kernel_programs and any(args.kernel_programs) else {}),
        "bulk_copies_intact": {"ok": all(intact), "required": True, "per_variant": intact,
                               "what": "after each variant, the host buffer (zeroed before it) "
                                       "equals the device bytes"},
        "copying_while_probing": {"ok": all(n >= 1 for n in copying), "required": True,
                                  "rounds": copying,
                                  "what": "the copying thread finished rounds while the "
                                          "probes ran, in every variant"},
    }
    print(render(rows))
    if work is not None:
        print(render_busy(rows, args.busy_ms))
    print("suggested drain settings: " + (
        f"none ({data['figures']['no_suggestion']})" if suggested is None
        else suggested or "the defaults"))


def render(rows: list[Json]) -> str:
    """The table printed: the small copy's latency as the thread saw it and on the device
    (from its stream reaching it to its end), and the copying thread's rate."""
    head = (f"{'drain copies':30} {'small copy p50 µs':>18} {'p99':>8} {'max':>8} "
            f"{'on device p50 µs':>17} {'p99':>8} {'max':>8} {'drain GB/s':>11} "
            f"{'matmul µs':>10}")
    lines = [head, "-" * len(head)]

    def us(v: float | None, width: int) -> str:
        return f"{v:{width},.0f}" if v is not None else f"{'-':>{width}}"

    for r in rows:
        gbps = f"{r['bulk_gbps']:.1f}" if r["bulk_gbps"] else "-"
        lines.append(f"{r['variant']:30} {us(r['p50_us'], 18)} {us(r['p99_us'], 8)} "
                     f"{us(r['max_us'], 8)} {us(r['device_p50_us'], 17)} "
                     f"{us(r['device_p99_us'], 8)} {us(r['device_max_us'], 8)} {gbps:>11} "
                     f"{us(r['compute_p50_us'], 10)}")
    return "\n".join(lines)


def render_busy(rows: list[Json], busy_ms: float) -> str:
    """The ``--busy-ms`` table: a scheduler-like thread's forward beside each variant's
    copies, against the idle row."""
    idle = rows[0]["busy_forward_us"]
    head = (f"{'drain copies':30} {'busy forward µs':>16} {'x idle':>7} {'on CPU µs':>10} "
            f"{'off CPU µs':>11} {'waits':>6}")
    lines = [f"about {busy_ms:g} ms of scheduler-like Python work a forward, beside the copies",
             head, "-" * len(head)]
    for r in rows:
        wall, cpu = r["busy_forward_us"], r["busy_cpu_us"]
        lines.append(f"{r['variant']:30} {wall:16,.0f} {wall / idle:7.3f} {cpu:10,.0f} "
                     f"{max(0.0, wall - cpu):11,.0f} {r['busy_waits']:6.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every check passed."""
    p = argparse.ArgumentParser(prog="python -m harness copies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--bulk-mb", type=int, default=512, help="bytes of one drain round, MiB")
    p.add_argument("--pieces-mb", type=_positive_ints, default="0,128,32,8,2",
                   help="piece sizes, MiB (0: the round in one copy)")
    p.add_argument("--in-flight", type=_positive_ints, default="0,2",
                   help="pieces queued ahead of the copy engine (0: no limit); for piece "
                        "sizes above 0 (a whole copy is one piece)")
    p.add_argument("--gap-pieces-mb", type=_positive_ints, default="0",
                   help="per value P > 0 one more variant: pieces of P MiB, each followed by "
                        "a tiny kernel on the copying stream; 0: none")
    p.add_argument("--kernel-programs", type=_positive_ints, default="0",
                   help="per value N > 0 one more variant: each round copied by a kernel of "
                        "N programs (the GPU's cores, not the copy engine); 0: none")
    p.add_argument("--probes", type=int, default=400, help="small copies per variant")
    p.add_argument("--period-ms", type=float, default=2.7,
                   help="between two small copies (a stock decode step at batch 64)")
    p.add_argument("--busy-ms", type=float, default=0.0,
                   help="per variant, also time a scheduler-like thread's forwards of about "
                        "this many ms of Python work beside the copies (0: not measured)")
    p.add_argument("--busy-forwards", type=int, default=300,
                   help="forwards timed per variant with --busy-ms")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default $OUT/copies.json, else ./copies.json)")
    args = p.parse_args(argv)
    for name in ("bulk_mb", "probes", "period_ms", "busy_forwards"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{name.replace('_', '-')} {value}: expected a positive number")
    if not (math.isfinite(args.busy_ms) and 0 <= args.busy_ms <= 1000):
        p.error(f"--busy-ms {args.busy_ms}: expected 0 (off) to 1000")
    for name in ("pieces_mb", "gap_pieces_mb"):
        if max(getattr(args, name)) > args.bulk_mb:
            p.error(f"--{name.replace('_', '-')} {max(getattr(args, name))}: at most "
                    f"--bulk-mb {args.bulk_mb}")
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --device cpu for a dry run")
        return 2
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {args.device!r}: this machine has {torch.cuda.device_count()} "
                "CUDA device(s), cuda:0 to cuda:N-1")
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    settings = {**vars(args), "out": str(args.out), "device_name": device,
                "torch": torch.__version__, "python": sys.version.split()[0]}
    return run_benchmark("copies", settings, lambda data: run(args, data), args.out)
