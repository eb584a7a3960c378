"""Micro-benchmark of the capture transport (run on the GPU machine).

Measures, for a 28-layer model of hidden 1024 (bf16) replayed as a CUDA graph:

* the per-step cost of capture: graph replay WITHOUT capture points versus replay WITH
  them plus ``commit`` + ``seal`` (the strided arena -> ring copies), at batch 1, 8 and
  64, for the ``hidden-states`` preset (resid_pre: 28 captures) and 7 hooks per layer
  (196 captures); both with a device sync after every step ("sync", like a decode loop
  that waits for its tokens) and without ("pipelined");
* the host time of ``commit`` + ``seal`` per step, and what ``make_plan`` costs per step
  (the adapter pays it unless it caches plans);
* device-to-host throughput: a plain pinned copy (the ceiling) versus what the drain
  reaches (its own copies, and end to end until ``stop()`` returns, records included).

Every run checks that every captured row reached the sink. Output: a table on stdout and
JSON (``--out``, default ``$OUT/bench_transport.json`` when ``$OUT`` is set).

    python bench/bench_transport.py                    # H200: about 2-4 minutes
    python bench/bench_transport.py --device cpu --layers 2 --hidden 64 --steps 20 --reps 1
                                                       # logic dry run without a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from dmi_sglang.adapters.transport import Capturer, TorchCaptureTransport, TransportOptions
from dmi_sglang.domain.capacity import RingCapacity
from dmi_sglang.domain.hooks import ModelHooks, Selection, parse_selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import CommitPlan, make_plan
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.testing import MemorySink

SEVEN = ("resid_pre", "ln1", "attn_out", "resid_mid", "ln2", "mlp_in", "mlp_out")
PRESETS = {"hidden-states": "hidden-states", "7-hooks": ",".join(SEVEN)}
TARGET_US = 100.0


class BenchModel(torch.nn.Module):
    """Decoder-shaped stack: per layer norm, projection, residual add, norm, projection."""

    def __init__(self, weights: list[torch.Tensor], capturer: Capturer | None) -> None:
        super().__init__()
        self.w = weights
        self.cap = capturer

    def _c(self, name: str, layer: int, t: torch.Tensor) -> None:
        if self.cap is not None and self.cap.wants(name, layer):
            self.cap.capture(name, layer, t)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.w) // 2):
            self._c("resid_pre", i, x)
            h = self._norm(x)
            self._c("ln1", i, h)
            a = h @ self.w[2 * i]
            self._c("attn_out", i, a)
            x = x + a
            self._c("resid_mid", i, x)
            h = self._norm(x)
            self._c("ln2", i, h)
            self._c("mlp_in", i, h)
            m = h @ self.w[2 * i + 1]
            self._c("mlp_out", i, m)
            x = x + m
        return x


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _graph(model: BenchModel, x: torch.Tensor) -> Callable[[], None]:
    """A replay function: a CUDA graph on GPU, an eager forward on CPU (dry run)."""
    if x.device.type != "cuda":
        def eager() -> None:
            with torch.no_grad():
                model(x)
        return eager
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm-ups: no step committed, nothing captured
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        model(x)
    return graph.replay


def _plans(sel: Selection, shape: ModelShape, bs: int, n: int) -> tuple[list[CommitPlan], float]:
    rids = [f"req{i}" for i in range(bs)]
    t0 = time.perf_counter()
    plans = [
        make_plan(BatchLayout.decode(rids, [100 + s] * bs, padded_batch_size=bs), sel, shape,
                  padded=True)
        for s in range(n)
    ]
    return plans, (time.perf_counter() - t0) / n * 1e6


def _per_step(loop: Callable[[int], None], steps: int, dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    loop(steps)
    _sync(dev)
    return (time.perf_counter() - t0) / steps * 1e6


def bench_overhead(args: argparse.Namespace, preset: str, bs: int) -> dict[str, Any]:
    """Replay with vs without capture at one batch size; checks every row arrived."""
    dev = torch.device(args.device)
    shape = ModelShape(args.layers, args.hidden, max(args.hidden // 128, 1), 1, 128,
                       3 * args.hidden, 1000)
    hooks = ModelHooks("Bench", frozenset(SEVEN), args.layers)
    sel = parse_selection(PRESETS[preset]).resolve(hooks)
    sink = MemorySink(keep_records=False)
    transport = TorchCaptureTransport(
        capacity=RingCapacity.from_mb(args.ring_mb, args.ring_mb, 65536), selection=sel,
        shape=shape, max_graph_batch=bs, sink=sink, run_id=f"bench-{preset}-{bs}", device=dev,
        options=TransportOptions(max_prefill_tokens=bs),
    )
    torch.manual_seed(0)
    weights = [torch.randn(args.hidden, args.hidden, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(2 * args.layers)]
    x = torch.randn(bs, args.hidden, device=dev, dtype=torch.bfloat16)
    base = _graph(BenchModel(weights, None), x)
    cap = _graph(BenchModel(weights, transport.capturer), x)
    total = args.reps * 2 * (args.steps + args.warmup)
    plans, plan_us = _plans(sel, shape, bs, total)
    step = 0
    host = [0.0]

    def base_loop(sync: bool) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                base()
                if sync:
                    _sync(dev)
        return run

    def cap_loop(sync: bool) -> Callable[[int], None]:
        def run(n: int) -> None:
            nonlocal step
            for _ in range(n):
                t0 = time.perf_counter()
                transport.commit(plans[step], step=step + 1)
                t1 = time.perf_counter()
                cap()
                t2 = time.perf_counter()
                transport.seal()
                host[0] += (t1 - t0) + (time.perf_counter() - t2)
                step += 1
                if sync:
                    _sync(dev)
        return run

    result: dict[str, Any] = {"preset": preset, "batch": bs, "captures": len(sel.captures())}
    for mode, sync in (("sync", True), ("pipelined", False)):
        b, c = [], []
        for _ in range(args.reps):  # interleaved blocks against drift
            base_loop(sync)(args.warmup)
            b.append(_per_step(base_loop(sync), args.steps, dev))
            cap_loop(sync)(args.warmup)
            c.append(_per_step(cap_loop(sync), args.steps, dev))
        result[f"base_us_{mode}"] = statistics.median(b)
        result[f"capture_us_{mode}"] = statistics.median(c)
        result[f"overhead_us_{mode}"] = statistics.median(c) - statistics.median(b)
    result["host_commit_seal_us"] = host[0] / step * 1e6
    result["make_plan_us"] = plan_us
    stats = transport.stop()
    want_rows = step * bs * len(sel.captures())
    result.update(
        steps=step, rows=stats.rows, rows_expected=want_rows, rows_ok=stats.rows == want_rows,
        records=transport.drain_counters()["records"], stalls=stats.stalls,
        stall_seconds=stats.stall_seconds, ring_high_water=stats.ring_high_water,
    )
    return result


def bench_d2h(args: argparse.Namespace) -> dict[str, Any]:
    """Pinned-copy ceiling vs the drain, at the 7-hook batch-64 step size."""
    dev = torch.device(args.device)
    bs = 64
    step_bytes = bs * args.layers * len(SEVEN) * args.hidden * 2
    out: dict[str, Any] = {"step_bytes": step_bytes}
    for label, chunk in (("ceiling_step_gbps", step_bytes), ("ceiling_64mib_gbps", 64 << 20)):
        src = torch.empty(chunk, dtype=torch.uint8, device=dev)
        dst = torch.empty(chunk, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        n = max(4, (2 << 30) // chunk) if dev.type == "cuda" else 4
        dst.copy_(src, non_blocking=True)
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
        _sync(dev)
        out[label] = n * chunk / (time.perf_counter() - t0) / 1e9
        del src, dst
    shape = ModelShape(args.layers, args.hidden, max(args.hidden // 128, 1), 1, 128,
                       3 * args.hidden, 1000)
    sel = parse_selection(PRESETS["7-hooks"]).resolve(
        ModelHooks("Bench", frozenset(SEVEN), args.layers))
    sink = MemorySink(keep_records=False)
    transport = TorchCaptureTransport(
        capacity=RingCapacity.from_mb(args.ring_mb, args.ring_mb, 65536), selection=sel,
        shape=shape, max_graph_batch=bs, sink=sink, run_id="bench-d2h", device=dev,
        options=TransportOptions(max_prefill_tokens=bs),
    )
    weights = [torch.randn(args.hidden, args.hidden, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(2 * args.layers)]
    x = torch.randn(bs, args.hidden, device=dev, dtype=torch.bfloat16)
    cap = _graph(BenchModel(weights, transport.capturer), x)
    plans, _ = _plans(sel, shape, bs, args.d2h_steps)
    t0 = time.perf_counter()
    for s, plan in enumerate(plans):
        transport.commit(plan, step=s + 1)
        cap()
        transport.seal()
    stats = transport.stop()
    elapsed = time.perf_counter() - t0
    counters = transport.drain_counters()
    out.update(
        drain_end_to_end_gbps=stats.bytes / elapsed / 1e9,
        drain_copy_gbps=counters["d2h_bytes"] / max(counters["d2h_seconds"], 1e-9) / 1e9,
        drain_steps=len(plans), drain_bytes=stats.bytes, drain_records=counters["records"],
        drain_stalls=stats.stalls, drain_stall_seconds=stats.stall_seconds,
        drain_rows_ok=stats.rows == len(plans) * bs * len(sel.captures()),
    )
    return out


def _table(rows: list[dict[str, Any]], d2h: dict[str, Any]) -> str:
    head = (f"{'preset':<14}{'bs':>4}{'caps':>6}{'base':>9}{'+cap':>9}{'ovh':>8}"
            f"{'base~':>9}{'+cap~':>9}{'ovh~':>8}{'host':>8}{'plan':>8}{'stalls':>7}  rows")
    lines = ["per-step time in us: sync = device sync every step, ~ = pipelined;",
             "host = commit+seal CPU time; plan = make_plan CPU time (adapter side)", head]
    for r in rows:
        lines.append(
            f"{r['preset']:<14}{r['batch']:>4}{r['captures']:>6}{r['base_us_sync']:>9.1f}"
            f"{r['capture_us_sync']:>9.1f}{r['overhead_us_sync']:>8.1f}"
            f"{r['base_us_pipelined']:>9.1f}{r['capture_us_pipelined']:>9.1f}"
            f"{r['overhead_us_pipelined']:>8.1f}{r['host_commit_seal_us']:>8.1f}"
            f"{r['make_plan_us']:>8.0f}{r['stalls']:>7}  {'ok' if r['rows_ok'] else 'LOST'}")
    ok = "ok" if d2h["drain_rows_ok"] else "LOST"
    lines += [
        f"D2H pinned ceiling: {d2h['ceiling_step_gbps']:.1f} GB/s in copies of one step "
        f"({d2h['step_bytes'] / 1e6:.1f} MB), {d2h['ceiling_64mib_gbps']:.1f} GB/s in 64 MiB",
        f"drain: its copies {d2h['drain_copy_gbps']:.1f} GB/s; end to end (records built, "
        f"until stop returns) {d2h['drain_end_to_end_gbps']:.2f} GB/s; "
        f"stalls {d2h['drain_stalls']}; rows {ok}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 1 when rows were lost or the hidden-states target is missed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--presets", default="hidden-states,7-hooks")
    p.add_argument("--steps", type=int, default=200, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--reps", type=int, default=3, help="interleaved blocks (median taken)")
    p.add_argument("--ring-mb", type=int, default=1024)
    p.add_argument("--d2h-steps", type=int, default=300)
    p.add_argument("--out", default=None, help="JSON path (default $OUT/bench_transport.json)")
    args = p.parse_args(argv)
    _quiet()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --device cpu for a dry run")
        return 2
    rows = []
    for preset in args.presets.split(","):
        for bs in args.batches.split(","):
            rows.append(bench_overhead(args, preset, int(bs)))
            r = rows[-1]
            print(f"[{preset} bs {bs}] overhead {r['overhead_us_sync']:.1f} us/step (sync), "
                  f"{r['overhead_us_pipelined']:.1f} (pipelined), rows ok: {r['rows_ok']}",
                  file=sys.stderr, flush=True)
            gc.collect()  # frees the previous transport's ring and pinned staging
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    d2h = bench_d2h(args)
    print(_table(rows, d2h))
    target = [r for r in rows if r["preset"] == "hidden-states" and r["batch"] == 64]
    passed = all(r["overhead_us_sync"] < TARGET_US for r in target)
    lost = not all(r["rows_ok"] for r in rows) or not d2h["drain_rows_ok"]
    verdict = (f"hidden-states @ bs 64 overhead < {TARGET_US:.0f} us: "
               f"{'PASS' if passed else 'FAIL' if target else 'not measured'}; "
               f"rows: {'LOST' if lost else 'all delivered'}")
    print(verdict)
    env = {"torch": torch.__version__, "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    report = {"env": env, "args": vars(args), "overhead": rows, "d2h": d2h,
              "target_us": TARGET_US, "target_passed": passed, "rows_lost": lost}
    out = args.out or (os.path.join(os.environ["OUT"], "bench_transport.json")
                       if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
    return 1 if lost or (target and not passed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
