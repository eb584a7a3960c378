"""Component benchmark of the capture store: ``python -m harness store``.

* ingest: records of bf16 activations (payloads of ``--sizes`` bytes, 28 layers a step,
  record batches of up to 64 requests and ``--batch-mb`` MiB: 4 by default, a decode
  step's; a served window flush makes batches of about 80; the payloads are views of one
  buffer, as the transport hands them over) go through the public
  :class:`ClickHouseSink` on the embedded engine (chdb) with ``--writers`` inserting
  threads, one run from ``start_run`` to ``finish_run`` (which syncs the run's files) and
  ``close`` within the timed span: MB/s, CPU seconds of the whole process per GB and of
  the sink's writer threads per GB, ``--repeat`` runs each; also the MB/s timed until a
  later ``os.sync()`` returned. Bound (:func:`harness.bounds.bound`): the disk, a synced write
  into the store's directory (:func:`harness.bounds.measure_disk_bps`) probed before the
  first run and after every run, so each run sits between two probes (their spread is
  reported), x the on-disk compression (captured bytes / bytes the store occupies).
  Both sides synced: needed = the synced ingest rate (records offered back to back),
  ``of_bound`` = synced B/s / (disk B/s x compression). The result's ``bound`` is that of
  the largest payload with the most writers.
* through the store owner: the ingest of the widest payload with the most writers as a
  capture makes it, through the store owner process a scheduler starts
  (``open_capture_sink``), timed from the run's start until ``close`` returned (the
  owner closed the store), against the same direct ingest, each in a new process (both start the
  embedded engine cold, which costs the first GB or so): MB/s, CPU seconds per GB of the
  calling process (a scheduler's share: the write channel's sends) and of the owner (from
  its ready to its exit), and the two parts of a capture's stop that wait for the owner:
  ``finish_run`` (flush, manifests, the run's end, the sync) and ``close`` (until the
  owner said it closed the store: free for the next opener), ``--repeat`` runs each;
  and the same through the owner with a shared ring of ``DMX_CH_QUEUE_MB`` (``DMX_OWNER_RING_MB``).
* the owner's write channel alone: the same ingest's batches put through a
  :class:`RemoteSink` to an owner process whose sink keeps nothing, through its socket
  (also beside a busy pure-Python thread of the calling process, as a drain runs beside
  SGLang's scheduler thread) and through a shared ring of ``DMX_CH_QUEUE_MB`` (what a
  capture uses), each ``--repeat`` times: MB/s until a flush returned, CPU seconds per
  GB of the calling process (its puts and libzmq's I/O thread) and of the owner, and the
  owner's minor page faults per GB (memory it touched fresh: a 4 KiB page each). The
  owner process tunes glibc's heap as a store owner does (``tune_host_malloc``).
* readback: one request written through the sink, then read through ``open_store`` and
  its :class:`CaptureHandle`: ``available`` (cold), ``hidden_states`` (checked equal to
  what was written) and a 10-row token range (cold).
* export: a run whose ``--export`` requests each added ``--export-rows`` positions
  (default 8; 1 is a decode step's record) of every layer per insert, ``steps`` inserts
  (a serving store's shape while it captures: a request's rows spread over many small
  parts it shares with the others, merges held), then one committed request's
  safetensors file built by the server's export (:class:`~dmi_sglang.app.export.StoreReads`,
  reading the store directly: the owner's read channel, its IPC, is not in it) with the
  default pieces (whole tensors together while they fit: one query) and with one tensor
  a piece (one query per tensor): ms, CPU seconds of the process per GB exported, and of
  the exporting thread alone (the engine runs part of each query on it); then the
  default export as a server makes it: read through the owner's read channel (answered
  on a thread of this process) by a client process, beside a busy pure-Python thread of
  this process (any Python work sharing the owner's process; a serving scheduler before
  the store owner process): the seconds of that thread's work each
  export took per GB (``owner's busy thread s/GB``, its rate measured alone in one short
  window before each; on a machine with few cores the store engine's threads and the
  client process take CPU from it too, so it counts CPU as well as the GIL, and on the
  2-core dev box it is too noisy to compare two versions; ``-`` where the median is not
  positive: an export too small for the probe to resolve); files equal to what was
  written.

``--quick`` runs small sizes in seconds (a dry run on any machine).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from safetensors.torch import load as load_safetensors

from dmi_sglang import open_store
from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.adapters.owner import RemoteSink, SinkService
from dmi_sglang.app import export as exporting
from dmi_sglang.app.composition import open_capture_sink
from dmi_sglang.app.null_sink import NullSink
from dmi_sglang.app.store_owner import OwnedSink
from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.store_config import INSERT_MB_MAX, StoreConfig, StoreKind
from dmi_sglang.host_malloc import tune_host_malloc
from harness.bounds import bound, directory_bytes, measure_disk_bps, spread_of
from harness.constants import CHANNEL_WAIT_S, DISK_PROBE_BYTES
from harness.docs import table_lines
from harness.engine import process_cpu, process_minor_faults
from harness.micro_transport import SpinProbe
from harness.models import MODELS
from harness.results import Json, run_benchmark, utc_now

Q06 = MODELS["0.6b"]
HIDDEN, LAYERS = Q06.hidden, Q06.layers
RESID = "blocks.hook_resid_pre"
FULL = {"mb": 512, "sizes": "2048,65536,1048576", "writers": "1,4", "repeat": 2,
        "probe_mb": DISK_PROBE_BYTES >> 20, "readback": f"{LAYERS},256,256", "export": "64,40"}
QUICK = {"mb": 8, "sizes": "16384,262144", "writers": "1,2", "repeat": 2, "probe_mb": 16,
         "readback": "4,32,32", "export": "8,6"}
EXPORT_ROWS = 8
"""Positions each request adds per insert in the export part (default of --export-rows)."""


def ints(what: str, *, even: bool = False, count: int = 0,
         low: tuple[int, ...] = ()) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: integers separated by commas (``count`` of them where given), each
    at least its ``low`` (default 1), even where ``even``; ``what`` says what is accepted."""
    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        values = tuple(int(x) for x in parts if x.strip().lstrip("-").isdigit())
        mins = low or (1,) * len(values)
        if len(values) != len(parts) or (count and len(values) != count) or any(
                v < m or (even and v % 2) for v, m in zip(values, mins, strict=False)):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
        return values
    return parse


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


INSERT_ROWS = StoreConfig(kind=StoreKind.EMBEDDED).insert_rows
CHANNEL_RING_BYTES = StoreConfig(kind=StoreKind.EMBEDDED).queue_mb << 20
"""The shared ring measured (``DMX_OWNER_RING_MB``): the size of the owner's queue
(``DMX_CH_QUEUE_MB``'s default)."""
CHANNEL_VARIANTS = (("socket", 0, False), ("socket, beside a busy thread", 0, True),
                    ("ring", CHANNEL_RING_BYTES, False))
"""The owner channel's runs: name, shared ring bytes (0: the socket), beside a busy
thread (:func:`owner_channel`)."""
STEP_REQUESTS, BATCH_MB = 64, 4
"""A record batch: up to 64 requests x 28 layers, at most ``--batch-mb`` MiB (by default
4, about one decode step's)."""


def make_batches(size: int, total: int, batch_mb: int = BATCH_MB) -> list[RecordBatch]:
    """Record batches of ``total // size`` records of ``size`` payload bytes (bf16 normal
    values) in all: layer after layer, request after request, at most ``batch_mb`` MiB a
    batch, each batch's payload a view of one shared buffer (no per-record objects, no
    copies)."""
    per_step = LAYERS * max(1, min(STEP_REQUESTS, (batch_mb << 20) // (LAYERS * size)))
    count = max(1, total // size)
    steps = -(-count // per_step)
    pooled = max(1, min(steps, (256 << 20) // (per_step * size)))  # distinct steps
    gen = torch.Generator().manual_seed(size)
    pool = torch.randn(pooled * per_step * size // 2, generator=gen).to(torch.bfloat16)
    buffer = pool.view(torch.uint8).numpy()
    whole = size % (2 * HIDDEN) == 0  # whole hidden rows, else one row of size // 2
    rows, trailing = (size // (2 * HIDDEN), (HIDDEN,)) if whole else (1, (size // 2,))
    keys = tuple(CaptureKey(RESID, n, "torch.bfloat16", trailing) for n in range(LAYERS))
    requests = per_step // LAYERS
    names = tuple(f"req-{r}" for r in range(requests))
    layer = np.tile(np.arange(LAYERS, dtype=np.int32), requests)
    request = np.repeat(np.arange(requests, dtype=np.int32), LAYERS)
    offsets = np.arange(per_step + 1, dtype=np.int64) * size
    out = []
    for step in range(steps):
        first = step * per_step
        n = min(per_step, count - first)
        at = (step % pooled) * per_step * size
        start = np.full(n, step * rows, dtype=np.int32)
        out.append(RecordBatch("bench", names, keys, request[:n], layer[:n], start,
                               start + rows, np.arange(first, first + n, dtype=np.int64),
                               offsets[:n + 1], buffer[at:at + n * size]))
    return out


def _ingest_input(size: int, total: int,
                  batch_mb: int = BATCH_MB) -> tuple[list[RecordBatch], int, int, RunInfo]:
    """An ingest's batches (:func:`make_batches`), their record and byte counts, and the
    running run they belong to."""
    batches = make_batches(size, total, batch_mb)
    run = RunInfo("bench", f"/models/{Q06.name}", (), tuple((RESID, n) for n in range(LAYERS)),
                  utc_now())
    return batches, sum(len(b) for b in batches), sum(b.nbytes for b in batches), run


def _rates(runs: list[Json]) -> Json:
    """The medians of runs through the owner or its channel: MB/s (with its spread) and
    CPU seconds per GB of the calling process and of the owner."""
    return {"bps": statistics.median(r["bps"] for r in runs),
            "spread": spread_of(r["bps"] for r in runs),
            "cpu_s_per_GB": _median(r["cpu_s_per_GB"] for r in runs),
            "owner_cpu_s_per_GB": _median(r["owner_cpu_s_per_GB"] for r in runs)}


def _per_gb(seconds: float, nbytes: int) -> float | None:
    """``seconds`` per GB (1e9 bytes) of ``nbytes``; None when nothing was stored (the
    delivered check reports that)."""
    return seconds / (nbytes / 1e9) if nbytes else None


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the values measured (None where none was)."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def ingest(root: Path, size: int, total: int, writers: int, rep: int, *,
           insert_rows: int = INSERT_ROWS, insert_mb: int = 0,
           batch_mb: int = BATCH_MB) -> Json:
    """One sustained ingest into a fresh store (see the module docstring)."""
    path = root / f"ingest-{size}-{writers}-{rep}"
    batches, records, captured, run = _ingest_input(size, total, batch_mb)
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=str(path), insert_rows=insert_rows,
                         insert_mb=insert_mb)
    sink = ClickHouseSink(config, writers=writers)
    os.sync()  # the previous run's writeback is not this run's
    started, cpu = time.perf_counter(), time.process_time()
    try:
        sink.start_run(run)
        for batch in batches:
            sink.put(batch)
        sink.finish_run(attrs.evolve(run, stopped_at=utc_now(), status=RunStatus.COMMITTED),
                        [])
    finally:
        sink.close()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    os.sync()  # whatever the sink left unsynced (none of the run's files, if all went well)
    synced, stats, on_disk = time.perf_counter() - started, sink.stats(), directory_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return {"payload_bytes": size, "writers": writers, "records": records,
            "batches": len(batches), "bytes": captured, "seconds": wall,
            "bps": stats.bytes_stored / wall, "synced_seconds": synced,
            "synced_bps": stats.bytes_stored / synced,
            "cpu_s_per_GB": _per_gb(cpu, stats.bytes_stored),
            "writer_cpu_s_per_GB": stats.cpu_s_per_gb, "sync_seconds": stats.sync_seconds,
            "background_sync_seconds": stats.background_sync_seconds,
            "disk_bytes": on_disk, "compression": captured / on_disk if on_disk else None,
            "inserts": stats.inserts,
            "delivered": stats.records_stored == records and stats.bytes_stored == captured}


def ingest_through_owner(root: Path, size: int, total: int, writers: int, rep: int, *,
                         insert_rows: int = INSERT_ROWS, insert_mb: int = 0,
                         ring_mb: int = 0, batch_mb: int = BATCH_MB) -> Json:
    """The same ingest as a capture makes it: through the store owner process that a
    scheduler starts (``open_capture_sink``; with ``ring_mb``, ``DMX_OWNER_RING_MB``),
    timed from the run's start until ``close`` returned (the owner closed the store); CPU
    seconds per GB of this process (the scheduler's side) and of the owner (a child:
    what it used from its ready to its exit)."""
    path = root / f"owner-ingest-{size}-{writers}-{rep}-{ring_mb}"
    batches, records, captured, run = _ingest_input(size, total, batch_mb)
    settings = Settings.from_kwargs(
        {"dmx_db_url": f"chdb://{path}", "dmx_ch_writers": str(writers),
         "dmx_ch_insert_rows": str(insert_rows), "dmx_ch_insert_mb": str(insert_mb),
         "dmx_owner_ring_mb": str(ring_mb)},
        env={}).resolve(model_path="/models/bench")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    sink = open_capture_sink(settings)
    owner_start_cpu = process_cpu(sink.pid) if isinstance(sink, OwnedSink) else 0.0
    os.sync()
    started, cpu = time.perf_counter(), time.process_time()
    try:
        sink.start_run(run)
        for batch in batches:
            sink.put(batch)
        put_done = time.perf_counter()
        shared = isinstance(sink, OwnedSink) and sink.shared
        sink.finish_run(attrs.evolve(run, stopped_at=utc_now(), status=RunStatus.COMMITTED),
                        [])
        finished = time.perf_counter()
    finally:
        sink.close()
    closed = time.perf_counter()
    wall, cpu = closed - started, time.process_time() - cpu
    if isinstance(sink, OwnedSink):  # its CPU counts once it is reaped (after close)
        _until_reaped(sink.pid)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    owner_cpu = ((after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
                 - owner_start_cpu)
    with ClickHouseReader(settings.store()).session() as reader:
        totals = reader.hook_totals("bench")
    stored = sum(t.bytes for t in totals)
    shutil.rmtree(path, ignore_errors=True)
    return {"payload_bytes": size, "writers": writers, "records": records,
            "batches": len(batches), "bytes": captured, "seconds": wall,
            "bps": stored / wall, "cpu_s_per_GB": _per_gb(cpu, stored),
            "owner_cpu_s_per_GB": _per_gb(owner_cpu, stored),
            "finish_run_s": finished - put_done, "close_s": closed - finished,
            "shared": shared,
            "delivered": sum(t.records for t in totals) == records and stored == captured}


def _until_reaped(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the child ``pid`` is reaped (its ``/proc`` entry gone).

    Raises:
        RuntimeError: it was not within ``timeout_s`` (its CPU would go uncounted).
    """
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            msg = f"the store owner (pid {pid}) was not reaped within {timeout_s:g} s"
            raise RuntimeError(msg)
        time.sleep(0.005)


def _serve_discarding(address: str, ready: Any, done: Any) -> None:
    """An owner's write channel over a :class:`NullSink` (it keeps nothing) until
    ``done`` (a spawned child)."""
    tune_host_malloc()  # as the store owner's process does
    service = SinkService(NullSink(), address)
    ready.set()
    done.wait(CHANNEL_WAIT_S)
    service.close()


def owner_channel(size: int, total: int, shared_bytes: int, batch_mb: int = BATCH_MB, *,
                  busy: bool = False) -> Json:
    """The owner's write channel alone: the ingest's batches put through a
    :class:`RemoteSink` to an owner process whose sink keeps nothing, through the socket
    (``shared_bytes`` 0) or a shared ring of ``shared_bytes``; timed from the first put
    after a warm-up put until a flush returned; CPU seconds per GB of this process (the
    puts and libzmq's I/O thread; with ``busy``, the busy thread's too) and of the owner.
    With ``busy`` the puts run beside a busy pure-Python thread of this process, as a
    drain runs beside SGLang's scheduler thread, which holds the GIL whenever the drain
    lets go of it (in every call into libzmq)."""
    batches, _, captured, _ = _ingest_input(size, total, batch_mb)
    directory = tempfile.mkdtemp(prefix="dmi-channel-")
    os.chmod(directory, 0o700)
    address = f"ipc://{directory}/writes"
    spawn = multiprocessing.get_context("spawn")
    ready, done = spawn.Event(), spawn.Event()
    owner = spawn.Process(target=_serve_discarding, args=(address, ready, done), daemon=True)
    owner.start()
    try:
        if not ready.wait(CHANNEL_WAIT_S):
            msg = "the channel's owner process did not start"
            raise RuntimeError(msg)
        sink = RemoteSink(address, shared_bytes=shared_bytes)
        sink.put(batches[0])  # the socket (and the ring) made before the timing
        owner_cpu = process_cpu(owner.pid or 0)
        owner_faults = process_minor_faults(owner.pid or 0)
        with SpinProbe() if busy else contextlib.nullcontext():
            started, cpu = time.perf_counter(), time.process_time()
            for batch in batches:
                sink.put(batch)
            sink.flush()
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        owner_cpu = process_cpu(owner.pid or 0) - owner_cpu
        owner_faults = process_minor_faults(owner.pid or 0) - owner_faults
        shared, waits = sink.shared, sink.ring_waits
        sink.close()
    finally:
        done.set()
        owner.join(CHANNEL_WAIT_S)
        shutil.rmtree(directory, ignore_errors=True)
    return {"payload_bytes": size, "shared_bytes": shared_bytes, "shared": shared,
            "bytes": captured, "seconds": wall, "bps": captured / wall,
            "cpu_s_per_GB": _per_gb(cpu, captured),
            "owner_cpu_s_per_GB": _per_gb(owner_cpu, captured), "ring_waits": waits,
            "owner_faults_per_GB": owner_faults / (captured / 1e9)}


def readback(root: Path, layers: int, prompt: int, decode: int) -> Json:
    """Write one request (prefill, then one row per decode step), time reading it back."""
    path, positions = root / "readback", prompt + decode
    run = RunInfo("bench", f"/models/{Q06.name}", (), tuple((RESID, n) for n in range(layers)),
                  utc_now())
    data = torch.randn(layers, positions, HIDDEN).to(torch.bfloat16)
    sink = ClickHouseSink(StoreConfig(kind=StoreKind.EMBEDDED, path=str(path)))
    try:
        sink.start_run(run)
        spans = [(0, prompt)] + [(p, p + 1) for p in range(prompt, positions)]
        for seq, (lo, hi) in enumerate(spans, start=1):
            sink.put(RecordBatch.from_records([
                CaptureRecord("bench", "req", RESID, n, 0, lo, hi, "torch.bfloat16",
                              (hi - lo, HIDDEN), raw(data[n, lo:hi]), seq)
                for n in range(layers)]))
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


def _exported(reads: exporting.StoreReads, request_id: str) -> bytes:
    """One request's safetensors file, whole."""
    return b"".join(reads.safetensors("bench", request_id)[1])


def _remote_export(address: str, request_id: str) -> str:
    """In a process of its own (a server's main process): one request's file exported
    through the store owner's read channel at ``address``; its SHA-256."""
    from dmi_sglang.adapters.owner import RemoteReader

    remote = RemoteReader(address, timeout_s=120)
    return hashlib.sha256(_exported(exporting.StoreReads(lambda: remote), request_id)
                          ).hexdigest()


def _collect(submit: Callable[[], Future[str]], into: list[str]) -> None:
    """Submit, wait for the answer, keep it."""
    into.append(submit().result())


def _beside_busy_thread(reader: ClickHouseReader, requests: int, repeat: int,
                        files: dict[str, bytes]) -> tuple[list[tuple[float, float]], bool]:
    """Exports through the owner's read channel (answered on a thread of this process,
    the owner's, as a store owner answers them) to a client process, beside a busy
    Python thread of this process: per export, its wall seconds and the seconds of the
    busy thread's work it took (re-measured alone before each); whether every file the
    client got equals ``files``' (by request id)."""

    from dmi_sglang.adapters.owner import ReadService

    directory = tempfile.mkdtemp(prefix="dmi-bench-reads-")  # mode 0700: the owner's rule
    service = ReadService(reader, f"ipc://{directory}/reads")
    out: list[tuple[float, float]] = []
    same = True
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client, \
                SpinProbe() as spin:
            client.submit(_remote_export, service.address, "req-0000").result()  # imports
            for rep in range(repeat):
                rid = f"req-{(2 * rep) % requests:04d}"
                alone = spin.rate(0.3)
                pending = functools.partial(client.submit, _remote_export, service.address, rid)
                got: list[str] = []
                out.append(spin.taken_s(functools.partial(_collect, pending, got), alone))
                same = same and got == [hashlib.sha256(files[rid]).hexdigest()]
    finally:
        service.close()
        shutil.rmtree(directory, ignore_errors=True)
    return out, same


def export_cost(root: Path, requests: int, steps: int, repeat: int,
                rows_per_insert: int = EXPORT_ROWS) -> Json:
    """Fill a store as a capturing server does (see the module), then time the export of
    committed requests with the default pieces and with one tensor a piece."""
    path = root / "export"
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=str(path))
    run = RunInfo("bench", f"/models/{Q06.name}", (), tuple((RESID, n) for n in range(LAYERS)),
                  utc_now())
    rows = [torch.randn(LAYERS, steps * rows_per_insert, HIDDEN, dtype=torch.bfloat16)
            for _ in range(requests)]
    sink = ClickHouseSink(config)
    try:
        sink.start_run(run)
        for step in range(steps):
            lo, hi = step * rows_per_insert, (step + 1) * rows_per_insert
            sink.put(RecordBatch.from_records([
                CaptureRecord("bench", f"req-{r:04d}", RESID, n, 0, lo, hi, "torch.bfloat16",
                              (hi - lo, HIDDEN), raw(rows[r][n, lo:hi]), step + 1)
                for r in range(requests) for n in range(LAYERS)]))
            sink.flush()  # one part per step, as the inserts of a capturing run
        positions = steps * rows_per_insert
        sink.commit_requests([  # the first insert its prompt, one token a later position
            RequestManifest("bench", f"req-{r:04d}", rows_per_insert,
                            positions - rows_per_insert + 1,
                            committed=True) for r in range(requests)])
        sink.flush()
        reader = ClickHouseReader(config)
        tensor_bytes = positions * HIDDEN * 2
        reads = {"pieces": exporting.StoreReads(lambda: reader),
                 "per_tensor": exporting.StoreReads(lambda: reader, piece_bytes=tensor_bytes)}
        timed: dict[str, list[tuple[float, float, float]]] = {"pieces": [], "per_tensor": []}
        equal, nbytes = True, 0
        files: dict[str, bytes] = {}
        with reader.session():
            for rep in range(repeat):
                for name, export in reads.items():
                    r = (2 * rep + (name == "per_tensor")) % requests
                    started, cpu = time.perf_counter(), time.process_time()
                    thread = time.thread_time()
                    _, parts = export.safetensors("bench", f"req-{r:04d}")
                    blob = b"".join(parts)
                    timed[name].append((time.perf_counter() - started,
                                        time.process_time() - cpu, time.thread_time() - thread))
                    files[f"req-{r:04d}"] = blob
                    got = load_safetensors(blob)
                    nbytes = sum(t.numel() * 2 for t in got.values())
                    equal = equal and all(torch.equal(got[f"{RESID}.{n}"], rows[r][n])
                                          for n in range(LAYERS))
            beside, same = _beside_busy_thread(reader, requests, repeat, files)
    finally:
        sink.close()
    out: Json = {"requests": requests, "parts": steps, "rows_per_insert": rows_per_insert,
                 "store_bytes": sum(r.numel() for r in rows) * 2,
                 "file_bytes": nbytes, "equal": equal and same}
    taken = [t / nbytes * 1e9 for _, t in beside]
    out["through_owner_ms"] = statistics.median(w for w, _ in beside) * 1e3
    busy = statistics.median(taken)  # not positive: the export was below what the probe resolves
    out["busy_thread_s_per_GB"] = busy if busy > 0 else None
    out["busy_thread_s_per_GB_each"] = taken
    for name, values in timed.items():
        out[f"{name}_ms"] = statistics.median(w for w, _, _ in values) * 1e3
        out[f"{name}_cpu_s_per_GB"] = statistics.median(c for _, c, _ in values) / nbytes * 1e9
        out[f"{name}_thread_cpu_s_per_GB"] = (statistics.median(t for _, _, t in values)
                                              / nbytes * 1e9)
    return out


def run(args: argparse.Namespace, root: Path, data: Json) -> None:
    """Probes, ingests and the readback into ``data``; prints the tables."""
    probe_bytes = args.probe_mb << 20
    probes = [measure_disk_bps(root, probe_bytes)]
    rows = []
    for size in args.sizes:
        for writers in args.writers:
            runs = []
            for rep in range(args.repeat):  # probe, run, probe, run, probe ...
                runs.append(ingest(root, size, args.mb * 1_000_000, writers, rep,
                                   insert_rows=args.insert_rows, insert_mb=args.insert_mb,
                                   batch_mb=args.batch_mb))
                probes.append(measure_disk_bps(root, probe_bytes))
            ratios = [r["compression"] for r in runs if r["compression"]]
            rows.append({"payload_bytes": size, "writers": writers,
                         "bps": statistics.median(r["bps"] for r in runs),
                         "spread": spread_of(r["bps"] for r in runs),
                         "synced_bps": statistics.median(r["synced_bps"] for r in runs),
                         "synced_spread": spread_of(r["synced_bps"] for r in runs),
                         "cpu_s_per_GB": _median(r["cpu_s_per_GB"] for r in runs),
                         "writer_cpu_s_per_GB": _median(
                             r["writer_cpu_s_per_GB"] for r in runs),
                         "sync_seconds": statistics.median(r["sync_seconds"] for r in runs),
                         "compression": statistics.median(ratios) if ratios else None,
                         "delivered": all(r["delivered"] for r in runs), "runs": runs})
    disk = statistics.median(probes)
    for r in rows:  # a record stands for a token: needed = the synced ingest rate
        r["bound"] = bound(captured_bytes_per_token=r["payload_bytes"], d2h_bps=None,
                           stock_tok_s=r["synced_bps"] / r["payload_bytes"], disk_bps=disk,
                           compression=r["compression"])
        r["of_bound"] = r["synced_bps"] / r["bound"]["limit_bps"]
    widest, most = max(args.sizes), max(args.writers)
    fresh: dict[str, list[Json]] = {"direct": [], "owner": [], "ring": []}
    ways: tuple[tuple[str, Callable[..., Json]], ...] = (
        ("direct", ingest), ("owner", ingest_through_owner),
        ("ring", functools.partial(ingest_through_owner, ring_mb=CHANNEL_RING_BYTES >> 20)))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        for rep in range(args.repeat):  # each in a new process: all start the engine cold
            for how, fn in ways:
                fresh[how].append(pool.submit(fn, root, widest, args.mb * 1_000_000, most,
                                              rep, insert_rows=args.insert_rows,
                                              insert_mb=args.insert_mb,
                                              batch_mb=args.batch_mb).result())
    owned, direct, ringed = fresh["owner"], fresh["direct"], fresh["ring"]
    through_owner = {"payload_bytes": widest, "writers": most, **_rates(owned),
                     "finish_run_s": statistics.median(r["finish_run_s"] for r in owned),
                     "close_s": statistics.median(r["close_s"] for r in owned),
                     "direct_bps": statistics.median(r["bps"] for r in direct),
                     "direct_cpu_s_per_GB": _median(
                         r["cpu_s_per_GB"] for r in direct),
                     **{f"ring_{k}": v for k, v in _rates(ringed).items()},
                     "ring_used": all(r["shared"] for r in ringed)
                     and not any(r["shared"] for r in owned),
                     "delivered": all(r["delivered"] for r in owned + direct + ringed),
                     "runs": owned, "direct_runs": direct, "ring_runs": ringed}
    channel: dict[str, list[Json]] = {how: [] for how, _, _ in CHANNEL_VARIANTS}
    for _ in range(args.repeat):
        for how, ring_bytes, busy in CHANNEL_VARIANTS:
            channel[how].append(owner_channel(widest, args.mb * 1_000_000, ring_bytes,
                                              args.batch_mb, busy=busy))
    channels = [{"how": how, **_rates(runs), "shared": all(r["shared"] for r in runs),
                 "owner_faults_per_GB": statistics.median(
                     r["owner_faults_per_GB"] for r in runs),
                 "ring_waits": sum(r["ring_waits"] for r in runs), "runs": runs}
                for how, runs in channel.items()]
    back = readback(root, *args.readback)
    cost = export_cost(root, args.export[0], args.export[1], args.repeat, args.export_rows[0])
    headline = max(rows, key=lambda r: (r["payload_bytes"], r["writers"]))
    data["bound"] = headline["bound"]
    table: list[Json] = [
        {"payload KiB": r["payload_bytes"] / 1024, "writers": r["writers"],
         "MB/s": r["bps"] / 1e6, "synced MB/s": r["synced_bps"] / 1e6,
         "spread": r["synced_spread"], "cpu s/GB": r["cpu_s_per_GB"],
         "writer cpu s/GB": r["writer_cpu_s_per_GB"], "sync s": r["sync_seconds"],
         "compression": r["compression"], "limit MB/s": r["bound"]["limit_bps"] / 1e6,
         "of bound": r["of_bound"], "stored": "all" if r["delivered"] else "LOST"}
        for r in rows]
    table.append({"new process: through the store owner": f"{widest // 1024} KiB x {most} "
                                                          "writers",
                  "MB/s": through_owner["bps"] / 1e6, "spread": through_owner["spread"],
                  "cpu s/GB (this process)": through_owner["cpu_s_per_GB"],
                  "owner cpu s/GB": through_owner["owner_cpu_s_per_GB"],
                  "finish_run s": through_owner["finish_run_s"],
                  "close s (store free)": through_owner["close_s"],
                  "direct MB/s": through_owner["direct_bps"] / 1e6,
                  "direct cpu s/GB": through_owner["direct_cpu_s_per_GB"],
                  "stored": "all" if through_owner["delivered"] else "LOST"})
    table.append({"new process: through the owner, shared ring": f"{widest // 1024} KiB x "
                                                                 f"{most} writers",
                  "MB/s": through_owner["ring_bps"] / 1e6,
                  "spread": through_owner["ring_spread"],
                  "cpu s/GB (this process)": through_owner["ring_cpu_s_per_GB"],
                  "owner cpu s/GB": through_owner["ring_owner_cpu_s_per_GB"],
                  "ring used": "yes" if through_owner["ring_used"] else "NO"})
    for c in channels:
        table.append({"owner channel alone": f"{widest // 1024} KiB records, batches of "
                                             f"<= {args.batch_mb} MiB, {c['how']}",
                      "MB/s": c["bps"] / 1e6, "spread": c["spread"],
                      "cpu s/GB (this process)": c["cpu_s_per_GB"],
                      "owner cpu s/GB": c["owner_cpu_s_per_GB"],
                      "owner page faults /GB": c["owner_faults_per_GB"],
                      "ring used": "yes" if c["shared"] else "no",
                      "ring waits": c["ring_waits"]})
    table.append({"readback": f"{back['layers']} layers x {back['positions']} positions",
                  "MB": back["bytes"] / 1e6, "available ms (cold)": back["available_ms_cold"],
                  "hidden_states ms": back["hidden_states_ms"],
                  "10-row range ms (cold)": back["range_10_rows_ms_cold"],
                  "read": "equal" if back["equal"] else "DIFFERENT"})
    table.append({"export": f"1 of {cost['requests']} requests over {cost['parts']} parts "
                            f"of {cost['rows_per_insert']} positions",
                  "MB": cost["file_bytes"] / 1e6, "ms": cost["pieces_ms"],
                  "cpu s/GB": cost["pieces_cpu_s_per_GB"],
                  "thread cpu s/GB": cost["pieces_thread_cpu_s_per_GB"],
                  "owner's busy thread s/GB": cost["busy_thread_s_per_GB"],
                  "spread": max(cost["busy_thread_s_per_GB_each"])
                  - min(cost["busy_thread_s_per_GB_each"]),
                  "one tensor a query ms": cost["per_tensor_ms"],
                  "one tensor a query cpu s/GB": cost["per_tensor_cpu_s_per_GB"],
                  "read": "equal" if cost["equal"] else "DIFFERENT"})
    insert = StoreConfig(kind=StoreKind.EMBEDDED, insert_mb=args.insert_mb).insert_bytes
    most_mb = f"{insert >> 20} MiB"
    note = (f"{args.mb} MB a run, median of {args.repeat}, at most {args.insert_rows} records "
            f"and {most_mb} an insert; disk {disk / 1e6:,.0f} MB/s (synced "
            f"write into the store directory, median of {len(probes)} probes, spread "
            f"{spread_of(probes):.2f}); MB/s: until finish_run (inserted, synced) and close "
            "returned; synced MB/s: until a later os.sync() returned; cpu s/GB: the whole "
            "process; writer cpu s/GB: the sink's writer threads; sync s: finish_run's fsync "
            "of the run's files; limit = disk x compression; of bound = synced MB/s / limit "
            "(both synced); headline: "
            f"{headline['payload_bytes'] // 1024} KiB x {headline['writers']} writers")
    print("\n".join(table_lines(table)) + f"\n{note}")
    data["figures"] = {"ingest": rows, "through_owner": through_owner, "channel": channels,
                       "readback": back,
                       "export": cost, "table": table,
                       "note": note,
                       "disk": {"bps": disk, "probes_bps": probes, "spread": spread_of(probes)}}
    data["checks"] = {
        "ingest_delivered": {"ok": all(r["delivered"] for r in rows), "required": True},
        "owner_ingest_delivered": {"ok": through_owner["delivered"], "required": True},
        "channel_ring_used": {"ok": all(c["shared"] == (c["how"] == "ring") for c in channels)
                              and through_owner["ring_used"], "required": False},
        "readback_equal": {"ok": bool(back["equal"]), "required": True},
        "export_equal": {"ok": bool(cost["equal"]), "required": True},
        "compression_measured": {"ok": all(r["compression"] for r in rows), "required": True}}


def main(argv: list[str] | None = None) -> int:
    """Run the store benchmark; 0 when every required check passed, else 1."""
    p = argparse.ArgumentParser(prog="python -m harness store", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: seconds, any machine")
    p.add_argument("--mb", type=int, help=f"MB ingested per run (default {FULL['mb']})")
    p.add_argument("--sizes", type=ints("even payload bytes >= 2, separated by commas",
                                        even=True), help=f"payload bytes ({FULL['sizes']})")
    p.add_argument("--insert-rows", type=int, default=INSERT_ROWS,
                   help=f"most records per insert (DMX_CH_INSERT_ROWS, default {INSERT_ROWS})")
    p.add_argument("--insert-mb", type=int, default=0,
                   help="most payload MiB per insert (DMX_CH_INSERT_MB; default 0: the "
                        "sink's rule, an eighth of the queue, at most 128)")
    p.add_argument("--batch-mb", type=int, default=BATCH_MB,
                   help=f"most MiB a record batch (default {BATCH_MB}, a decode step's; a "
                        "served window flush makes about 80)")
    p.add_argument("--writers", type=ints("writer threads >= 1, separated by commas"),
                   help=f"writer threads (default {FULL['writers']})")
    p.add_argument("--repeat", type=int, help=f"runs per configuration ({FULL['repeat']})")
    p.add_argument("--probe-mb", type=int, help="MiB the disk probe writes (default 1024)")
    p.add_argument("--readback", type=ints("layers,prompt,decode: layers and prompt >= 1, "
                                           "decode >= 0", count=3, low=(1, 1, 0)),
                   help=f"layers,prompt,decode of the readback ({FULL['readback']})")
    p.add_argument("--export", type=ints("requests,inserts: both >= 1", count=2),
                   help=f"requests and inserts of the export's store ({FULL['export']})")
    p.add_argument("--export-rows", type=ints("positions per insert: >= 1", count=1),
                   default=[EXPORT_ROWS],
                   help=f"positions each request adds per insert ({EXPORT_ROWS}; 1: decode)")
    p.add_argument("--dir", type=Path,
                   help="where the scratch stores go, made if missing (default /var/tmp)")
    p.add_argument("--out", type=Path, help="JSON (default $OUT/store.json, else ./store.json)")
    p.set_defaults(**(QUICK if p.parse_known_args(argv)[0].quick else FULL))
    args = p.parse_args(argv)  # string defaults go through their type too
    if min(args.mb, args.repeat, args.probe_mb, args.insert_rows) <= 0:
        p.error("--mb, --repeat, --probe-mb and --insert-rows must be positive")
    if args.batch_mb < 1:
        p.error(f"--batch-mb {args.batch_mb}: a batch of at least 1 MiB")
    if not 0 <= args.insert_mb <= INSERT_MB_MAX:
        p.error(f"--insert-mb {args.insert_mb}: 0 (the sink's rule) or 1 to "
                f"{INSERT_MB_MAX:,} MiB")
    parent = args.dir or (Path("/var/tmp") if os.path.isdir("/var/tmp") else None)
    if parent is not None:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            p.error(f"--dir {parent}: {exc.strerror or exc}; give a directory, made if missing")
    root = Path(tempfile.mkdtemp(prefix="dmi-store-bench-", dir=parent))
    settings = {**vars(args), "dir": str(root), "out": str(args.out), "cpus": os.cpu_count(),
                "device": "cuda" if torch.cuda.is_available() else "cpu",  # the host it ran on
                "python": sys.version.split()[0], "torch": torch.__version__,
                **{n: version(n) for n in ("chdb-core", "clickhouse-connect")}}
    try:
        return run_benchmark("store", settings, lambda data: run(args, root, data), args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
