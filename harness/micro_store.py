"""Component benchmark of the capture store: ``python -m harness store``.

* ingest: records of bf16 activations (payloads of ``--sizes`` bytes, 28 layers a step)
  go through the public :class:`ClickHouseSink` on the embedded engine (chdb) with
  ``--writers`` inserting threads, and are made durable (``flush``, ``close``) within the
  timed span: MB/s and CPU seconds of the whole process per GB, ``--repeat`` runs each;
  also MB/s until ``os.sync()`` returned (the sink's durable is "inserted", unsynced).
  Bound: the disk, a synced write into the store's directory
  (:func:`harness.bounds.measure_disk_bps`) probed before the first run and after every
  run, so each run sits between two probes (their spread is reported); on-disk
  compression = captured bytes / bytes the store occupies; a run's ``of_bound`` is its
  MB/s over disk B/s x compression (the fraction of the disk bound it reached).
* readback: one request written through the sink, then read through ``open_store`` and
  its :class:`CaptureHandle`: ``available`` (cold), ``hidden_states`` (checked equal to
  what was written) and a 10-row token range (cold).

``--quick`` runs small sizes in seconds (a dry run on any machine).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path

import attrs
import torch

from dmi_sglang import open_store
from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from harness.bounds import directory_bytes, measure_disk_bps
from harness.constants import DISK_PROBE_BYTES
from harness.results import Json, finish, quiet_logs, result, utc_now, write_json

HIDDEN = 1024  # Qwen3-0.6B
LAYERS = 28
RESID = "blocks.hook_resid_pre"
FULL = {"mb": 512, "sizes": "65536,1048576", "writers": "1,4", "repeat": 2,
        "probe_mb": DISK_PROBE_BYTES >> 20, "readback": "28,256,256"}
QUICK = {"mb": 8, "sizes": "16384,262144", "writers": "1,2", "repeat": 2, "probe_mb": 16,
         "readback": "4,32,32"}


def spread(values: list[float]) -> float:
    """``max / min - 1`` of positive rates (0 for one value)."""
    return max(values) / min(values) - 1.0 if values and min(values) > 0 else 0.0


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def make_records(size: int, total: int) -> list[CaptureRecord]:
    """``total // size`` records of ``size`` payload bytes (64 distinct bf16 payloads of
    normal values), layer after layer, request after request, as a drain emits them."""
    gen = torch.Generator().manual_seed(size)
    pool = [raw(torch.randn(size // 2, generator=gen).to(torch.bfloat16)) for _ in range(64)]
    rows = max(1, size // (2 * HIDDEN))
    trailing = (HIDDEN,) if size >= 2 * HIDDEN else (size // 2,)
    out = []
    for i in range(max(1, total // size)):
        step, layer = divmod(i, LAYERS)
        req, chunk = divmod(step, 64)
        out.append(CaptureRecord("bench", f"req-{req}", RESID, layer, 0, chunk * rows,
                                 (chunk + 1) * rows, "torch.bfloat16", (rows, *trailing),
                                 pool[i % len(pool)], i))
    return out


def ingest(root: Path, size: int, total: int, writers: int, rep: int) -> Json:
    """One sustained ingest into a fresh store (see the module docstring)."""
    path = root / f"ingest-{size}-{writers}-{rep}"
    records = make_records(size, total)
    captured = sum(len(r.payload) for r in records)
    sink = ClickHouseSink(StoreConfig(kind=StoreKind.EMBEDDED, path=str(path)),
                          writers=writers)
    os.sync()  # the previous run's writeback is not this run's
    started, cpu = time.perf_counter(), time.process_time()
    try:
        for i in range(0, len(records), LAYERS):
            sink.put(records[i:i + LAYERS])
        sink.flush()
    finally:
        sink.close()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    os.sync()  # the sink's durable is "inserted"; the disk probe's is "synced"
    synced, stats, on_disk = time.perf_counter() - started, sink.stats(), directory_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return {"payload_bytes": size, "writers": writers, "records": len(records),
            "bytes": captured, "seconds": wall, "bps": stats.bytes_stored / wall,
            "synced_seconds": synced, "synced_bps": stats.bytes_stored / synced,
            "cpu_s_per_GB": cpu / (stats.bytes_stored / 1e9), "disk_bytes": on_disk,
            "compression": captured / on_disk if on_disk else None, "inserts": stats.inserts,
            "delivered": stats.records_stored == len(records) and stats.bytes_stored == captured}


def readback(root: Path, layers: int, prompt: int, decode: int) -> Json:
    """Write one request (prefill, then one row per decode step), time reading it back."""
    path, positions = root / "readback", prompt + decode
    run = RunInfo("bench", "/models/qwen3-0.6b", (), tuple((RESID, n) for n in range(layers)),
                  utc_now())
    data = torch.randn(layers, positions, HIDDEN).to(torch.bfloat16)
    sink = ClickHouseSink(StoreConfig(kind=StoreKind.EMBEDDED, path=str(path)))
    try:
        sink.start_run(run)
        spans = [(0, prompt)] + [(p, p + 1) for p in range(prompt, positions)]
        for seq, (lo, hi) in enumerate(spans, start=1):
            sink.put([CaptureRecord("bench", "req", RESID, n, 0, lo, hi, "torch.bfloat16",
                                    (hi - lo, HIDDEN), raw(data[n, lo:hi]), seq)
                      for n in range(layers)])
        sink.finish_run(attrs.evolve(run, stopped_at=utc_now(), status=RunStatus.COMMITTED),
                        [RequestManifest("bench", "req", prompt, decode + 1, committed=True)])
    finally:
        sink.close()
    store = open_store(f"chdb://{path}")
    handle, ranged = store.handle("bench", "req"), store.handle("bench", "req")
    started = time.perf_counter()
    available = handle.available
    t_available, started = time.perf_counter() - started, time.perf_counter()
    hidden = handle.hidden_states
    t_hidden, started = time.perf_counter() - started, time.perf_counter()
    lo = max(0, positions - 10)
    rows = ranged.get("resid_pre", layers - 1, start=lo, end=positions)
    t_range = time.perf_counter() - started
    equal = available and torch.equal(torch.stack(hidden).view(torch.int16),
                                      data.view(torch.int16))
    return {"layers": layers, "positions": positions, "bytes": data.numel() * 2,
            "records": layers * (decode + 1), "available_ms_cold": t_available * 1e3,
            "hidden_states_ms": t_hidden * 1e3, "range_10_rows_ms_cold": t_range * 1e3,
            "equal": equal and torch.equal(rows, data[layers - 1, lo:positions])}


def run(args: argparse.Namespace, root: Path, data: Json) -> None:
    """Probes, ingests and the readback into ``data``; prints the table."""
    probe_bytes = args.probe_mb << 20
    probes = [measure_disk_bps(root, probe_bytes)]
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for writers in (int(w) for w in args.writers.split(",")):
            runs = []
            for rep in range(args.repeat):  # probe, run, probe, run, probe ...
                runs.append(ingest(root, size, args.mb * 1_000_000, writers, rep))
                probes.append(measure_disk_bps(root, probe_bytes))
            rates = [r["bps"] for r in runs]
            ratios = [r["compression"] for r in runs if r["compression"]]
            rows.append({"payload_bytes": size, "writers": writers,
                         "bps": statistics.median(rates), "spread": spread(rates),
                         "synced_bps": statistics.median(r["synced_bps"] for r in runs),
                         "cpu_s_per_GB": statistics.median(r["cpu_s_per_GB"] for r in runs),
                         "compression": statistics.median(ratios) if ratios else None,
                         "delivered": all(r["delivered"] for r in runs), "runs": runs})
    disk = statistics.median(probes)
    for r in rows:
        r["of_bound"] = r["bps"] / (disk * (r["compression"] or 1.0))
    back = readback(root, *(int(x) for x in args.readback.split(",")))
    print(f"ingest through ClickHouseSink (embedded), {args.mb} MB a run, durable at the "
          f"end (synced: until os.sync returned too); median of {args.repeat} runs\n"
          f"{'payload':>8}{'writers':>8}{'MB/s':>8}{'spread':>8}{'synced':>8}{'cpu s/GB':>10}"
          f"{'compr.':>8}{'of bound':>10}  stored")
    for r in rows:
        print(f"{r['payload_bytes'] // 1024:>6}Ki{r['writers']:>8}{r['bps'] / 1e6:>8.0f}"
              f"{r['spread']:>8.2f}{r['synced_bps'] / 1e6:>8.0f}{r['cpu_s_per_GB']:>10.1f}"
              f"{r['compression'] or 0:>8.2f}"
              f"{r['of_bound']:>10.2f}  {'all' if r['delivered'] else 'LOST'}")
    print(f"bound: disk {disk / 1e6:.0f} MB/s (synced write into the store directory, median "
          f"of {len(probes)} probes, spread {spread(probes):.2f}) x compression\n"
          f"readback of one request ({back['layers']} layers x {back['positions']} positions, "
          f"{back['bytes'] / 1e6:.1f} MB): available {back['available_ms_cold']:.0f} ms "
          f"(cold), hidden_states {back['hidden_states_ms']:.0f} ms, 10-row range "
          f"{back['range_10_rows_ms_cold']:.0f} ms (cold); read "
          f"{'equal to what was written' if back['equal'] else 'DIFFERENT from what was written'}")
    best = max(rows, key=lambda r: r["of_bound"])
    data["bound"] = {"kind": "disk", "disk_bps": disk, "disk_probes_bps": probes,
                     "disk_spread": spread(probes), "compression": best["compression"],
                     "limit_bps": disk * (best["compression"] or 1.0),
                     "ratio": best["of_bound"],
                     "ratio_of": f"{best['payload_bytes']} B x {best['writers']} writers"}
    data["figures"] = {"ingest": rows, "readback": back}
    data["checks"] = {
        "ingest_delivered": {"ok": all(r["delivered"] for r in rows), "required": True},
        "readback_equal": {"ok": bool(back["equal"]), "required": True},
        "compression_measured": {"ok": all(r["compression"] for r in rows), "required": True}}


def main(argv: list[str] | None = None) -> int:
    """Run the store benchmark; 0 when every required check passed, else 1."""
    p = argparse.ArgumentParser(prog="python -m harness store", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: seconds, any machine")
    p.add_argument("--mb", type=int, help=f"MB ingested per run (default {FULL['mb']})")
    p.add_argument("--sizes", help=f"payload bytes (default {FULL['sizes']})")
    p.add_argument("--writers", help=f"writer threads (default {FULL['writers']})")
    p.add_argument("--repeat", type=int, help=f"runs per configuration ({FULL['repeat']})")
    p.add_argument("--probe-mb", type=int, help="MiB the disk probe writes (default 1024)")
    p.add_argument("--readback", help="layers,prompt,decode of the readback (28,256,256)")
    p.add_argument("--dir", type=Path, help="where the scratch stores go (default /var/tmp)")
    p.add_argument("--out", type=Path, help="JSON (default $OUT/store.json, else ./store.json)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.mb, args.repeat, args.probe_mb) <= 0:
        p.error("--mb, --repeat and --probe-mb must be positive")
    parent = args.dir or (Path("/var/tmp") if os.path.isdir("/var/tmp") else None)
    root = Path(tempfile.mkdtemp(prefix="dmi-store-bench-", dir=parent))
    settings = {**vars(args), "dir": str(root), "out": str(args.out), "cpus": os.cpu_count(),
                "python": sys.version.split()[0], "torch": torch.__version__,
                **{n: version(n) for n in ("chdb-core", "clickhouse-connect")}}
    data = result("store", "store", settings)
    try:
        with quiet_logs():
            run(args, root, data)
        finish(data)
    except Exception as exc:
        traceback.print_exc()
        finish(data, "error", f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = args.out or Path(os.environ.get("OUT") or ".") / "store.json"
    write_json(out, data)
    print(f"{data['status']}; wrote {out}")
    return 0 if data["status"] == "passed" else 1
