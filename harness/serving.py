"""Serving benchmark: monitored SGLang 0.5.19 against stock, bracketed, beside its bound.

    python -m harness serving --out FILE [--model 0.6b] [--modes MODES] [--repeats 2]
    python -m harness serving --dry-run

Modes (each its own engine, started ``--repeats`` times, modes interleaved):
``store:PRESET`` (embedded store; timing ends when ``dmi_stop_monitoring()`` returned, the
data durable), ``transport:PRESET`` (``DMX_DB_URL=none``: capture transport only) and
``return-hidden-states`` (SGLang's own ``return_hidden_states``); a store or transport mode
may carry ``DMX_*`` settings of its own in brackets
(``transport:sglang-full[DMX_DRAIN_WINDOW_MB=2048]``), added to ``--env``'s. Every measured engine
runs between two runs of the same workload on the stock engine of the same ServerArgs
(:mod:`harness.bracket`): ``stock, measured, stock, measured, ..., stock``.

Workload: BATCH requests x PROMPT random ids x OUTPUT tokens (greedy, ignore_eos), one
warm-up wave, then waves for at least ``--min-seconds``, a stored cell's until they
captured 20 GB if that comes first (:func:`timed_waves_at_most`). Per mode: the median ratio to the
stock runs around it, the spread of the ratios and of stock, and the bound measured in
the same run: pinned D2H for transport modes, synced disk write x on-disk compression for
store modes, over the capture rate stock speed needs. Checks: tokens identical to stock
(first wave), every row accounted for (transport statistics / a read-back sample and
bytes stored = captured). Exit status 0: complete; 1: a check failed; 3: units left for the
next invocation (run the same command again: units are resumed from the state directory).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmi_sglang.domain.ports import HOOK_PARTS
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import ConfigurationError
from harness import checks
from harness.bounds import bound, directory_bytes, measure_disk_bps, spread_of
from harness.bracket import Bracket
from harness.constants import (
    ENGINE_OVERHEAD_S,
    MAX_TOTAL_TOKENS,
    MAX_WAVES,
    REFERENCE_MODEL,
    SEED,
    STORE_INGEST_BPS,
    STORED_CELL_CAPTURE_BYTES,
    TARGET_MIN_SECONDS,
    TARGET_WORKLOAD,
    TARGETS,
)
from harness.engine import kill_leftovers
from harness.models import (
    MODELS,
    STOCK_ENV,
    engine_kwargs,
    monitored_env,
    qwen3_config,
    write_model_dir,
)
from harness.results import (
    Deadline,
    Json,
    Resumable,
    compact_utc,
    finish,
    load_json,
    result,
    stable_hash,
    state_dir,
    write_json,
)
from harness.workloads import Workload, check_transport_rows, expected_capture

KINDS = ("store", "transport", "return-hidden-states")
DEFAULT_MODES = "store:hidden-states,transport:hidden-states,transport:sglang-full"
READBACK_SAMPLE = 16


@dataclass(frozen=True)
class Mode:
    """One measured engine configuration: the kind, the hook preset and the ``DMX_*``
    settings of this mode alone (``transport:sglang-full[DMX_DRAIN_WINDOW_MB=2048]``)."""

    kind: str
    preset: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        """``store:hidden-states``."""
        return f"{self.kind}:{self.preset}" if self.preset else self.kind

    @property
    def slug(self) -> str:
        """The key and the mode's own settings as a file and run-id part
        (``store-final_logits-topk-64``, ``transport-sglang-full-DMX_DRAIN_WINDOW_MB-2048``)."""
        return slug(cell(self.key, dict(self.env)))


def mode_env(args: argparse.Namespace, mode: Mode) -> dict[str, str]:
    """The settings a monitored engine of ``mode`` gets: ``--env`` and the mode's own
    (none for ``return-hidden-states``, which runs with stock's)."""
    if mode.kind == "return-hidden-states":
        return {}
    return {**args.env, **dict(mode.env)}


def slug(key: str) -> str:
    """``key`` with every run of characters a run id or file name should not hold
    (``:``, ``(``, ``)``, ``,``, spaces) replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", key).strip("-")


def parse_modes(text: str) -> list[Mode]:
    """``store:hidden-states,transport:sglang-full,...``, each optionally with settings of
    its own in brackets (``transport:sglang-full[DMX_DRAIN_WINDOW_MB=2048 DMX_...=...]``:
    a setting measured against the mode without it in one bracketed run); a clear error
    for anything else."""
    modes = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        found = re.fullmatch(r"([^\[\]]+?)\s*(?:\[([^\[\]]*)\])?", token)
        base = found.group(1) if found else token
        kind, _, preset = base.partition(":")
        if not found or kind not in KINDS or \
                bool(preset) != (kind != "return-hidden-states"):
            raise ValueError(f"mode {token!r}: accepted store:PRESET, transport:PRESET, "
                             "return-hidden-states, each optionally followed by "
                             "[DMX_NAME=VALUE ...]")
        env = tuple(sorted(setting_pairs(found.group(2).split() if found.group(2) else [],
                                         f"mode {base!r}").items()))
        if env and kind == "return-hidden-states":
            raise ValueError(f"mode {token!r}: return-hidden-states takes no DMX_* settings")
        if Mode(kind, preset or None, env) not in modes:
            modes.append(Mode(kind, preset or None, env))
    if not modes:
        raise ValueError("no mode selected")
    return modes


OWN_SETTINGS = ("DMX_SGLANG_ENABLE", "DMX_HOOK_SELECTION", "DMX_DB_URL", "DMX_MODEL_ID")
"""Settings every monitored engine's mode sets itself (never from ``--env``)."""


def setting_pairs(items: Sequence[str], where: str) -> dict[str, str]:
    """``DMX_NAME=VALUE`` items as a dict, each a valid setting given once, not one the
    modes set themselves (:data:`OWN_SETTINGS`) and not a secret (results name their
    settings), its value as the settings write it (``02048`` -> ``2048``, ``0.10`` ->
    ``0.1``: one cell name per engine); raises ValueError naming the first bad one and
    ``where`` it was given."""
    settings: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("DMX_"):
            raise ValueError(f"{where}: {item!r}: expected DMX_NAME=VALUE")
        if key in OWN_SETTINGS:
            raise ValueError(f"{where}: {key} is set by every mode itself "
                             f"({', '.join(OWN_SETTINGS)} are)")
        if key in settings:
            raise ValueError(f"{where}: {key} is given twice: give it once")
        settings[key] = value
    try:
        parsed = Settings.from_env(settings)
    except ConfigurationError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    written, shown = parsed.to_env(), parsed.to_env(include_secrets=False)
    if hidden := sorted(k for k in settings if k in written and k not in shown):
        raise ValueError(f"{where}: {hidden[0]} is a secret, which results would name: "
                         "not accepted here")
    return {k: shown.get(k, v) for k, v in settings.items()}


def workloads(args: argparse.Namespace, mode: Mode | None) -> tuple[Workload, Workload]:
    """(warm-up wave, timed waves) of one engine (``mode`` None: stock)."""
    rhs = mode is not None and mode.kind == "return-hidden-states"
    n = args.batch
    warm = Workload("warmup", n * (min(args.prompt_len, 32),), n * (8,), timed=False,
                    return_hidden_states=rhs, keep_outputs=False)
    main = Workload("main", n * (args.prompt_len,), n * (args.output_len,),
                    min_seconds=args.min_seconds, max_waves=timed_waves_at_most(args, mode),
                    return_hidden_states=rhs, named_waves=True)  # as wave_rids names them
    return warm, main


def timed_waves_at_most(args: argparse.Namespace, mode: Mode | None) -> int:
    """The timed waves an engine of ``mode`` runs at most: a stored cell stops once its
    waves captured :data:`~harness.constants.STORED_CELL_CAPTURE_BYTES` (its requests'
    share of each wave's bytes), every other engine at
    :data:`~harness.constants.MAX_WAVES`; ``--min-seconds`` may end them sooner."""
    if mode is None or not mode.preset or stored_wave_bytes(args, mode) <= 0:
        return MAX_WAVES
    env = mode_env(args, mode)
    per_request = wave_bytes(args, mode.preset) / args.batch
    captured = 0.0
    for k in range(MAX_WAVES):  # the requests the sample keeps, as the checks count them
        captured += per_request * len(sampled(env, wave_rids(args, k)))
        if captured >= STORED_CELL_CAPTURE_BYTES:
            return k + 1
    return MAX_WAVES


def wave_rids(args: argparse.Namespace, wave: int) -> list[str]:
    """The request ids of timed wave ``wave`` (from 0) of a monitored engine."""
    return [f"main-{i}.w{wave}" for i in range(args.batch)]


def stored_wave_bytes(args: argparse.Namespace, mode: Mode | None) -> float:
    """Bytes one timed wave of a stored cell captures (its sampled share of
    :func:`wave_bytes`); 0 for stock and capture-only engines."""
    if mode is None or mode.kind != "store" or not mode.preset:
        return 0.0
    share = float(mode_env(args, mode).get("DMX_REQUEST_SAMPLE", 1.0))
    return wave_bytes(args, mode.preset) * share


def settings(args: argparse.Namespace) -> Json:
    """What decides the results (the state is keyed by its hash)."""
    return {"model": args.model, "config_json": qwen3_config(MODELS[args.model]),
            "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "min_seconds": args.min_seconds,
            "stored_cell_capture_bytes": STORED_CELL_CAPTURE_BYTES, "seed": SEED,
            "engine": engine_kwargs("<model>", graphs=True, max_bs=args.batch,
                                    chunked_prefill_size=0),
            "env": dict(sorted(args.env.items()))}


def estimate_s(args: argparse.Namespace, mode: Mode) -> float:
    """Seconds one bracketed unit should take (engine start, warm-up, waves, stock block)."""
    model = MODELS[args.model]
    wave = model.generate_s(args.batch * (args.prompt_len,), args.batch * (args.output_len,),
                            True)
    timed = max(float(args.min_seconds), wave) + wave  # stock's waves, or a monitored
    monitored = timed  # engine's at stock speed; a stored one waits for its store
    tail = 20.0 if mode.kind == "store" else 5.0
    per_wave = stored_wave_bytes(args, mode)
    if per_wave > 0:  # its waves end at the cap, and its stop waits for the store
        cap = timed_waves_at_most(args, mode)
        waves = min(timed / wave, cap)
        monitored = max(min(timed, (cap + 1) * wave), per_wave * waves / STORE_INGEST_BPS)
    return model.startup_s + timed + monitored + tail + ENGINE_OVERHEAD_S


def wave_bytes(args: argparse.Namespace, preset: str) -> int:
    """Capture bytes of one timed wave (every request with the extra forward)."""
    reqs = [(args.prompt_len, args.output_len, True)] * args.batch
    return expected_capture(preset, MODELS[args.model], reqs).bytes


def sampled(env: dict[str, str], rids: Sequence[str]) -> set[str]:
    """The request ids a monitored engine with settings ``env`` captures under
    ``DMX_REQUEST_SAMPLE`` (every one without it): the domain's own rule."""
    from dmi_sglang.domain.sampling import RequestSample

    sample = RequestSample(float(env.get("DMX_REQUEST_SAMPLE", 1.0)))
    return {r for r in rids if sample.keeps(r)}


def monitored_spec(args: argparse.Namespace, mode: Mode, kwargs: Json, store: Path,
                   run_id: str) -> Json:
    """The measured engine of ``mode``."""
    if mode.kind == "return-hidden-states":
        return {"engine": kwargs | {"enable_return_hidden_states": True},
                "env": STOCK_ENV, "factory": args.engine_class}
    env = monitored_env(str(mode.preset), store if mode.kind == "store" else None, run_id,
                        mode_env(args, mode))
    return {"engine": kwargs, "factory": args.engine_class, "env": env}


def evaluate(args: argparse.Namespace, mode: Mode, unit: Json, *, store: Path,
             bracket: Bracket, disk_bps: float | None) -> Json:
    """Checks, figures and bound of one bracketed unit."""
    measured = unit["measured"]
    stop_s = (measured.get("stop") or {}).get("stop_s", 0.0)
    main = next(w for w in measured["workloads"] if w["name"] == "main")
    main["seconds"] += stop_s  # durable: until dmi_stop_monitoring() returned
    first = [o for o in checks.outputs([main]) if o["key"].endswith(".w0")]
    stock_first = [o for o in checks.outputs(unit["stock_before"]) if o["key"].endswith(".w0")]
    out: Json = {"checks": {
        "same_software": checks.same_software(bracket.stock_ready, measured["ready"]),
        "token_identity": checks.token_identity(stock_first, first)}}
    events = measured["events"]
    stopped = events.get("dmi.stopped") or {}
    warm_rids = [f"warmup-{i}" for i in range(args.batch)]
    main_rids = [rid for k in range(main["waves"]) for rid in wave_rids(args, k)]
    captured = sampled(mode_env(args, mode), warm_rids + main_rids)
    if mode.preset:
        requests = [(min(args.prompt_len, 32), 8)] * sum(r in captured for r in warm_rids) + \
            [(args.prompt_len, args.output_len)] * sum(r in captured for r in main_rids)
        out["checks"]["rows_accounted"] = check_transport_rows(
            stopped, mode.preset, MODELS[args.model], requests) | {"required": True}
    on_disk = directory_bytes(store) if mode.kind == "store" else 0
    if mode.kind == "store":
        rng = random.Random(SEED)
        stored = [r for r in main_rids if r in captured]
        sample = [rng.choice(stored) for _ in range(READBACK_SAMPLE)] if stored else []
        back = checks.read_back(store, measured["stop"]["run_id"], sample)
        out["checks"]["sample_complete"] = {
            "ok": back["run_status"] == "committed" and not back["missing"],
            "required": True, "sampled": sample, "missing": back["missing"],
            "run_status": back["run_status"]}
        out["checks"]["bytes_stored_equal_captured"] = checks.bytes_stored_equal_captured(
            events, back["hook_totals"])
    tput = checks.bracketed_throughput([unit])["main"]
    share = sum(r in captured for r in main_rids) / max(len(main_rids), 1)
    per_token = share * wave_bytes(args, mode.preset) / (args.batch * args.output_len) \
        if mode.preset else 0.0
    out["figures"] = {"throughput": tput, "stop_s": stop_s, "waves": main["waves"],
                      "gc_freeze_s": (measured.get("freeze") or {}).get("seconds"),
                      "startup_s": measured["ready"]["startup_s"], "transport": stopped or None,
                      "store": events.get("store.closed"), "timing": events.get("dmi.timing"),
                      "owner": events.get("dmi.store_owner_ended"),
                      "transport_options": events.get("capture transport ready"),
                      "on_disk_bytes": on_disk, "hidden_state_values": main["hidden_state_values"],
                      "requests": {"served": len(warm_rids) + len(main_rids),
                                   "captured": len(captured)},
                      "wave_seconds": {"measured": main["wave_seconds"], **{
                          k: [w["wave_seconds"] for w in unit[k] if w["name"] == "main"]
                          for k in ("stock_before", "stock_after")}},
                      **{figure: {"measured": main.get(figure), **{
                          k: [w.get(figure) for w in unit[k] if w["name"] == "main"]
                          for k in ("stock_before", "stock_after")}}
                         for figure in ("threads", "processes", "gpu_busy", "gc_full_waves")}}
    if mode.preset:
        out["bound"] = bound(
            captured_bytes_per_token=per_token, stock_tok_s=tput["stock_tok_s"],
            d2h_bps=bracket.d2h_bps, disk_bps=disk_bps if mode.kind == "store" else None,
            compression=(stopped.get("bytes", 0) / on_disk) if on_disk else None)
    return out


def _shown(value: Any, fmt: str) -> str:
    """``value`` formatted for a table or a log line; ``-`` for None."""
    return "-" if value is None else format(value, fmt)


SCHEDULER_PROCESS = "sglang::scheduler"
"""How the name of SGLang's scheduler process starts (its process title)."""


def scheduler_use(processes: Sequence[Json] | None, busy: Json | None, waves: int) -> Json:
    """One timed run's use of the host and the GPU, per wave: the scheduler process's
    main thread (CPU seconds, voluntary context switches: waits for a lock such as the
    GIL) and all its other threads together, and the GPU's busy share."""
    sched = [p for p in processes or [] if str(p["process"]).startswith(SCHEDULER_PROCESS)]
    n = max(waves, 1)
    return {"main_cpu_s": sum(p["main_cpu_s"] for p in sched) / n if sched else None,
            "main_voluntary": sum(p["main_voluntary"] for p in sched) / n if sched else None,
            "others_cpu_s": sum(p["others_cpu_s"] for p in sched) / n if sched else None,
            "gpu_busy_pct": (busy or {}).get("mean_pct")}


def use_line(figures: Json) -> str:
    """A unit's :func:`scheduler_use`, monitored against the stock runs around it."""
    procs, busy, waves = (figures.get(k) or {} for k in
                          ("processes", "gpu_busy", "wave_seconds"))
    sides = [("monitored", scheduler_use(procs.get("measured"), busy.get("measured"),
                                         len(waves.get("measured") or [])))]
    for side in ("stock_before", "stock_after"):
        for t, b, w in zip(procs.get(side) or [], busy.get(side) or [],
                           waves.get(side) or [], strict=False):
            sides.append((side.replace("_", " "), scheduler_use(t, b, len(w))))

    f = _shown
    return "; ".join(f"{name}: scheduler {f(u['main_cpu_s'], '.3f')} s CPU "
                     f"({f(u['main_voluntary'], '.0f')} waits), others "
                     f"{f(u['others_cpu_s'], '.3f')} s, GPU {f(u['gpu_busy_pct'], '.0f')} %"
                     for name, u in sides) + " (per wave)"


def threads_line(figures: Json, top: int = 6) -> str:
    """The monitored run's busiest threads, by name (see :func:`harness.engine.group_threads`)."""
    rows = ((figures.get("threads") or {}).get("measured") or [])[:top]
    return "busiest threads: " + (", ".join(
        f"{r.get('thread', '?')} ({r['process']} {r['pid']}) {r['cpu_s']:.2f} s"
        for r in rows) or "-")


def hooks_line(figures: Json) -> str | None:
    """The scheduler thread's time in the capture hooks per forward, decode graph steps
    and eager forwards apart (``figures.timing``); None for a unit without that split
    (a stock run, or one measured before it)."""
    t = figures.get("timing") or {}
    forwards, graph = t.get("forwards"), t.get("graph_forwards")
    host, host_graph = t.get("host_seconds"), t.get("host_graph_seconds")
    if forwards is None or graph is None or host is None or host_graph is None:
        return None

    def per(seconds: float, count: float) -> str:
        return f"{seconds / count * 1e6:,.1f} µs" if count else "-"

    eager = forwards - graph
    parts = ", ".join(f"{part} {per(t[key], graph)}" for part in HOOK_PARTS
                      if (key := f"host_graph_{part}_seconds") in t)
    return (f"hooks: {per(host_graph, graph)} a decode graph step ({graph:,.0f}"
            + (f": {parts}" if parts else "") + "), "
            f"{per(host - host_graph, eager)} an eager forward ({eager:,.0f})")


def capture_line(figures: Json) -> str | None:
    """Where a monitored unit's capture waited and built (``figures.timing``): the eager
    forwards' time in the capture points (prefills, whose parts wait for ring space when
    a chunk is larger than the ring's free space), the steps' waits for ring space (of
    them the piecewise parts'), the drain's CPU building batches (of it the decode
    window's flushes and appends) and the items it built outside the window, by why;
    None for a unit without these figures (a stock run, or one measured before them)."""
    t = figures.get("timing") or {}
    keys = ("capture_seconds", "stall_seconds", "piecewise_stall_seconds", "forwards",
            "graph_forwards", "drain_build_cpu_seconds")
    if any(t.get(k) is None for k in keys):
        return None
    eager = t["forwards"] - t["graph_forwards"]
    each = f"{t['capture_seconds'] / eager * 1e3:,.1f} ms each" if eager else "none"
    outside = ", ".join(f"{k.removeprefix('drain_outside_window_')} {v:,.0f}"
                        for k, v in t.items() if k.startswith("drain_outside_window_") and v)
    return (f"capture: eager forwards' capture points {t['capture_seconds']:.2f} s ({each}, "
            f"{eager:,.0f}); ring waits {t['stall_seconds']:.2f} s (piecewise parts' "
            f"{t['piecewise_stall_seconds']:.2f} s); drain building "
            f"{t['drain_build_cpu_seconds']:.2f} s CPU (window flushes "
            f"{t.get('drain_window_flush_cpu_seconds', 0.0):.2f} s, appends "
            f"{t.get('drain_window_append_cpu_seconds', 0.0):.2f} s); items outside the "
            f"window: {outside or 'none'}")


def store_line(figures: Json) -> str | None:
    """A stored unit's sink: its inserts' time against the writers' waits (idle with
    nothing queued, idle with a partial insert queued), the time ``put`` blocked (the
    sink's backpressure on the capture) and what the stop's ``finish_run`` waited for;
    None for a unit without a store."""
    s = figures.get("store")
    if not s:
        return None

    def sec(key: str) -> str:
        value = s.get(key)
        return "-" if value is None else f"{value:.1f} s"

    queued = s.get("finish_queued_bytes")
    return (f"store: {s.get('bytes_stored', 0) / 1e9:.1f} GB in {s.get('inserts', 0)} inserts "
            f"by {s.get('writers', '?')} writers: inserting {sec('insert_seconds')}, idle "
            f"{sec('writer_idle_empty_seconds')} with nothing queued and "
            f"{sec('writer_idle_partial_seconds')} with a partial insert queued; put "
            f"blocked {sec('put_wait_seconds')}, background sync {sec('background_sync_seconds')} "
            "(the writers' seconds summed over them, idle from the first batch on); "
            f"finish_run {sec('finish_seconds')}: {sec('finish_flush_seconds')} inserting "
            f"{'-' if queued is None else f'{queued / 1e9:.2f} GB'} queued at its start, "
            f"{sec('sync_seconds')} syncing (with close's)")


def cell(mode: str, env: Json | None) -> str:
    """A measured cell's name: the mode, and the settings it ran with (``--env`` and the
    mode's own) (``store:hidden-states [DMX_REQUEST_SAMPLE=0.1]``)."""
    extra = " ".join(f"{k}={v}" for k, v in sorted((env or {}).items()))
    return f"{mode} [{extra}]" if extra else mode


def units_of(units: Sequence[Json], name: str) -> list[Json]:
    """The units of the cell ``name`` (:func:`cell`) that ran (not skipped)."""
    return [u for u in units if cell(u["settings"]["mode"], u["settings"].get("env")) == name
            and u.get("status") != "skipped"]


def summarize(units: Sequence[Json]) -> list[Json]:
    """One row per cell (mode and its settings) over its units: the median ratio to stock,
    the spread of those ratios and of every stock run around them, the bound, the
    status."""
    rows = []
    for key in dict.fromkeys(cell(u["settings"]["mode"], u["settings"].get("env"))
                             for u in units):
        mine = units_of(units, key)
        passed = [u for u in mine if u["status"] == "passed"]  # a failed unit's figures
        ratios = [r for u in passed for r in ((  # measure a wrong capture: left out
            u.get("figures") or {}).get("throughput") or {}).get("ratios", [])]
        stock = [r for u in passed for r in ((u.get("figures") or {}).get(
            "throughput") or {}).get("stock_rates", [])]
        bounds = [u["bound"]["ratio"] for u in passed if (u.get("bound") or {}).get("ratio")]
        ratio = statistics.median(ratios) if ratios else None
        share = ratio / min(bounds) if ratio is not None and bounds else None
        rows.append({
            "mode": key, "units": len(mine),
            "status": "passed" if mine and all(u["status"] == "passed" for u in mine)
            else "incomplete" if not mine else "failed",
            "ratio": ratio,
            "ratio_spread": spread_of(ratios) if len(ratios) > 1 else None,  # one: none
            "stock_spread": spread_of(stock) if stock else None,
            "bound": min(bounds) if bounds else None,
            "bound_share": share,
            **verdict(key, {"ratio": ratio, "bound_share": share}, mine)})
    return rows


def verdict(mode: str, figures: Json, units: Sequence[Json]) -> Json:
    """The cell's target on its units' model (:data:`~harness.constants.TARGETS`) and
    whether it is met: PASS / FAIL, ``not measured``, or ``n/a`` off the reference
    workload (another shape, or a model the cell has no target for: the reference
    model's target is shown)."""
    config = units[0]["settings"] if units else {}
    model = config.get("model")  # a unit that does not say is not the reference workload
    stated = TARGETS.get((str(model), mode)) or TARGETS.get((REFERENCE_MODEL, mode))
    if stated is None:
        return {"target": None, "verdict": None}
    figure, minimum = stated
    text = f"{figure} >= {minimum:g}"
    reference = (str(model), mode) in TARGETS and \
        all(config.get(k) == v for k, v in TARGET_WORKLOAD.items()) and \
        float(config.get("min_seconds", 0)) >= TARGET_MIN_SECONDS
    if any(u.get("status", "passed") not in ("passed", "skipped") for u in units):
        return {"target": text, "verdict": "not judged (a unit failed or erred)"}
    if not units or figures[figure] is None:
        return {"target": text, "verdict": "not measured"}
    if not reference:
        return {"target": text, "verdict": "n/a (not the reference workload)"}
    return {"target": text, "verdict": "PASS" if figures[figure] >= minimum else "FAIL"}


def render(rows: Sequence[Json]) -> str:
    """The summary rows as a table."""
    f = _shown
    head = f"{'mode':<28} {'units':>5} {'x stock':>8} {'spread':>7} {'stock sp':>8} " \
           f"{'bound':>6} {'share':>6}  status    target"
    lines = [head, "-" * len(head)]
    lines += [f"{r['mode']:<28} {r['units']:>5} {f(r['ratio'], '.3f'):>8} "
              f"{f(r['ratio_spread'], '.1%'):>7} {f(r['stock_spread'], '.1%'):>8} "
              f"{f(r['bound'], '.2f'):>6} {f(r['bound_share'], '.2f'):>6}  {r['status']:<9} "
              f"{'' if r['target'] is None else r['target'] + ': ' + r['verdict']}"
              for r in rows]
    return "\n".join(lines)


class ServingRun:
    """The (repeat, mode) units of one invocation, each bracketed, resumed where saved;
    the seconds each mode's last measured unit took are kept, per configuration, to
    estimate the next."""

    def __init__(self, args: argparse.Namespace, state: Path, work: Path,
                 deadline: Deadline) -> None:
        self.args, self.state, self.work, self.deadline = args, state, work, deadline
        self.config = settings(args)
        self.saved = Resumable(state / stable_hash(self.config), fresh=args.fresh)
        self.took_path = self.saved.root / "took.json"  # this configuration's units only
        self.took: Json = load_json(self.took_path) or {}
        model_dir = write_model_dir(work / "models", MODELS[args.model])
        self.kwargs = engine_kwargs(model_dir, graphs=True, max_bs=args.batch,
                                    chunked_prefill_size=0)
        warm, self.main = workloads(args, None)
        stock = {"engine": self.kwargs, "env": STOCK_ENV, "factory": args.engine_class}
        self.bracket = Bracket("serving", stock, [warm], workdir=work / "engines",
                               deadline=deadline, pgid_file=state / "engines.pgids")
        self.disk_bps: float | None = None

    def unit(self, mode: Mode, rep: int) -> Json:
        """One unit: saved, skipped (it would not fit) or measured now."""
        name = f"{mode.slug}-r{rep}"
        unit_settings = self.config | {"mode": mode.key, "repeat": rep,
                                       "env": dict(sorted(mode_env(self.args, mode).items()))}
        identity = stable_hash(unit_settings)
        saved = self.saved.get(name, identity)
        if saved is not None:
            return saved | {"reused": True}
        data = result("serving", name, unit_settings)
        need = float(self.took.get(mode.slug, estimate_s(self.args, mode)))
        need *= 1.5 if self.bracket.stock is None else 1.1
        if not self.deadline.fits(need):
            return finish(data, "skipped", f"needs ~{need:.0f} s")
        store = self.work / "stores" / name
        shutil.rmtree(store, ignore_errors=True)
        started = time.monotonic()
        try:
            if mode.kind == "store" and self.disk_bps is None:
                self.disk_bps = measure_disk_bps(store.parent)
            run_id = f"bench-{name}-{compact_utc()}"
            warm_mode, main_mode = workloads(self.args, mode)
            unit = self.bracket.measure(
                name, monitored_spec(self.args, mode, self.kwargs, store, run_id),
                [warm_mode], [main_mode], stock_timed=[self.main],
                monitored=mode.kind != "return-hidden-states")
            data.update(evaluate(self.args, mode, unit, store=store, bracket=self.bracket,
                                 disk_bps=self.disk_bps))
            finish(data)
        except Exception as exc:  # an engine or the read-back failed: this unit's result
            finish(data, "error", str(exc)[-6000:])
        finally:
            shutil.rmtree(store, ignore_errors=True)
        if data["status"] in ("passed", "failed"):  # an erred unit's seconds say nothing
            self.took[mode.slug] = time.monotonic() - started
            write_json(self.took_path, self.took)
        self.saved.put(name, identity, data)
        return data

    def run(self) -> int:
        """Every unit (modes interleaved within each repeat); the JSON and the table; the
        exit status."""
        units: list[Json] = []
        try:
            for rep in range(self.args.repeats):
                for mode in self.args.mode_list:
                    units.append(self.unit(mode, rep))
                    print(f"[serving] {units[-1]['name']}: {units[-1]['status']}", flush=True)
                    if units[-1].get("figures") and not units[-1].get("reused"):
                        print(f"[serving]   {use_line(units[-1]['figures'])}", flush=True)
                        print(f"[serving]   {threads_line(units[-1]['figures'])}", flush=True)
                        if (line := hooks_line(units[-1]["figures"])) is not None:
                            print(f"[serving]   {line}", flush=True)
                        if (line := capture_line(units[-1]["figures"])) is not None:
                            print(f"[serving]   {line}", flush=True)
                        if (line := store_line(units[-1]["figures"])) is not None:
                            print(f"[serving]   {line}", flush=True)
        finally:
            self.bracket.close()
        rows = summarize(units)
        out = result("serving", "serving", self.config) | {"units": units, "summary": rows}
        statuses = {u["status"] for u in units}
        finish(out, "passed" if statuses == {"passed"} else
               "skipped" if statuses <= {"passed", "skipped"} else "failed")
        write_json(Path(self.args.out), out)
        print(render(rows))
        return {"passed": 0, "skipped": 3}.get(out["status"], 1)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m harness serving",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default=None, help="result JSON ($OUT/serving.json)")
    p.add_argument("--model", choices=sorted(MODELS), default="0.6b")
    p.add_argument("--modes", default=DEFAULT_MODES)
    p.add_argument("--repeats", type=int, default=2, help="engines per mode")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-seconds", type=float, default=30.0)
    p.add_argument("--env", action="append", default=[], metavar="DMX_NAME=VALUE",
                   help="a setting of the monitored modes (repeatable)")
    p.add_argument("--fresh", action="store_true", help="ignore saved units")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument("--work", default=None, help="engine logs and stores (temp dir)")
    p.add_argument("--engine-class", default="sglang:Engine",
                   help="MODULE:NAME of the engine every side builds (default %(default)s)")
    args = p.parse_args(argv)
    _validate(p, args)
    if args.dry_run:
        for mode in args.mode_list:
            share = float(mode_env(args, mode).get("DMX_REQUEST_SAMPLE", 1.0))
            gb = share * wave_bytes(args, mode.preset) / 1e9 if mode.preset else 0.0
            name = cell(mode.key, dict(mode.env))
            print(f"  {name:<28} ~{estimate_s(args, mode):>4.0f} s per unit x "
                  f"{args.repeats}, {gb:.3f} GB captured per wave")
        return 0
    args.out = args.out or str(Path(os.environ.get("OUT", ".")) / "serving.json")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dmi-serving-"))
    state = state_dir(Path(args.out).resolve().parent / ".state") / "serving"
    engine_state = state / re.sub(r"\W", "-", args.engine_class)
    for record in state.glob("*/engines.pgids"):  # where each engine class's Bracket
        kill_leftovers(record)  # recorded its engines (another class may hold the GPU)
    return ServingRun(args, engine_state, work, Deadline()).run()


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One clear error (exit 2) for anything the benchmark cannot run; parses the modes
    and ``--env`` in place."""
    for name in ("batch", "prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    if args.output_len < 2:
        p.error(f"--output-len {args.output_len}: expected >= 2")
    if not 0 <= args.min_seconds < float("inf"):  # nan and inf too: no unit would fit
        p.error(f"--min-seconds {args.min_seconds}: expected a finite number >= 0")
    tokens = args.batch * (args.prompt_len + args.output_len)
    if tokens > MAX_TOTAL_TOKENS:
        p.error(f"--batch x (--prompt-len + --output-len) = {tokens} tokens: expected at most "
                f"{MAX_TOTAL_TOKENS}, the KV pool every engine gets (harness/constants.py)")
    try:
        args.mode_list = parse_modes(args.modes)
        for mode in args.mode_list:
            if mode.preset:
                wave_bytes(args, mode.preset)
    except ValueError as exc:
        p.error(str(exc))
    except Exception as exc:  # the domain's ConfigurationError for a bad preset
        p.error(f"--modes: {exc}")
    try:
        args.env = setting_pairs(args.env, "--env")
    except ValueError as exc:
        p.error(str(exc))
    _check_mode_settings(p, args)


def _check_mode_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A mode's own settings and ``--env`` together: never the same one twice, valid
    together."""
    named: dict[str, str] = {}
    for mode in args.mode_list:
        name = cell(mode.key, dict(mode.env))
        if both := sorted(set(args.env) & {k for k, _v in mode.env}):
            p.error(f"--modes {name!r}: {both[0]} is set by --env too: give it in one place")
        if (other := named.setdefault(mode.slug, name)) != name:
            p.error(f"--modes {name!r} and {other!r} would share the unit name "
                    f"{mode.slug!r}: make their settings differ in letters or digits")
        run_id = f"bench-{mode.slug}-r{args.repeats - 1}-{compact_utc()}"
        try:
            Settings.from_env(mode_env(args, mode) | {"DMX_MODEL_ID": run_id})
        except ConfigurationError as exc:
            p.error(f"--modes {name!r} with --env: {exc}")
