"""Qualification cells: monitored SGLang 0.5.19 against stock, configuration by configuration.

    python -m harness qualify RESULTS [--cells core|optional|all|NAME,...]
    python -m harness qualify --dry-run      # the plan, nothing started
    python -m harness qualify --list         # the cells

A *cell* is one configuration: model shape (Qwen3-0.6B or -8B, dummy weights, real
``config.json``), decode CUDA graphs or eager, hook preset, overlap scheduler, persistence
(embedded store, or none: transport only). Its monitored engine runs fixed workloads (batch
1, a mixed batch of 8, 13 requests padded to graph bucket 16, a prompt spanning two prefill
chunks, batch 64; random prompt ids of a fixed seed; greedy, ignore_eos), each warmed up
first, bracketed by the stock engine of the same ServerArgs running the same workloads
before and after (:mod:`harness.bracket`). Cells qualify correctness; their
throughput is one short wave each, informational (the benchmarks state bounds). Required
checks: the same software and KV pool,
tokens identical to stock request by request, rows complete (stored: every request read
back complete, manifests agree with SGLang, the run committed; transport only: the stop
statistics account for every row), payload bytes stored = captured. Informational: stock
equal to itself before and after, stored rows and bytes per hook exactly what the manifests
imply. Figures: bracketed tokens/s per workload, capture bytes, store rates.

One JSON per cell in RESULTS plus ``summary.json``. Results are kept in the state
directory; running the command again continues where a deadline stopped it. Exit status 0:
every cell passed; 1: a cell failed; 3: cells left for the next invocation.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import checks, models
from harness.bracket import Bracket
from harness.constants import ENGINE_OVERHEAD_S, READBACK_S_PER_REQUEST, SEED, STORE_INGEST_BPS
from harness.engine import kill_leftovers
from harness.models import (
    MODELS,
    STOCK_ENV,
    ModelSpec,
    engine_kwargs,
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
    utc_now,
    write_json,
)
from harness.workloads import Workload, check_transport_rows, expected_capture, spread

EXIT_INCOMPLETE = 3


@dataclass(frozen=True)
class Cell:
    """One qualified configuration."""

    name: str
    model: str
    graphs: bool
    preset: str
    overlap: bool = True
    store: bool = True
    core: bool = True
    ring_mb: int | None = None
    """DMX_RING_PAYLOAD_MB and DMX_RING_PINNED_MB (None: the default)."""
    tokens_required: bool = True
    """False where decode steps are expected to run eagerly (not bit-identical to replay)."""
    note: str = ""

    @property
    def spec(self) -> ModelSpec:
        """The model shape."""
        return MODELS[self.model]

    @property
    def stock_key(self) -> str:
        """Cells with the same key share one stock engine."""
        return (f"{self.model}-{'graph' if self.graphs else 'eager'}"
                + ("" if self.overlap else "-nooverlap"))


CELLS: tuple[Cell, ...] = (
    Cell("0.6b-eager-hidden", "0.6b", False, "hidden-states"),
    Cell("0.6b-graph-hidden", "0.6b", True, "hidden-states"),
    Cell("0.6b-eager-full", "0.6b", False, "sglang-full"),
    Cell("0.6b-graph-full", "0.6b", True, "sglang-full", ring_mb=8192,
         note="8 GiB ring: no decode step forced eager"),
    Cell("8b-graph-hidden", "8b", True, "hidden-states"),
    Cell("0.6b-graph-hidden-nooverlap", "0.6b", True, "hidden-states", overlap=False,
         core=False, note="overlap scheduler off"),
    Cell("0.6b-graph-hfonly", "0.6b", True, "hf-only", core=False,
         note="resid_pre, final_ln, final_logits"),
    Cell("0.6b-graph-full-nostore", "0.6b", True, "sglang-full", store=False, core=False,
         ring_mb=8192, note="DMX_DB_URL=none: transport statistics checked"),
    Cell("0.6b-graph-full-ring64", "0.6b", True, "sglang-full", core=False, ring_mb=64,
         tokens_required=False, note="64 MiB ring: forced-eager decode, drain stalls"),
)
GROUPS = {"core": [c.name for c in CELLS if c.core],
          "optional": [c.name for c in CELLS if not c.core], "all": [c.name for c in CELLS]}


def select_cells(text: str) -> list[Cell]:
    """Cells named in ``text`` (comma-separated names or groups), in catalogue order."""
    names: set[str] = set()
    for token in filter(None, (t.strip() for t in text.split(","))):
        if token not in GROUPS and token not in {c.name for c in CELLS}:
            accepted = ", ".join([*GROUPS, *(c.name for c in CELLS)])
            raise ValueError(f"unknown cell {token!r}; accepted: {accepted}")
        names.update(GROUPS.get(token, [token]))
    if not names:
        raise ValueError(f"no cell named in {text!r}; accepted: names or core, optional, all")
    return [c for c in CELLS if c.name in names]


def timed_workloads(cell: Cell) -> list[Workload]:
    """The cell's timed workloads; sglang-full (~0.9 MB per token on 0.6B) leaves out the
    two largest."""
    big = (64 * (256,), 64 * (128,)) if cell.model == "0.6b" else (64 * (64,), 64 * (64,))
    every = [Workload("bs1", (100,), (32,)),
             Workload("bs8-mixed", spread(8, 10, 120), spread(8, 16, 40)),
             Workload("bs13-pad", 13 * (32,), 13 * (16,)),
             Workload("long-chunked", (4500,), (8,)),
             Workload("bs64", *big),
             Workload("bs64-small", 64 * (16,), 64 * (16,))]
    light = cell.preset == "sglang-full"
    return [w for w in every if not (light and w.name in ("long-chunked", "bs64"))]


def warm_ups(cell: Cell) -> list[Workload]:
    """A short call, then every timed workload's shapes with 2 output tokens: kernels
    compile outside the timings."""
    short = Workload("warmup", 4 * (32,), 4 * (8,), timed=False)
    return [short, *(w.warm_up() for w in timed_workloads(cell))]


def monitored_env(cell: Cell, store: Path, run_id: str) -> dict[str, str]:
    """The monitored engine's ``DMX_*`` variables (:func:`harness.models.monitored_env`),
    with the cell's ring size."""
    ring = {"DMX_RING_PAYLOAD_MB": str(cell.ring_mb), "DMX_RING_PINNED_MB": str(cell.ring_mb)}
    return models.monitored_env(cell.preset, store if cell.store else None, run_id,
                                ring if cell.ring_mb else None)


def settings(cell: Cell) -> Json:
    """What decides a cell's result (its identity hashes this)."""
    return {"cell": asdict(cell), "config_json": qwen3_config(cell.spec), "seed": SEED,
            "engine": engine_kwargs("<model>", graphs=cell.graphs, overlap=cell.overlap),
            "monitored_env": monitored_env(cell, Path("<store>"), "<run>"),
            "workloads": [asdict(w) for w in [*warm_ups(cell), *timed_workloads(cell)]]}


def capture_bytes(cell: Cell) -> int:
    """Bytes the monitored run captures (every request with the extra forward)."""
    reqs = [(p, o, cell.overlap) for w in [*warm_ups(cell), *timed_workloads(cell)]
            for p, o in zip(w.prompt_lens, w.output_lens, strict=True)]
    return expected_capture(cell.preset, cell.spec, reqs).bytes


def estimate_s(cell: Cell, startup: Json) -> float:
    """Seconds the cell's monitored engine, its stock block and read-back should take."""
    model = cell.spec
    calls = [*warm_ups(cell), *timed_workloads(cell)]
    gen = sum(model.generate_s(w.prompt_lens, w.output_lens, cell.graphs) + 1 for w in calls)
    gen += sum(model.generate_s(w.prompt_lens, w.output_lens, cell.graphs) + 1
               for w in timed_workloads(cell))  # the stock block after it
    extra = 0.0
    if cell.store:
        extra = capture_bytes(cell) / STORE_INGEST_BPS + READBACK_S_PER_REQUEST * sum(
            w.requests for w in calls)
    start = float(startup.get(cell.stock_key, model.startup_s * (1 if cell.graphs else 0.8)))
    return start + gen + extra + ENGINE_OVERHEAD_S


class Qualification:
    """Runs cells grouped by stock engine; see the module docstring."""

    def __init__(self, results: Path, state: Path, work: Path, deadline: Deadline, *,
                 fresh: bool = False, keep_stores: bool = False,
                 engine_class: str = "sglang:Engine") -> None:
        self.results, self.state, self.work = results, state, work
        self.deadline = deadline
        self.saved = Resumable(state / "cells", fresh=fresh)
        self.keep_stores = keep_stores
        self.engine_class = engine_class
        self.startup: Json = load_json(state / "startup.json") or {}

    def run(self, cells: Sequence[Cell]) -> int:
        """Run (or reuse) every cell; one JSON each and ``summary.json``; the exit status."""
        killed = kill_leftovers(self.state / "engines.pgids")
        if killed:
            print(f"[qualify] killed engines left by an earlier invocation: {killed}")
        done: dict[str, Json] = {}
        for cell in cells:
            saved = self.saved.get(cell.name, stable_hash(settings(cell)))
            if saved is not None:
                done[cell.name] = self._publish(cell, saved | {"reused": True})
        for key in dict.fromkeys(c.stock_key for c in cells if c.name not in done):
            group = [c for c in cells if c.stock_key == key and c.name not in done]
            self._group(key, group, done)
        return self._summary(cells, done)

    def _group(self, key: str, group: Sequence[Cell], done: dict[str, Json]) -> None:
        first = group[0]
        model_dir = write_model_dir(self.work / "models", first.spec)
        kwargs = engine_kwargs(model_dir, graphs=first.graphs, overlap=first.overlap)
        stock_spec = {"engine": kwargs, "env": STOCK_ENV, "factory": self.engine_class}
        shapes = {w.name: w for c in group for w in warm_ups(c)}
        bracket = Bracket(key, stock_spec, list(shapes.values()), workdir=self.work / "engines",
                          deadline=self.deadline, pgid_file=self.state / "engines.pgids")
        try:
            for cell in group:
                need = estimate_s(cell, self.startup) * (1.0 if bracket.stock else 1.5)
                if not self.deadline.fits(need):
                    done[cell.name] = self._publish(cell, finish(
                        result("qualify-cell", cell.name, settings(cell)), "skipped",
                        f"needs ~{need:.0f} s, {max(self.deadline.left(), 0):.0f} s left"))
                    continue
                done[cell.name] = self._publish(cell, self._cell(cell, bracket, kwargs))
        finally:
            bracket.close()

    def _cell(self, cell: Cell, bracket: Bracket, kwargs: Json) -> Json:
        data = result("qualify-cell", cell.name, settings(cell))
        store = self.work / "stores" / cell.name
        shutil.rmtree(store, ignore_errors=True)
        store.parent.mkdir(parents=True, exist_ok=True)
        run_id = f"{cell.name}-{compact_utc()}"
        spec = {"engine": kwargs, "env": monitored_env(cell, store, run_id),
                "factory": self.engine_class}
        try:
            if bracket.stock is None:
                self.startup[cell.stock_key] = bracket.start()["startup_s"]
            unit = bracket.measure(f"monitored-{cell.name}", spec, warm_ups(cell),
                                   timed_workloads(cell), monitored=True)
            self.startup[cell.stock_key] = unit["measured"]["ready"]["startup_s"]
            write_json(self.state / "startup.json", self.startup)
        except Exception as exc:  # an engine (or anything else) failed: this cell's result
            finish(data, "error", str(exc)[-6000:])
        else:
            try:
                self._evaluate(cell, data, unit, store, bracket)
                finish(data)
            except Exception as exc:  # a broken read-back is a result, not a crash
                finish(data, "error", f"the checks failed to run: {exc!r}")
        finally:
            if not self.keep_stores:
                shutil.rmtree(store, ignore_errors=True)
        self.saved.put(cell.name, stable_hash(settings(cell)), data)
        return data

    def _evaluate(self, cell: Cell, data: Json, unit: Json, store: Path,
                  bracket: Bracket) -> None:
        measured = unit["measured"]
        names = {w.name for w in timed_workloads(cell)}
        mon = checks.outputs(measured["workloads"], names | {w.name for w in warm_ups(cell)})
        mon_timed = [o for o in mon if o["workload"] in names]
        events = measured["events"]
        stopped = events.get("dmi.stopped") or {}
        c = data["checks"]
        c["same_software"] = checks.same_software(bracket.stock_ready, measured["ready"])
        c["token_identity"] = checks.token_identity(
            checks.outputs(unit["stock_before"]), mon_timed, required=cell.tokens_required)
        c["stock_deterministic"] = checks.token_identity(
            checks.outputs(unit["stock_before"]), checks.outputs(unit["stock_after"]),
            required=False)
        reqs = [(int(o["prompt_tokens"]), int(o["completion_tokens"])) for o in mon]
        if cell.store:
            back = checks.read_back(store, measured["stop"]["run_id"], [o["id"] for o in mon])
            c["rows_complete"] = checks.rows_complete(mon, back)
            c["bytes_stored_equal_captured"] = checks.bytes_stored_equal_captured(
                events, back["hook_totals"])
            expected = expected_capture(cell.preset, cell.spec, (
                (int(m[0]), int(m[1]), bool(m[2])) for m in back["manifests"].values()))
            c["stored_as_expected"] = checks.stored_as_expected(
                back["hook_totals"], expected.by_act,
                sum(int(o.get("num_retractions") or 0) for o in mon))
        else:
            c["rows_complete"] = check_transport_rows(stopped, cell.preset, cell.spec, reqs) \
                | {"required": True}
        head = "bs64-small" if cell.preset == "sglang-full" else "bs64"
        tput = checks.bracketed_throughput([unit])
        data["figures"] = {
            "throughput": tput, "headline_workload": head,
            "headline_ratio": (tput.get(head) or {}).get("ratio"),
            "capture_bytes": stopped.get("bytes"), "transport": stopped or None,
            "store": events.get("store.closed"), "timing": events.get("dmi.timing"),
            "transport_options": events.get("capture transport ready"),
            "startup_s": measured["ready"]["startup_s"], "stop_s": measured["stop"]["stop_s"],
            "leftover_processes": measured["leftover_processes"]}

    def _publish(self, cell: Cell, data: Json) -> Json:
        write_json(self.results / f"{cell.name}.json", data)
        ratio = (data.get("figures") or {}).get("headline_ratio")
        print(f"[qualify] {cell.name}: {data['status']}"
              + ("" if ratio is None else f" ({ratio:.3f}x stock)")
              + (" (earlier result)" if data.get("reused") else "")
              + (f": {data['error'][:300]}" if data.get("error") else ""), flush=True)
        return data

    def _summary(self, cells: Sequence[Cell], done: dict[str, Json]) -> int:
        statuses = [done[c.name]["status"] for c in cells]
        code = 0 if all(s == "passed" for s in statuses) else \
            1 if any(s in ("failed", "error") for s in statuses) else EXIT_INCOMPLETE
        write_json(self.results / "summary.json", {
            "written_at_utc": utc_now(), "exit_status": code,
            "cells": {c.name: done[c.name]["status"] for c in cells}})
        if code == EXIT_INCOMPLETE:
            print("[qualify] cells were left for the next invocation: run it again")
        return code


def render_plan(cells: Sequence[Cell], startup: Json) -> str:
    """Engine starts and estimates, per stock engine."""
    lines, total = [], 0.0
    for cell in cells:
        est = estimate_s(cell, startup)
        total += est
        mode = "graphs" if cell.graphs else "eager"
        lines.append(f"  {cell.name:<30} {cell.preset:<14} {mode:<7}"
                     f" store={'chdb' if cell.store else 'none':<5} ~{est:>4.0f} s "
                     f"~{capture_bytes(cell) / 1e9:.2f} GB  {cell.note}")
    stocks = len({c.stock_key for c in cells})
    lines.append(f"{len(cells)} cells, {stocks} stock engines: about {total / 60:.1f} min "
                 "plus the stock engines' starts")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m harness qualify",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("results", nargs="?", help="directory for one JSON per cell")
    parser.add_argument("--cells", default="core", help="names or core/optional/all")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    parser.add_argument("--list", action="store_true", help="list the cells")
    parser.add_argument("--fresh", action="store_true", help="ignore earlier results")
    parser.add_argument("--keep-stores", action="store_true")
    parser.add_argument("--work", default=None, help="engine logs and stores (temp dir)")
    parser.add_argument("--engine-class", default="sglang:Engine",
                        help="MODULE:NAME of the engine both sides build (default %(default)s)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{c.name:<30} {'core' if c.core else 'optional':<9} {c.note}"
                        for c in CELLS))
        return 0
    try:
        cells = select_cells(args.cells)
    except ValueError as exc:
        parser.error(str(exc))
    deadline = Deadline()
    if args.dry_run:
        print(render_plan(cells, {}))
        return 0
    if not args.results:
        parser.error("the results directory is required")
    results = Path(args.results).resolve()
    state = state_dir(results / ".state") / "qualify" / re.sub(r"\W", "-", args.engine_class)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dmi-qualify-"))
    print(render_plan(cells, load_json(state / "startup.json") or {}), flush=True)
    return Qualification(results, state, work, deadline, fresh=args.fresh,
                         keep_stores=args.keep_stores, engine_class=args.engine_class).run(cells)
