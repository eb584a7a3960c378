"""Serving benchmark: stock SGLang 0.5.19 against monitored, side by side (GPU machine).

One cell configuration per invocation (model shape, batch x prompt x output; decode CUDA
graphs), these modes, each a separate engine process (tests/gpu/run_engine.py):

* ``stock``: stock SGLang, decode CUDA graphs (the reference);
* ``store[PRESET]``: monitored, persistence to the embedded store; timing ends when
  ``dmi_stop_monitoring`` returned (every row durable);
* ``transport[PRESET]``: monitored with ``DMX_DB_URL=none`` (capture transport only);
* ``return-hidden-states``: SGLang's own ``return_hidden_states`` (server
  ``enable_return_hidden_states=True``, every request ``return_hidden_states=True``);
* ``stock-eager``: stock with ``disable_cuda_graph=True``.

Workload: BATCH concurrent requests (one ``generate`` call) x PROMPT random prompt ids x
OUTPUT tokens (greedy, ignore_eos), after one warm-up wave, repeated in waves until at
least ``--min-seconds`` of generation. Output tokens/s = timed output tokens / seconds
from the first timed wave until the data is durable (stock: until the last wave
returned). Reported per mode: tokens/s, ratio to stock, capture bytes and bytes/s against
the 55 GB/s pinned device-to-host ceiling, the store's ingest rate (writer insert time
and end to end), and PASS/FAIL for the targets: hidden-states with persistence >= 0.95x
stock at batch 64 with graphs; sglang-full transport-only >= 0.8x stock.

Each device command is limited to 10 minutes and an engine start takes 1-3 minutes, so
modes that do not fit in the call are left for the next one: results are merged into a
state file on the machine (``/root/dmi-bench-state``) and into ``--out``; running the
same command again runs the modes still missing (``--merge-from`` merges a JSON copied
from an earlier call). Mode results of another commit are never mixed in silently: the
state file is per commit, and merged files keep each mode's commit.

    python bench/bench_serving.py --out $OUT/bench_serving.json          # all modes
    python bench/bench_serving.py --modes stock,store --out ...          # a subset
    python bench/bench_serving.py --quick --out ...                      # short smoke
    python bench/bench_serving.py --dry-run                              # plan, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

import engine_proc as ep

from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import ConfigurationError

BENCH = "serving"
SCHEMA = 1
BASE_MODES = ("stock", "store", "transport", "return-hidden-states", "stock-eager")
DEFAULT_MODES = "stock,store,transport,transport:sglang-full,return-hidden-states,stock-eager"
TARGETS = (
    # (mode key, minimum ratio to stock, description, needs batch)
    ("store[hidden-states]", 0.95,
     "hidden-states with persistence >= 0.95x stock (batch 64, graphs)", 64),
    ("transport[sglang-full]", 0.80, "sglang-full transport-only >= 0.8x stock", None),
)
STORE_INGEST_BPS = 300e6
TRANSPORT_RECORD_BPS = 1.0e9
"""End-to-end record building measured by bench_transport on the H200 (estimates only)."""
RHS_TOK_S = 3800.0
PROFILE_DELAY_S = 5.0
"""Seconds into the timed workload before py-spy starts (steady decoding by then)."""
ENGINE_OVERHEAD_S = 20.0
READBACK_SAMPLE = 16
READBACK_S = 30.0


@dataclass(frozen=True)
class Mode:
    """One engine of the benchmark."""

    kind: str
    preset: str | None = None

    @property
    def key(self) -> str:
        """The mode's key in the JSON (``store[hidden-states]``)."""
        return f"{self.kind}[{self.preset}]" if self.preset else self.kind

    @property
    def monitored(self) -> bool:
        """True for the dmi-sglang modes."""
        return self.kind in ("store", "transport")

    @property
    def graphs(self) -> bool:
        """Decode CUDA graphs on."""
        return self.kind != "stock-eager"


def parse_modes(text: str, preset: str) -> list[Mode]:
    """``stock,store,transport:sglang-full,...`` -> modes (stock first, no duplicates).

    Raises:
        ValueError: an unknown mode, or a preset on a stock mode.
    """
    modes: list[Mode] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        kind, _, given = token.partition(":")
        if kind not in BASE_MODES:
            msg = f"unknown mode {kind!r}; accepted: {', '.join(BASE_MODES)} " \
                  "(store and transport take :PRESET)"
            raise ValueError(msg)
        if given and kind not in ("store", "transport"):
            msg = f"mode {kind} takes no preset"
            raise ValueError(msg)
        mode = Mode(kind, (given or preset) if kind in ("store", "transport") else None)
        if mode not in modes:
            modes.append(mode)
    if not modes:
        msg = "no mode selected"
        raise ValueError(msg)
    return sorted(modes, key=lambda m: m.kind != "stock")


# -- configuration -------------------------------------------------------------------------
def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    """What makes results comparable (part of the state file's name)."""
    return {
        "bench": BENCH, "schema": SCHEMA, "model": args.model,
        "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "min_seconds": args.min_seconds, "seed": args.seed,
        "mem_fraction_static": args.mem_fraction_static, "max_bs": args.max_bs or args.batch,
        "chunked_prefill_size": args.chunked_prefill_size,
        "config_json": ep.qwen3_config(ep.MODELS[args.model]),
        # only where used, so that the configuration of a plain run keeps its hash
        **({"monitored_env": dict(sorted(args.env.items()))} if args.env else {}),
        **({"profile_seconds": args.profile_seconds} if args.profile_seconds else {}),
        **({"torch_profile_steps": args.torch_profile_steps}
           if args.torch_profile_steps else {}),
    }


def workloads(args: argparse.Namespace, mode: Mode, max_waves: int) -> list[ep.Workload]:
    """Warm-up wave, then the timed waves."""
    rhs = mode.kind == "return-hidden-states"
    n = args.batch
    return [  # the warm-up compiles the same kernels with short prompts (less capture)
        ep.Workload("warmup", n * (min(args.prompt_len, 32),), n * (8,), timed=False,
                    return_hidden_states=rhs, keep_outputs=False),
        ep.Workload("main", n * (args.prompt_len,), n * (args.output_len,),
                    min_seconds=args.min_seconds, max_waves=max_waves,
                    return_hidden_states=rhs, keep_outputs=False),
    ]


def wave_bytes(args: argparse.Namespace, preset: str) -> int:
    """Capture bytes of one timed wave (every request with the overlap extra forward)."""
    reqs = [(args.prompt_len, args.output_len, True)] * args.batch
    return ep.expected_capture(preset, ep.MODELS[args.model], reqs).bytes


def max_waves_for(args: argparse.Namespace, mode: Mode, store_dir: Path) -> tuple[int, str]:
    """(wave cap, why): the store mode is capped by ``--max-store-gb`` and free disk."""
    if mode.kind != "store" or mode.preset is None:
        return args.max_waves, ""
    per_wave = max(wave_bytes(args, mode.preset), 1)
    store_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(store_dir).free
    allowed = min(args.max_store_gb * 1e9, 0.7 * free)
    cap = max(1, int(allowed // per_wave))
    if cap < args.max_waves:
        return cap, (f"{cap} waves of {per_wave / 1e9:.2f} GB fit in {allowed / 1e9:.1f} GB "
                     f"(--max-store-gb {args.max_store_gb}, {free / 1e9:.0f} GB free)")
    return args.max_waves, ""


def engine_spec(args: argparse.Namespace, mode: Mode, model_dir: Path, *, store: Path,
                run_id: str, max_waves: int) -> dict[str, Any]:
    """The ``run_engine.py`` spec of one mode."""
    kwargs = ep.base_engine_kwargs(
        model_dir, graphs=mode.graphs, max_bs=args.max_bs or args.batch,
        mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=args.chunked_prefill_size, seed=args.seed)
    env = {"DMX_SGLANG_ENABLE": "0"}
    if mode.kind == "return-hidden-states":
        kwargs["enable_return_hidden_states"] = True
    if mode.monitored:
        env = {
            "DMX_SGLANG_ENABLE": "1",
            "DMX_HOOK_SELECTION": str(mode.preset),
            "DMX_DB_URL": f"chdb://{store}" if mode.kind == "store" else "none",
            "DMX_MODEL_ID": run_id,
            **args.env,
        }
    spec: dict[str, Any] = {
        "engine": kwargs, "env": env, "monitored": mode.monitored,
        "workloads": [w.spec(args.seed) for w in workloads(args, mode, max_waves)],
    }
    if args.profile_seconds:
        spec["profile"] = {"seconds": args.profile_seconds, "delay_s": PROFILE_DELAY_S,
                           "passes": ["cpu", "gil"], "dir": f"{store}-py-spy"}
    if args.torch_profile_steps:
        spec["torch_profile"] = {"decode_steps": args.torch_profile_steps,
                                 "dir": f"{store}-torch"}
    return spec


def estimate_s(args: argparse.Namespace, mode: Mode, startup: dict[str, float]) -> float:
    """Seconds one mode should take, engine start to shutdown (and read-back)."""
    model = ep.MODELS[args.model]
    key = f"{args.model}-{'graph' if mode.graphs else 'eager'}"
    start = max(startup[key] * 1.15, 10.0) if key in startup else model.startup_s(mode.graphs)
    main = ep.Workload("main", args.batch * (args.prompt_len,), args.batch * (args.output_len,))
    wave = model.generate_s(main, mode.graphs)
    if mode.kind == "return-hidden-states":
        wave = max(wave, main.output_tokens / RHS_TOK_S)
    tail = 0.0
    if mode.monitored and mode.preset:
        rate = STORE_INGEST_BPS if mode.kind == "store" else TRANSPORT_RECORD_BPS
        wave = max(wave, wave_bytes(args, mode.preset) / rate)
        # stop flushes the ring and the sink queue; the store mode then reads back
        tail = 2e9 / rate + READBACK_S if mode.kind == "store" else 5.0
    timed = max(args.min_seconds, wave) + wave  # the last wave overshoots
    return start + wave + timed + tail + ENGINE_OVERHEAD_S


# -- results -------------------------------------------------------------------------------
def mode_figures(args: argparse.Namespace, mode: Mode, res: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s, capture bytes and rates of one finished engine run."""
    timed = next((w for w in res.get("workloads", []) if w["name"] == "main"), None)
    warm = next((w for w in res.get("workloads", []) if w["name"] == "warmup"), None)
    durable = res.get("durable_s") or 0.0
    out: dict[str, Any] = {
        "output_tokens": timed["output_tokens"] if timed else None,
        "waves": timed["waves"] if timed else None,
        "generate_s": timed["seconds"] if timed else None,
        "durable_s": durable,
        "stop_s": res.get("stop_s"),
        "tok_s": timed["output_tokens"] / durable if timed and durable else None,
        "steady_seconds_short": bool(timed and timed["seconds"] < args.min_seconds),
        "startup_s": res.get("startup_s"),
        "hidden_state_numbers": timed["hidden_state_numbers"] if timed else None,
    }
    if mode.kind == "return-hidden-states" and timed:
        numbers = timed["hidden_state_numbers"]
        out["returned_bytes_float32"] = numbers * 4
        out["returned_bytes_per_s"] = numbers * 4 / durable if durable else None
    stopped = res.get("events", {}).get("dmi.stopped")
    closed = res.get("events", {}).get("store.closed")
    if res.get("events", {}).get("dmi.timing"):
        out["timing"] = res["events"]["dmi.timing"]
    if mode.monitored and mode.preset and timed:
        model = ep.MODELS[args.model]
        nbytes = wave_bytes(args, mode.preset) * timed["waves"]
        warm_reqs = [(min(args.prompt_len, 32), 8)] * (warm["requests"] if warm else 0)
        all_reqs = warm_reqs + [(args.prompt_len, args.output_len)] * timed["requests"]
        out.update(
            capture_bytes_timed=nbytes,
            capture_bps=nbytes / timed["seconds"] if timed["seconds"] else None,
            capture_bps_durable=nbytes / durable if durable else None,
            transport=stopped,
            transport_rows_check=ep.check_transport_rows(stopped or {}, mode.preset, model,
                                                         all_reqs),
        )
        out["d2h_fraction"] = (out["capture_bps"] or 0) / ep.D2H_CEILING_BPS
    if closed:
        out["store"] = closed
        if closed.get("insert_seconds"):
            out["store_insert_MBps"] = closed["bytes_stored"] / closed["insert_seconds"] / 1e6
        if durable:
            out["store_e2e_MBps"] = closed.get("bytes_stored", 0) / durable / 1e6
    return out


def read_back_sample(store: Path, run_id: str, waves: int, batch: int,
                     seed: int) -> dict[str, Any]:
    """Stored bytes of the run and completeness of a sample of its timed requests."""
    from dmi_sglang import open_store

    captures = open_store(f"chdb://{store}")
    rng = random.Random(seed)
    rids = [f"main-{rng.randrange(batch)}.w{rng.randrange(waves)}"
            for _ in range(READBACK_SAMPLE)]
    t0 = time.perf_counter()
    with captures.session():
        run = captures.run(run_id)
        incomplete = {rid: list(m) for rid in rids
                      if (m := captures.handle(run_id, rid).missing)}
        stored = sum(t.bytes for t in captures.hook_totals(run_id)) if run else 0
    return {"run_status": run.status.value if run else None, "sampled": len(rids),
            "incomplete": incomplete, "stored_bytes": stored,
            "read_s": time.perf_counter() - t0}


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Rows (ratios to stock) and target verdicts from the merged mode results."""
    modes = data.get("modes", {})
    stock = (modes.get("stock") or {}).get("figures", {}).get("tok_s")
    rows = []
    for key, entry in modes.items():
        fig = entry.get("figures") or {}
        tok = fig.get("tok_s")
        rows.append({
            "mode": key, "ok": entry.get("ok"), "tok_s": tok,
            "ratio": tok / stock if tok and stock else None,
            "waves": fig.get("waves"), "durable_s": fig.get("durable_s"),
            "capture_bytes": fig.get("capture_bytes_timed", fig.get("returned_bytes_float32")),
            "capture_bps": fig.get("capture_bps", fig.get("returned_bytes_per_s")),
            "d2h_fraction": fig.get("d2h_fraction"),
            "store_insert_MBps": fig.get("store_insert_MBps"),
            "store_e2e_MBps": fig.get("store_e2e_MBps"),
            "startup_s": fig.get("startup_s"),
            "commit": entry.get("commit"), "code": entry.get("code_fingerprint"),
            "ran_at_utc": entry.get("ran_at_utc"),
            "error": entry.get("error"),
        })
    order = {m: i for i, m in enumerate(("stock", "store[hidden-states]",
                                         "transport[hidden-states]", "transport[sglang-full]",
                                         "return-hidden-states", "stock-eager"))}
    rows.sort(key=lambda r: (order.get(r["mode"], 50), r["mode"]))
    targets = []
    batch = (data.get("config") or {}).get("batch")
    for key, minimum, text, need_batch in TARGETS:
        row = next((r for r in rows if r["mode"] == key), None)
        if need_batch is not None and batch != need_batch:
            verdict = f"n/a (batch {batch})"
        elif row is None or row["ratio"] is None:
            verdict = "not measured"
        else:
            verdict = "PASS" if row["ratio"] >= minimum else "FAIL"
        targets.append({"mode": key, "minimum_ratio": minimum, "target": text,
                        "ratio": row["ratio"] if row else None, "verdict": verdict})
    return {"rows": rows, "targets": targets}


def breakdown(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Where the time of each monitored mode went, from its counters: the capture rate
    stock speed would need (and, for transport-only, the ratio the 55 GB/s pinned
    device-to-host ceiling allows at most), seconds the scheduler waited for ring space,
    the scheduler thread's time in the hooks per forward (its waits for ring space at
    commit included), the drain thread's CPU time
    building records and its time blocked handing them to the sink, and how busy the
    store's writers were. Counters a run did not report are None."""
    modes = data.get("modes", {})
    stock = ((modes.get("stock") or {}).get("figures") or {}).get("tok_s")
    out = []
    for key, entry in modes.items():
        fig = entry.get("figures") or {}
        if "capture_bytes_timed" not in fig:
            continue
        durable = fig.get("durable_s") or 0.0
        tokens = fig.get("output_tokens") or 0
        per_token = fig["capture_bytes_timed"] / tokens if tokens else None
        need = per_token * stock if per_token and stock else None
        transport = fig.get("transport") or {}
        timing = fig.get("timing") or {}
        store = fig.get("store") or {}
        forwards = timing.get("forwards") or transport.get("steps")
        host = timing.get("host_seconds")
        build = timing.get("drain_build_cpu_seconds")
        writers = store.get("writers", 2 if store else None)  # 2: default, not logged before
        out.append({
            "mode": key, "durable_s": durable,
            "needed_bps_at_stock": need,
            "d2h_bound_ratio": (min(1.0, ep.D2H_CEILING_BPS / need)
                                if need and key.startswith("transport") else None),
            "stall_s": transport.get("stall_seconds"),
            "stall_share": (transport["stall_seconds"] / durable
                            if durable and transport.get("stall_seconds") is not None else None),
            "hook_us_per_forward": (host / forwards * 1e6
                                    if host is not None and forwards else None),
            "drain_build_cpu_s": (None if build is None else
                                  build + timing.get("drain_copy_worker_cpu_seconds", 0.0)),
            "drain_sink_blocked_s": timing.get("drain_sink_seconds"),
            "store_writers": writers,
            "store_writer_busy": (store["insert_seconds"] / (writers * durable)
                                  if store.get("insert_seconds") and writers and durable
                                  else None),
        })
    return out


def profile_lines(data: dict[str, Any], threads: int = 4, frames: int = 3) -> list[str]:
    """Per profiled mode and pass: the busiest threads and their top self frames."""
    lines = []
    for key, entry in (data.get("modes") or {}).items():
        prof = entry.get("profile") or {}
        for name in ("cpu", "gil"):
            digest = prof.get(name)
            if not digest:
                continue
            if digest.get("error"):
                lines.append(f"{key} [{name}]: {digest['error']}")
                continue
            for t in digest.get("threads", [])[:threads]:
                top = "; ".join(f"{f} {share:.0%}" for f, share in t["self"][:frames])
                lines.append(f"{key} [{name}] {t['share']:.0%} {t['thread']}: {top}")
    return lines


def torch_profile_lines(data: dict[str, Any], kernels: int = 3) -> list[str]:
    """Per torch-profiled mode: how busy the GPU was over the profiled decode steps, the
    capture copies and whether they ran under kernels, the top kernels and host threads."""
    lines = []
    for key, entry in (data.get("modes") or {}).items():
        digest = entry.get("torch_profile")
        if not digest:
            continue
        if digest.get("error"):
            lines.append(f"{key} [torch]: {digest['error']}")
            continue
        gpu = digest.get("gpu")
        if not gpu or not gpu.get("span_us"):
            lines.append(f"{key} [torch]: no GPU events in {digest.get('file')}")
            continue
        counts = digest.get("steps") or {}
        steps = sum(counts.values())
        what = ", ".join(f"{n} {mode.lower()}" for mode, n in sorted(counts.items())) or "?"
        per_step = f", {gpu['span_us'] / steps / 1e3:.2f} ms per step" if steps else ""
        if gpu.get("kernels_missing"):
            lines.append(f"{key} [torch] {gpu['span_us'] / 1e3:.0f} ms, steps: {what}: no "
                         "kernels recorded (CUPTI missed the graph kernels): shares unknown")
            continue
        lines.append(
            f"{key} [torch] {gpu['span_us'] / 1e3:.0f} ms, steps: {what}{per_step}: GPU busy "
            f"{gpu['gpu_busy_share']:.0%} (kernels {gpu['kernel_busy_share']:.0%}), waiting "
            f"for the host {gpu['gpu_idle_us'] / 1e3:.0f} ms")
        for c in gpu.get("copies", [])[:2]:
            rate = f", {c['gb_per_s']:.1f} GB/s" if c.get("gb_per_s") else ""
            lines.append(f"{key} [torch] copies {c['name']}: {c['count']} x, "
                         f"{c['us'] / 1e3:.1f} ms{rate}, {c['hidden_share']:.0%} under kernels")
        top = "; ".join(f"{k['name'][:40]} {k['us'] / gpu['span_us']:.0%}"
                        for k in gpu.get("kernels", [])[:kernels])
        if top:
            lines.append(f"{key} [torch] top kernels (share of the span): {top}")
        for t in digest.get("threads", [])[:2]:
            ops = "; ".join(f"{n} {us / 1e3:.1f} ms" for n, us in t["top"][:kernels])
            lines.append(f"{key} [torch] host thread {t['thread']}: operators "
                         f"{t['op_us'] / 1e3:.0f} ms ({ops})")
    return lines


def render_breakdown(data: dict[str, Any]) -> str:
    """:func:`breakdown` and :func:`profile_lines` as text."""
    rows = breakdown(data)
    if not rows:
        return ""
    head = (f"{'where the time goes':<26} {'need GB/s':>9} {'d2h max':>7} {'stall s':>8} "
            f"{'stall %':>7} {'hook us':>8} {'build s':>8} {'sink s':>7} {'writers':>7} "
            f"{'busy %':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['mode']:<26} {_f(r['needed_bps_at_stock'], '.2f', 1e-9):>9} "
            f"{_f(r['d2h_bound_ratio'], '.2f'):>7} {_f(r['stall_s'], '.1f'):>8} "
            f"{_f(r['stall_share'], '.0f', 100):>7} {_f(r['hook_us_per_forward'], '.0f'):>8} "
            f"{_f(r['drain_build_cpu_s'], '.1f'):>8} {_f(r['drain_sink_blocked_s'], '.1f'):>7} "
            f"{_f(r['store_writers'], 'd'):>7} {_f(r['store_writer_busy'], '.0f', 100):>6}")
    return "\n".join(lines + profile_lines(data) + torch_profile_lines(data))


def _f(value: Any, fmt: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return format(value if scale == 1.0 else value * scale, fmt)


def render_table(data: dict[str, Any]) -> str:
    """The side-by-side table and the target verdicts, as text."""
    s = summarize(data)
    head = (f"{'mode':<26} {'tok/s':>9} {'x stock':>8} {'waves':>5} {'capture GB':>10} "
            f"{'GB/s':>7} {'% 55GB/s':>8} {'ins MB/s':>8} {'e2e MB/s':>8} {'start s':>7}")
    lines = [head, "-" * len(head)]
    for r in s["rows"]:
        mode = r["mode"] + ("" if r["ok"] else " (ERROR)")
        lines.append(
            f"{mode:<26} {_f(r['tok_s'], ',.0f'):>9} {_f(r['ratio'], '.3f'):>8} "
            f"{_f(r['waves'], 'd'):>5} {_f(r['capture_bytes'], '.2f', 1e-9):>10} "
            f"{_f(r['capture_bps'], '.2f', 1e-9):>7} {_f(r['d2h_fraction'], '.1f', 100):>8} "
            f"{_f(r['store_insert_MBps'], '.0f'):>8} {_f(r['store_e2e_MBps'], '.0f'):>8} "
            f"{_f(r['startup_s'], '.0f'):>7}")
    for t in s["targets"]:
        lines.append(f"target: {t['target']}: {t['verdict']}"
                     + ("" if t["ratio"] is None else f" ({t['ratio']:.3f}x)"))
    pending = data.get("pending_modes") or []
    if pending:
        lines.append(f"pending (did not fit in this call; run the same command again): "
                     f"{', '.join(pending)}")
    return "\n".join(lines)


def merge(base: dict[str, Any], other: dict[str, Any], *, force: bool = False) -> dict[str, Any]:
    """Mode results of ``other`` into ``base`` (same configuration): per mode a run that
    succeeded beats one that failed, then the newer run wins (a failed rerun does not hide
    an earlier measurement; it stays in its own file and log).

    Raises:
        ValueError: the configurations differ (unless ``force``).
    """
    if other.get("config_hash") != base.get("config_hash") and not force:
        msg = (f"cannot merge results of configuration {other.get('config_hash')} into "
               f"{base.get('config_hash')} (different model or workload); --force-merge "
               "overrides")
        raise ValueError(msg)
    for key, entry in (other.get("modes") or {}).items():
        mine = base["modes"].get(key)
        if mine is None or _rank(entry) > _rank(mine):
            base["modes"][key] = entry
    return base


def _rank(entry: dict[str, Any]) -> tuple[bool, str]:
    return bool(entry.get("ok")), str(entry.get("ran_at_utc") or "")


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# -- running -------------------------------------------------------------------------------
Launcher = Callable[[dict[str, Any], Path, str, float], dict[str, Any]]


def run_mode(args: argparse.Namespace, mode: Mode, model_dir: Path, work: Path, *,
             timeout_s: float, launcher: Launcher = ep.launch,
             read_back: Callable[..., dict[str, Any]] = read_back_sample) -> dict[str, Any]:
    """Start one engine for ``mode``; its JSON entry."""
    store = work / "stores" / mode.key.replace("[", "-").replace("]", "")
    shutil.rmtree(store, ignore_errors=True)
    cap, why = max_waves_for(args, mode, store.parent)
    run_id = f"bench-{mode.kind}-{ep.utc_now().replace(':', '').replace('-', '')[:15]}"
    spec = engine_spec(args, mode, model_dir, store=store, run_id=run_id, max_waves=cap)
    entry: dict[str, Any] = {"mode": mode.key, "ran_at_utc": ep.utc_now(),
                             "engine": spec["engine"], "env": spec["env"],
                             "wave_cap": cap, "wave_cap_reason": why}
    res = launcher(spec, work / "engines", mode.key.replace("[", "-").replace("]", ""),
                   timeout_s)
    entry.update(
        finished_at_utc=ep.utc_now(), ok=bool(res.get("ok")), error=res.get("error"),
        env_info=res.get("env_info"), run_id=res.get("run_id"),
        leftover_processes=res.get("leftover_processes"), timed_out=res.get("timed_out"),
        workloads=res.get("workloads"), events=res.get("events"),
        figures=mode_figures(args, mode, res) if res.get("ok") else None,
    )
    for digest in ("profile", "torch_profile"):
        if res.get(digest):
            entry[digest] = res[digest]
    if not res.get("ok"):
        entry["log_tail"] = res.get("log_tail")
    if res.get("ok") and mode.kind == "store":
        try:
            main = next(w for w in res["workloads"] if w["name"] == "main")
            entry["readback"] = read_back(store, res.get("run_id") or run_id, main["waves"],
                                          args.batch, args.seed)
        except Exception as exc:  # the measurement stands; the read-back says why not
            entry["readback"] = {"error": repr(exc)}
    if not args.keep_store:
        shutil.rmtree(store, ignore_errors=True)
    return entry


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="JSON results (default: $OUT/bench_serving.json, else "
                        "./bench_serving.json)")
    p.add_argument("--model", choices=sorted(ep.MODELS), default="0.6b")
    p.add_argument("--preset", default="hidden-states",
                   help="hook preset of bare 'store' / 'transport' modes")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated, in {', '.join(BASE_MODES)}; store/transport "
                        f"take :PRESET (default: {DEFAULT_MODES})")
    p.add_argument("--batch", type=int, default=64, help="concurrent requests per wave")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-seconds", type=float, default=30.0,
                   help="generate for at least this long (waves of --batch requests)")
    p.add_argument("--max-waves", type=int, default=10000)
    p.add_argument("--quick", action="store_true",
                   help="short smoke: --min-seconds 3 --prompt-len 64 --output-len 32")
    p.add_argument("--seed", type=int, default=ep.SEED)
    p.add_argument("--mem-fraction-static", type=float, default=0.45)
    p.add_argument("--max-bs", type=int, default=0, help="decode graph max batch (0: --batch)")
    p.add_argument("--chunked-prefill-size", type=int, default=0,
                   help="0: SGLang's default (as in the reference measurements)")
    p.add_argument("--max-store-gb", type=float, default=24.0,
                   help="cap on the store mode's captured bytes (waves are capped)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds this invocation may use (0: no limit; default: until 45 s "
                        "before the device call's 10-minute limit)")
    p.add_argument("--state", default=None, help="state directory (default "
                   "/root/dmi-bench-state where writable)")
    p.add_argument("--merge-from", action="append", default=[],
                   help="earlier JSON results of the same configuration to merge")
    p.add_argument("--force-merge", action="store_true")
    p.add_argument("--fresh", action="store_true", help="ignore the state file")
    p.add_argument("--rerun", action="store_true",
                   help="run the selected modes even where results exist")
    p.add_argument("--work", default=None, help="engine logs and stores (default: temp dir)")
    p.add_argument("--keep-store", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    p.add_argument("--env", action="append", default=[], metavar="DMX_NAME=VALUE",
                   help="a setting for the monitored modes, e.g. DMX_CH_WRITERS=8 (repeatable; "
                        "part of the configuration)")
    p.add_argument("--profile-seconds", type=float, default=0.0,
                   help="py-spy every mode's engine (cpu pass, then gil pass) for this long "
                        "each, from 5 s into the timed workload; digests go into the JSON. "
                        "Sampling perturbs throughput: a separate configuration")
    p.add_argument("--torch-profile-steps", type=int, default=0,
                   help="torch-profile (SGLang's profiler: CPU and GPU) this many decode "
                        "steps of every mode's timed workload; a digest goes into the JSON. "
                        "A separate configuration, like --profile-seconds")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and normalise the command line (``--quick`` applied, modes parsed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.min_seconds, args.prompt_len, args.output_len = 3.0, 64, 32
    for name in ("batch", "prompt_len", "output_len", "max_waves"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        parser.error("--output-len must be >= 2")
    try:
        args.mode_list = parse_modes(args.modes, args.preset)
        for mode in args.mode_list:
            if mode.preset:
                ep.captures_of(mode.preset, ep.MODELS[args.model])
    except Exception as exc:  # ValueError or the domain's ConfigurationError
        parser.error(str(exc))
    args.env = dict(_setting(parser, text) for text in args.env)
    try:
        Settings.from_env(args.env)
    except ConfigurationError as exc:
        parser.error(f"--env: {exc}")
    if args.profile_seconds < 0:
        parser.error("--profile-seconds must be >= 0")
    if not 0 <= args.torch_profile_steps < args.output_len:
        parser.error(f"--torch-profile-steps {args.torch_profile_steps}: expected 0 (off) up "
                     f"to {args.output_len - 1}, below --output-len, so that the profile stays "
                     "within the first wave's decode steps")
    if args.out is None:
        base = os.environ.get("OUT")
        args.out = str(Path(base) / "bench_serving.json") if base else "bench_serving.json"
    return args


MODE_VARIABLES = ("DMX_SGLANG_ENABLE", "DMX_HOOK_SELECTION", "DMX_DB_URL", "DMX_MODEL_ID")
"""Set by each mode itself; ``--env`` may not change them (use ``--modes``/``--preset``)."""


def _setting(parser: argparse.ArgumentParser, text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("DMX_"):
        parser.error(f"--env {text!r}: expected DMX_NAME=VALUE, e.g. DMX_CH_WRITERS=8")
    if name in MODE_VARIABLES:
        parser.error(f"--env {name}: set by each mode; accepted: any other DMX_ setting "
                     "(the modes and --preset choose these)")
    return name, value


def _state_dir(args: argparse.Namespace) -> Path:
    if args.state:
        return Path(args.state)
    if args.dry_run:  # look, do not create
        return Path(os.environ.get("DMI_STATE_ROOT", "/root")) / "dmi-bench-state"
    return ep.default_state_dir("dmi-bench-state",
                                Path(args.out).resolve().parent / ".bench-state")


def _merged(args: argparse.Namespace, config: dict[str, Any],
            state_path: Path) -> dict[str, Any]:
    """Earlier results of this configuration: the state file and ``--merge-from`` files."""
    data: dict[str, Any] = {"bench": BENCH, "schema": SCHEMA, "config": config,
                            "config_hash": ep.stable_hash(config), "modes": {}}
    for path in ([] if args.fresh else [state_path]) + [Path(p) for p in args.merge_from]:
        other = _load(path)
        if other is not None:
            data = merge(data, other, force=args.force_merge)
    return data


def main(argv: Sequence[str] | None = None, launcher: Launcher = ep.launch,
         read_back: Callable[..., dict[str, Any]] = read_back_sample,
         clock: Callable[[], float] = time.time) -> int:
    """Run the benchmark; exit 0 complete, 1 a mode failed, 3 modes left for a next call."""
    args = parse_args(argv)
    config = bench_config(args)
    git = ep.git_info()
    out_path = Path(args.out)
    state_dir = _state_dir(args)
    state_path = state_dir / (f"{ep.stable_hash(config)}-{git['commit'][:12]}-"
                              f"{git['code']}.json")
    data = _merged(args, config, state_path)
    todo = [m for m in args.mode_list if args.rerun or m.key not in data["modes"]]
    startup = _load(state_dir / "timings.json") or {}
    deadline = ep.call_deadline(args.budget_s, now=clock())
    print(_plan(args, todo, startup, deadline, clock()), flush=True)
    if args.dry_run:
        print(render_table(data))
        return 0
    if launcher is ep.launch:
        killed = ep.track_engines(state_dir / "engines.pgids")
        if killed:
            print(f"[bench] killed engines left by an earlier call: {killed}", flush=True)
    model_dir = ep.write_model_dir(state_dir / "models", ep.MODELS[args.model])
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dmi-bench-"))
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    failed = False
    pending = [m.key for m in todo]
    for mode in todo:
        left = float("inf") if deadline is None else deadline - clock()
        est = estimate_s(args, mode, startup)
        if est > left:
            print(f"[bench] {mode.key}: needs ~{est:.0f} s, {max(left, 0):.0f} s left: "
                  "left for the next call", flush=True)
            continue
        print(f"[bench] {mode.key}: starting (~{est:.0f} s)", flush=True)
        entry = run_mode(args, mode, model_dir, work, timeout_s=min(900.0, max(left, 60.0)),
                         launcher=launcher, read_back=read_back)
        entry.update(commit=git["commit"], dirty=git["dirty"], code_fingerprint=git["code"],
                     command=command)
        data["modes"][mode.key] = entry
        pending.remove(mode.key)
        failed = failed or not entry["ok"]
        if entry.get("figures") and entry["figures"].get("startup_s"):
            startup[f"{args.model}-{'graph' if mode.graphs else 'eager'}"] = \
                entry["figures"]["startup_s"]
            ep.write_json(state_dir / "timings.json", startup)
        _write(data, pending, out_path, state_path)
        print(f"[bench] {mode.key}: {'ok' if entry['ok'] else 'ERROR ' + str(entry['error'])}",
              flush=True)
    _write(data, pending, out_path, state_path)
    print(render_table(data))
    print(render_breakdown(data))
    if failed:
        return 1
    return 3 if pending else 0


def _write(data: dict[str, Any], pending: list[str], out: Path, state: Path) -> None:
    data["pending_modes"] = list(pending)
    data["written_at_utc"] = ep.utc_now()
    data["summary"] = summarize(data)
    ep.write_json(out, data)
    ep.write_json(state, data)


def _plan(args: argparse.Namespace, todo: Sequence[Mode], startup: dict[str, float],
          deadline: float | None, now: float) -> str:
    model = ep.MODELS[args.model]
    lines = [f"bench_serving: Qwen3-{args.model.upper()} shape (dummy weights), "
             f"{args.batch} x {args.prompt_len} prompt x {args.output_len} output, "
             f">= {args.min_seconds:g} s per mode; {model.layers} layers, hidden {model.hidden}"]
    total = 0.0
    left = float("inf") if deadline is None else deadline - now
    for mode in todo:
        est = estimate_s(args, mode, startup)
        total += est
        extra = ""
        if mode.preset:
            extra = f"  {wave_bytes(args, mode.preset) / 1e9:.2f} GB captured per wave"
        lines.append(f"  {mode.key:<26} ~{est:>4.0f} s  cum. {total:>5.0f} s  "
                     f"{'fits' if total <= left else 'next call'}{extra}")
    if not todo:
        lines.append("  every selected mode has results (--rerun to measure again)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
