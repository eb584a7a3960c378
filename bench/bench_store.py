"""Benchmark of the capture store: sustained ingest and readback latency.

Not a test. Run (the command docs/storage.md records):

    .venv/bin/python bench/bench_store.py --out docs/evidence/store-bench-cpu.json

Measures, on the embedded engine (chdb), in a scratch directory:

* insert paths of clickhouse-connect for one payload size (``Client.insert`` row- and
  column-oriented versus ``raw_insert`` of a Native block built by the sink's encoder);
* sustained ingest through :class:`ClickHouseSink` (``put`` ... ``flush``) for payloads
  of 16 KiB, 64 KiB, 256 KiB and 1 MiB with 1, 2 and 4 writer threads: MB/s, rows/s,
  CPU seconds per MB of the writer threads and of the whole process, and a GIL probe:
  how fast a pure-Python loop in another thread runs during ingest, relative to idle
  (what an SGLang scheduler thread would keep);
* readback latency of one request (28 layers of ``resid_pre``, 512 positions, hidden
  1024, bf16) through :class:`CaptureHandle`, cold (store opened by the call) and for a
  token range.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink, connect
from dmi_sglang.adapters.clickhouse._native import COLUMN_NAMES, encode_block
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind

HIDDEN = 1024  # Qwen3-0.6B
RESID = "blocks.hook_resid_pre"
MB = 1e6


def payload_pool(size: int, count: int = 64) -> list[bytes]:
    """Realistic bf16 activations (normal values), ``count`` distinct payloads."""
    gen = torch.Generator().manual_seed(size)
    n = size // 2
    return [
        torch.randn(n, generator=gen).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        for _ in range(count)
    ]


def make_records(size: int, total_bytes: int, layers: int = 28) -> list[CaptureRecord]:
    """Records of ``size`` payload bytes: ``size / (2 * HIDDEN)`` token rows each,
    layer after layer, request after request, as a drain would emit them."""
    pool = payload_pool(size)
    rows = max(1, size // (2 * HIDDEN))
    trailing = (HIDDEN,) if size >= 2 * HIDDEN else (size // 2,)
    out = []
    for i in range(max(1, total_bytes // size)):
        step, layer = divmod(i, layers)
        req, chunk = divmod(step, 64)
        start = chunk * rows
        out.append(
            CaptureRecord(
                "bench",
                f"req-{req}",
                RESID,
                layer,
                0,
                start,
                start + rows,
                "torch.bfloat16",
                (rows, *trailing),
                pool[i % len(pool)],
                i,
            )
        )
    return out


class GilProbe:
    """Counts iterations of a pure-Python loop in its own thread."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop.is_set():
            for _ in range(1000):
                pass
            self.count += 1

    def rate(self, seconds: float) -> float:
        """Loops per second while the caller sleeps (idle baseline)."""
        start = self.count
        time.sleep(seconds)
        return (self.count - start) / seconds

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_insert_paths(
    root: str, size: int, total: int, rows_per_insert: int
) -> list[dict[str, Any]]:
    """One client, one thread: the insert APIs clickhouse-connect offers."""
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=os.path.join(root, "paths"))
    ClickHouseSink(config).close()  # creates the tables
    client = connect(config)
    records = make_records(size, total)
    batches = [records[i : i + rows_per_insert] for i in range(0, len(records), rows_per_insert)]
    table = "default.offload"

    def rows(batch: list[CaptureRecord]) -> list[list[Any]]:
        return [
            [
                r.model_id,
                r.request_id,
                r.act_name,
                r.layer_no,
                r.shard_rank,
                r.start_token_idx,
                r.end_token_idx,
                r.dtype,
                list(r.shape),
                r.payload,
                r.seq,
            ]
            for r in batch
        ]

    paths: dict[str, Callable[[list[CaptureRecord]], None]] = {
        "insert(rows)": lambda b: client.insert(table, rows(b), column_names=COLUMN_NAMES),
        "insert(column_oriented=True)": lambda b: client.insert(
            table,
            [list(c) for c in zip(*rows(b), strict=True)],
            column_names=COLUMN_NAMES,
            column_oriented=True,
        ),
        "raw_insert(Native, own encoder)": lambda b: client.raw_insert(
            table, COLUMN_NAMES, (c for c in encode_block(b)), fmt="Native"
        ),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    try:
        for _ in range(3):  # rounds interleave the paths; the median run is reported
            for name, insert in paths.items():
                client.command(f"TRUNCATE TABLE {table}")  # no merges of earlier trials
                os.sync()
                caller = time.thread_time()
                wall, cpu = timed(lambda insert=insert: [insert(b) for b in batches])
                caller = time.thread_time() - caller
                runs[name].append(
                    {
                        "path": name,
                        "payload_bytes": size,
                        "rows_per_insert": rows_per_insert,
                        "MB": total / MB,
                        "MB_per_s": total / MB / wall,
                        "process_cpu_s_per_MB": cpu / (total / MB),
                        "caller_thread_cpu_s_per_MB": caller / (total / MB),
                    }
                )
    finally:
        client.close()
        shutil.rmtree(config.path, ignore_errors=True)
    return [median_of(r) for r in runs.values()]


def bench_ingest(
    root: str,
    size: int,
    total: int,
    writers: int,
    *,
    batch_mb: int = 0,
    probe: GilProbe | None = None,
) -> dict[str, Any]:
    """Sustained ingest through the sink: put everything (28 records per step), then
    flush. With ``probe``, also how fast a Python thread ran meanwhile vs. idle."""
    path = os.path.join(root, f"ingest-{size}-{writers}")
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=path)
    records = make_records(size, total)
    encode_cpu = time.thread_time()
    for i in range(0, len(records), 4096):
        encode_block(records[i : i + 4096])
    encode_cpu = time.thread_time() - encode_cpu
    os.sync()  # do not pay the previous run's writeback
    sink = ClickHouseSink(config, writers=writers, batch_mb=batch_mb)
    idle = probe.rate(0.5) if probe else 0.0
    try:
        start_count = probe.count if probe else 0
        main_cpu = time.thread_time()

        def ingest() -> None:
            for i in range(0, len(records), 28):  # one step: 28 layers
                sink.put(records[i : i + 28])
            sink.flush()

        wall, cpu = timed(ingest)
        main_cpu = time.thread_time() - main_cpu
        probed = (probe.count - start_count) / wall / idle if probe else None
        stats = sink.stats()
    finally:
        sink.close()
        shutil.rmtree(path, ignore_errors=True)
    moved = stats.bytes_stored / MB
    return {
        "payload_bytes": size,
        "writers": writers,
        "batch_mb": batch_mb,
        "records": stats.records_stored,
        "inserts": stats.inserts,
        "MB": moved,
        "seconds": wall,
        "MB_per_s": moved / wall,
        "rows_per_s": stats.records_stored / wall,
        "writer_cpu_s_per_MB": stats.writer_cpu_seconds / moved,
        "encode_cpu_s_per_MB": encode_cpu / moved,
        "put_thread_cpu_s_per_MB": main_cpu / moved,
        "process_cpu_s_per_MB": cpu / moved,
        "python_thread_speed_vs_idle": probed,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median MB/s, plus every run's MB/s."""
    ordered = sorted(runs, key=lambda r: r["MB_per_s"])
    return {**ordered[len(ordered) // 2], "MB_per_s_runs": [round(r["MB_per_s"]) for r in runs]}


def bench_readback(
    root: str, layers: int = 28, prompt: int = 256, decode: int = 256
) -> dict[str, Any]:
    """Write one request, then time reading it back through a handle."""
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=os.path.join(root, "readback"))
    run = RunInfo(
        "bench",
        "/models/qwen3-0.6b",
        (),
        tuple((RESID, n) for n in range(layers)),
        "2026-01-01T00:00:00Z",
    )
    positions = prompt + decode
    data = torch.randn(layers, positions, HIDDEN).to(torch.bfloat16)
    sink = ClickHouseSink(config)
    sink.start_run(run)
    steps = [(0, prompt)] + [(p, p + 1) for p in range(prompt, positions)]
    for seq, bounds in enumerate(steps, start=1):
        sink.put(
            [
                CaptureRecord(
                    "bench",
                    "req",
                    RESID,
                    n,
                    0,
                    bounds[0],
                    bounds[1],
                    "torch.bfloat16",
                    (bounds[1] - bounds[0], HIDDEN),
                    data[n, bounds[0] : bounds[1]]
                    .contiguous()
                    .view(torch.uint8)
                    .numpy()
                    .tobytes(),
                    seq,
                )
                for n in range(layers)
            ]
        )
    done = RunInfo(
        run.run_id, run.model_path, (), run.captures, run.started_at, "x", RunStatus.COMMITTED
    )
    sink.finish_run(done, [RequestManifest("bench", "req", prompt, decode + 1, committed=True)])
    sink.close()

    def handle() -> CaptureHandle:
        return CaptureHandle("bench", "req", lambda: ClickHouseReader(config))

    h = handle()
    t_avail, _ = timed(lambda: h.available)
    t_hidden, _ = timed(lambda: h.hidden_states)
    assert torch.equal(torch.stack(h.hidden_states).view(torch.int16), data.view(torch.int16))
    h2 = handle()
    t_range, _ = timed(lambda: h2.get("resid_pre", 5, start=300, end=310))
    return {
        "layers": layers,
        "positions": positions,
        "hidden": HIDDEN,
        "records": layers * (decode + 1),
        "MB": data.numel() * 2 / MB,
        "available_ms_cold": t_avail * 1e3,
        "hidden_states_ms": t_hidden * 1e3,
        "token_range_10_rows_ms_cold": t_range * 1e3,
    }


def main() -> None:
    """Run the benchmark, print a table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--dir", default=None, help="store directory (default: a temp dir)")
    parser.add_argument(
        "--spool-dir",
        default=None,
        help="TMPDIR for the chdb client's per-insert spool file (e.g. /dev/shm)",
    )
    parser.add_argument("--mb", type=int, default=512, help="MB ingested per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration (median)")
    parser.add_argument("--sizes", default="16384,65536,262144,1048576")
    parser.add_argument("--writers", default="1,2,4")
    parser.add_argument("--paths-mb", type=int, default=256, help="MB per insert-path trial")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.spool_dir:
        tempfile.tempdir = args.spool_dir  # this script's process only
    root = args.dir or tempfile.mkdtemp(prefix="dmi-store-bench-", dir="/var/tmp")
    total = args.mb * 1_000_000
    results: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": _versions(),
        "store_dir": root,
        "spool_dir": tempfile.gettempdir(),
    }
    try:
        results["insert_paths"] = bench_insert_paths(root, 65536, args.paths_mb * 1_000_000, 1024)
        print(
            f"{'insert path (64 KiB payloads, 1024 rows/insert)':48} {'MB/s':>6} "
            f"{'process cpu s/MB':>16} {'caller thread cpu s/MB':>22}  MB/s of each run"
        )
        for r in results["insert_paths"]:
            print(
                f"{r['path']:48} {r['MB_per_s']:6.0f} {r['process_cpu_s_per_MB']:16.5f} "
                f"{r['caller_thread_cpu_s_per_MB']:22.5f}  {r['MB_per_s_runs']}"
            )
        ingest = []
        for size in (int(s) for s in args.sizes.split(",")):
            for writers in (int(w) for w in args.writers.split(",")):
                runs = [bench_ingest(root, size, total, writers) for _ in range(args.repeat)]
                ingest.append(median_of(runs))
        results["ingest"] = ingest
        print(
            f"\n{'payload':>8} {'writers':>7} {'MB/s':>7} {'rows/s':>8} {'writer cpu s/MB':>15} "
            f"{'encode s/MB':>11} {'process cpu s/MB':>16}  MB/s of each run"
        )
        for r in ingest:
            print(
                f"{r['payload_bytes'] // 1024:>6}Ki {r['writers']:>7} {r['MB_per_s']:7.0f} "
                f"{r['rows_per_s']:8.0f} {r['writer_cpu_s_per_MB']:15.5f} "
                f"{r['encode_cpu_s_per_MB']:11.5f} {r['process_cpu_s_per_MB']:16.5f}  "
                f"{r['MB_per_s_runs']}"
            )
        with GilProbe() as probe:
            probed = [bench_ingest(root, 65536, total, 1, probe=probe) for _ in range(args.repeat)]
        results["gil_probe"] = median_of(probed)
        g = results["gil_probe"]
        print(
            f"\nwith a busy Python thread beside it (64 KiB, 1 writer): {g['MB_per_s']:.0f} MB/s; "
            f"that thread ran at {g['python_thread_speed_vs_idle']:.2f} x its idle speed"
        )
        results["readback"] = bench_readback(root)
        rb = results["readback"]
        print(
            f"\nreadback of one request ({rb['layers']} layers x {rb['positions']} positions, "
            f"{rb['MB']:.0f} MB): available {rb['available_ms_cold']:.0f} ms (cold), "
            f"hidden_states {rb['hidden_states_ms']:.0f} ms, 10-row range "
            f"{rb['token_range_10_rows_ms_cold']:.0f} ms (cold)"
        )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("clickhouse-connect", "chdb-core", "torch")}


if __name__ == "__main__":
    main()
