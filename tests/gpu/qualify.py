"""GPU qualification of dmi-sglang on SGLang 0.5.19: named cells, one JSON result each.

Run on the H200 machine with the GPU kit (normally through tests/run_v0519_smoke.sh)::

    DMI_V0519_CELLS=0.6b-graph-hidden,0.6b-graph-full python tests/gpu/qualify.py OUT_DIR
    python tests/gpu/qualify.py --dry-run OUT_DIR      # the plan, no engine started
    python tests/gpu/qualify.py --list                  # the cells

A *cell* is one configuration: model shape (Qwen3-0.6B or -8B, ``load_format="dummy"``
with a real ``config.json``), decode CUDA graphs or eager, hook preset, overlap scheduler
on or off, persistence (embedded ClickHouse, or none = transport only). For each cell a
monitored engine runs a fixed set of workloads (one ``generate`` call each: batch 1, a
mixed batch of 8, 13 requests padded to a graph bucket of 16, a prompt longer than one
prefill chunk, batch 64; random prompt ids from a fixed seed; greedy, ignore_eos) and is
compared with a stock engine of the SAME ServerArgs (the two settings monitoring forces,
prefill graphs off and radix cache off, are passed to both). Stock engines are shared by
every cell of the same (model, graphs, overlap) and run every workload of the model plus
a repeat of each (``again-*``), which checks that stock SGLang itself is deterministic
across identical batches.

The graph sglang-full cells use an 8 GiB ring so that no decode step is forced eager (an
eager decode step is not bit-identical to graph replay); ``0.6b-graph-full-ring64``
exercises that path with a 64 MiB ring, token identity informational there.

Checks per cell (all required unless marked): token identity (monitored == stock,
request by request); row completeness (persistence: every request read back through
``ClickHouseReader`` / ``CaptureHandle(...).missing`` is empty, the run committed, the store
holds exactly the requests sent, manifests agree with SGLang's token counts; transport
only: the scheduler's ``dmi.stopped`` statistics account for every expected row);
informational: stored rows and bytes per hook equal what the manifests imply (a
retraction legitimately adds superseded rows), stock determinism. Figures: output tokens/s
per workload, monitored and stock, their ratio; bytes captured; store ingest;
forced-eager decode steps.

Each device command is limited to 10 minutes. The runner estimates every engine start
and skips (status ``skipped``) what does not fit before the call's deadline; results and
stock baselines are kept in a state directory on the machine (``/root/dmi-v0519-state``)
so running the same command again continues where the last call stopped. Every cell
JSON carries the commit, the command, the settings and the UTC times it ran.

Environment: ``DMI_V0519_CELLS`` (comma-separated names, or ``core``, ``optional``,
``all``; default ``core``), ``DMI_V0519_BUDGET_S`` (seconds for this invocation; default:
until 45 s before the device call's 10-minute limit), ``DMI_V0519_STATE``,
``DMI_V0519_WORK`` (engine logs and stores; default a temp dir), ``DMI_V0519_FRESH=1``
(ignore earlier results), ``DMI_V0519_KEEP_STORES=1``, ``DMI_V0519_STOCK_FROM`` (a
directory of stock baselines from an earlier lease, e.g. committed evidence: a stock
engine runs no dmi-sglang code, so a baseline whose ``stock_hash`` matches the cell's is
reused instead of starting the stock engine again; its JSON says where it came from).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_proc as ep

SCHEMA = 1
"""Bump when workloads or result fields change meaning (invalidates saved results)."""
STORE_INGEST_BPS = 300e6
"""Embedded ClickHouse insert rate seen on the H200 host (estimates only)."""
READBACK_S_PER_REQUEST = 0.05
ENGINE_OVERHEAD_S = 20.0
"""Process start, imports and shutdown per engine, beyond SGLang's own startup."""
EXIT_INCOMPLETE = 3
"""Exit status when cells were skipped for lack of time (run the command again)."""


# -- cells ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One qualified configuration."""

    name: str
    model: str
    graphs: bool
    preset: str
    overlap: bool = True
    persistence: str = "chdb"
    core: bool = True
    note: str = ""
    ring_mb: int | None = None
    """DMX_RING_PAYLOAD_MB and DMX_RING_PINNED_MB (None: the default, 1024)."""
    tokens_required: bool = True
    """False where decode steps are expected to run eagerly (not bit-identical to graph
    replay), so token identity is informational."""

    @property
    def spec(self) -> ep.ModelSpec:
        """The model shape."""
        return ep.MODELS[self.model]

    @property
    def stock_key(self) -> str:
        """Cells with the same key share one stock engine."""
        mode = "graph" if self.graphs else "eager"
        return f"{self.model}-{mode}" + ("" if self.overlap else "-nooverlap")

    @property
    def light(self) -> bool:
        """Presets with wide rows (sglang-full) run smaller workloads."""
        return self.preset in ("sglang-full", "full")


CELLS: tuple[Cell, ...] = (
    Cell("0.6b-eager-hidden", "0.6b", False, "hidden-states"),
    Cell("0.6b-graph-hidden", "0.6b", True, "hidden-states"),
    Cell("0.6b-eager-full", "0.6b", False, "sglang-full"),
    Cell("0.6b-graph-full", "0.6b", True, "sglang-full", ring_mb=8192,
         note="8 GiB ring: no decode step forced eager"),
    Cell("8b-graph-hidden", "8b", True, "hidden-states"),
    Cell("0.6b-graph-hidden-nooverlap", "0.6b", True, "hidden-states", overlap=False,
         core=False, note="overlap scheduler off (disable_overlap_schedule=True)"),
    Cell("0.6b-graph-hfonly", "0.6b", True, "hf-only", core=False,
         note="resid_pre, final_ln, final_logits"),
    Cell("0.6b-graph-full-nostore", "0.6b", True, "sglang-full", persistence="none",
         core=False, ring_mb=8192,
         note="DMX_DB_URL=none: transport statistics checked instead"),
    Cell("0.6b-graph-full-ring64", "0.6b", True, "sglang-full", core=False, ring_mb=64,
         tokens_required=False,
         note="64 MiB ring: forced-eager decode, piecewise commits, drain stalls"),
)
BY_NAME: dict[str, Cell] = {c.name: c for c in CELLS}
GROUPS: dict[str, tuple[str, ...]] = {
    "core": tuple(c.name for c in CELLS if c.core),
    "optional": tuple(c.name for c in CELLS if not c.core),
    "all": tuple(c.name for c in CELLS),
}


def select_cells(text: str | None) -> list[Cell]:
    """Cells named in ``text`` (comma-separated names or groups), in catalogue order.

    Raises:
        ValueError: an unknown name; the message lists the accepted ones.
    """
    names: set[str] = set()
    tokens = [t.strip() for t in (text or "core").split(",") if t.strip()] or ["core"]
    for token in tokens:
        if token in GROUPS:
            names.update(GROUPS[token])
        elif token in BY_NAME:
            names.add(token)
        else:
            accepted = ", ".join([*GROUPS, *BY_NAME])
            msg = f"unknown cell {token!r} in DMI_V0519_CELLS; accepted: {accepted}"
            raise ValueError(msg)
    return [c for c in CELLS if c.name in names]


# -- workloads -----------------------------------------------------------------------------
def timed_workloads(model: str) -> list[ep.Workload]:
    """A model's timed workloads, in run order.

    Sized so one sglang-full cell captures ~4 GB on 0.6B (~0.9 MB per token plus 0.6 MB of
    float32 logits per generated token) and one hidden-states cell ~2 GB on 0.6B and ~4 GB
    on 8B (the store ingests ~300 MB/s); the warm-ups of :func:`with_warm_ups` add their
    prefills (~1.3 GB on 0.6B hidden-states, ~2.2 GB on sglang-full). ``long-chunked``
    spans two 4096-token prefill chunks; ``bs13-pad`` replays the decode graph of bucket 16
    with 3 padded rows.
    """
    w = ep.Workload
    big = (64 * (256,), 64 * (128,)) if model == "0.6b" else (64 * (64,), 64 * (64,))
    return [
        w("bs1", (100,), (32,)),
        w("bs8-mixed", ep.spread(8, 10, 120), ep.spread(8, 16, 40)),
        w("bs13-pad", 13 * (32,), 13 * (16,)),
        w("long-chunked", (4500,), (8,)),
        w("bs64", *big),
        w("bs64-small", 64 * (16,), 64 * (16,)),
    ]


def with_warm_ups(timed: Sequence[ep.Workload]) -> list[ep.Workload]:
    """``timed`` after untimed warm-ups: a short one, then each timed workload's prompt
    shapes with 2 output tokens (its prefill and one decode step at its batch size).

    Kernels compile on first use (Triton's cache is empty on a fresh machine), so without
    these the first engine of a lease pays the compiles inside its timings and later ones
    do not: lease 4 of 2026-11-29 timed a monitored eager engine on a cold cache (85 s
    warm-up, bs64 6.3 s) against a stock baseline of lease 3 that had compiled before its
    bs64 (4.3 s; 3.4 s on its repeat).
    """
    shapes = [ep.Workload("warm-" + t.name, t.prompt_lens, t.requests * (2,), timed=False)
              for t in timed]
    return [ep.Workload("warmup", 4 * (32,), 4 * (8,), timed=False), *shapes, *timed]


def model_workloads(model: str) -> list[ep.Workload]:
    """Every workload of a model, in run order (the stock engine runs all of them)."""
    return with_warm_ups(timed_workloads(model))


FULL_SKIPS = frozenset({"long-chunked", "bs64"})
"""Workloads light (sglang-full) cells leave out: ~0.9 MB captured per token on 0.6B."""
COMPARED_REPEATS = ("bs8-mixed", "bs13-pad", "bs64", "bs64-small")


def cell_workloads(cell: Cell) -> list[ep.Workload]:
    """The workloads a cell's monitored engine runs (warm-ups of its own shapes first)."""
    return with_warm_ups([w for w in timed_workloads(cell.model)
                          if not (cell.light and w.name in FULL_SKIPS)])


def stock_workloads(model: str) -> list[ep.Workload]:
    """The stock engine's workloads: all of the model's, then repeats of the big ones."""
    base = model_workloads(model)
    return base + [w.again() for w in base if w.name in COMPARED_REPEATS]


def throughput_workload(cell: Cell) -> str:
    """The workload whose tokens/s a cell reports as its headline figure."""
    return "bs64-small" if cell.light else "bs64"


# -- engine specs --------------------------------------------------------------------------
def engine_kwargs(cell: Cell, model_dir: Path) -> dict[str, Any]:
    """ServerArgs of both engines of a cell (stock and monitored are identical)."""
    return ep.base_engine_kwargs(model_dir, graphs=cell.graphs, overlap=cell.overlap)


def monitored_env(cell: Cell, store: Path, run_id: str) -> dict[str, str]:
    """The DMX_* variables that switch monitoring on for a plain ``sglang.Engine``."""
    env = {
        "DMX_SGLANG_ENABLE": "1",
        "DMX_HOOK_SELECTION": cell.preset,
        "DMX_DB_URL": f"chdb://{store}" if cell.persistence == "chdb" else "none",
        "DMX_MODEL_ID": run_id,
    }
    if cell.ring_mb:
        env["DMX_RING_PAYLOAD_MB"] = env["DMX_RING_PINNED_MB"] = str(cell.ring_mb)
    return env


def stock_spec(cell: Cell, model_dir: Path) -> dict[str, Any]:
    """The stock engine's ``run_engine.py`` spec."""
    return {
        "engine": engine_kwargs(cell, model_dir),
        "env": {"DMX_SGLANG_ENABLE": "0"},
        "workloads": [w.spec() for w in stock_workloads(cell.model)],
        "monitored": False,
    }


def monitored_spec(cell: Cell, model_dir: Path, store: Path, run_id: str) -> dict[str, Any]:
    """The monitored engine's ``run_engine.py`` spec."""
    return {
        "engine": engine_kwargs(cell, model_dir),
        "env": monitored_env(cell, store, run_id),
        "workloads": [w.spec() for w in cell_workloads(cell)],
        "monitored": True,
    }


def _spec_shape(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec without its bulky prompt ids (their seed and lengths identify them)."""
    engine = {k: v for k, v in spec["engine"].items() if k != "model_path"}
    return {
        "engine": engine,
        "env": {k: v for k, v in spec["env"].items() if k not in ("DMX_DB_URL", "DMX_MODEL_ID")},
        "workloads": [{k: v for k, v in w.items() if k not in ("input_ids",)}
                      | {"ids": ep.stable_hash(w["input_ids"])} for w in spec["workloads"]],
    }


def stock_hash(cell: Cell) -> str:
    """Identity of a stock baseline (reused across calls while it matches)."""
    shape = _spec_shape(stock_spec(cell, Path("/model")))
    return ep.stable_hash([SCHEMA, cell.stock_key, ep.qwen3_config(cell.spec), shape])


def cell_hash(cell: Cell) -> str:
    """Identity of a cell result (reused across calls with the same commit)."""
    shape = _spec_shape(monitored_spec(cell, Path("/model"), Path("/store"), "run"))
    return ep.stable_hash([SCHEMA, ep.as_dict(cell), stock_hash(cell), shape])


# -- estimates -----------------------------------------------------------------------------
def estimate_stock_s(cell: Cell, startup: dict[str, float] | None = None) -> float:
    """Seconds the stock engine of ``cell`` should take, start to shutdown."""
    model = cell.spec
    gen = sum(model.generate_s(w, cell.graphs) + 1.0 for w in stock_workloads(cell.model))
    return _startup(cell, startup) + gen + ENGINE_OVERHEAD_S


def expected_bytes(cell: Cell) -> int:
    """Capture bytes of the cell's monitored run (every request with the extra forward)."""
    reqs = [(p, o, cell.overlap) for w in cell_workloads(cell)
            for p, o in zip(w.prompt_lens, w.output_lens, strict=True)]
    return ep.expected_capture(cell.preset, cell.spec, reqs).bytes


def estimate_monitored_s(cell: Cell, startup: dict[str, float] | None = None) -> float:
    """Seconds the monitored engine of ``cell`` and its read-back should take."""
    model = cell.spec
    workloads = cell_workloads(cell)
    gen = sum(model.generate_s(w, cell.graphs) + 1.0 for w in workloads)
    extra = 0.0
    if cell.persistence == "chdb":
        extra = expected_bytes(cell) / STORE_INGEST_BPS
        extra += READBACK_S_PER_REQUEST * sum(w.requests for w in workloads)
    return _startup(cell, startup) + gen + extra + ENGINE_OVERHEAD_S


def _startup(cell: Cell, measured: dict[str, float] | None) -> float:
    key = f"{cell.model}-{'graph' if cell.graphs else 'eager'}"
    if measured and key in measured:
        return max(measured[key] * 1.15, 10.0)
    return cell.spec.startup_s(cell.graphs)


@dataclass
class Step:
    """One engine start of the plan."""

    role: str
    """``stock`` or ``monitored``."""
    cell: Cell
    estimate_s: float
    cells: list[str] = field(default_factory=list)
    """Cells this engine serves."""


def make_plan(cells: Sequence[Cell], startup: dict[str, float] | None = None,
              cached: frozenset[str] = frozenset()) -> list[Step]:
    """Engine starts in run order: each stock baseline, then its monitored cells.

    ``cached``: stock keys whose baseline an earlier call measured (no engine start).
    """
    steps: list[Step] = []
    order: list[str] = []
    for cell in cells:
        if cell.stock_key not in order:
            order.append(cell.stock_key)
    for key in order:
        members = [c for c in cells if c.stock_key == key]
        est = 0.0 if key in cached else estimate_stock_s(members[0], startup)
        steps.append(Step("stock", members[0], est, [c.name for c in members]))
        steps.extend(Step("monitored", c, estimate_monitored_s(c, startup), [c.name])
                     for c in members)
    return steps


def render_plan(steps: Sequence[Step], deadline: float | None, now: float) -> str:
    """The plan as text: engine starts, estimates, what fits before the deadline."""
    lines = [f"{'#':>2}  {'engine':<22} {'serves':<44} {'est. s':>7} {'cum. s':>7}  fits"]
    total = 0.0
    for i, step in enumerate(steps, 1):
        total += step.estimate_s
        fits = "yes" if deadline is None or now + total <= deadline else "NO"
        label = f"{step.role} {step.cell.stock_key}" if step.role == "stock" else step.role
        if step.role == "stock" and step.estimate_s == 0:
            label += " (reused)"
        lines.append(f"{i:>2}  {label[:22]:<22} {','.join(step.cells)[:44]:<44} "
                     f"{step.estimate_s:>7.0f} {total:>7.0f}  {fits}")
    cells = {c for s in steps for c in s.cells}
    lines.append(f"{len(steps)} engine starts for {len(cells)} cells, about {total / 60:.1f} "
                 f"min of device time" + ("" if deadline is None else
                                          f"; {max(deadline - now, 0):.0f} s left in this call"))
    for step in steps:
        if step.role == "monitored":
            gb = expected_bytes(step.cell) / 1e9
            lines.append(f"    {step.cell.name}: {step.cell.preset}, "
                         f"{'graphs' if step.cell.graphs else 'eager'}, "
                         f"{'overlap' if step.cell.overlap else 'no overlap'}, "
                         f"store {step.cell.persistence}, ~{gb:.2f} GB captured")
    return "\n".join(lines)


# -- checks --------------------------------------------------------------------------------
def compare_tokens(stock: Sequence[dict[str, Any]], monitored: Sequence[dict[str, Any]],
                   workloads: set[str]) -> dict[str, Any]:
    """Monitored output ids against stock, request by request, for ``workloads``."""
    s = {o["id"]: o for o in stock if o.get("workload") in workloads}
    m = {o["id"]: o for o in monitored if o.get("workload") in workloads}
    diverged = []
    for rid, out in s.items():
        other = m.get(rid)
        if other is None or other["output_ids"] == out["output_ids"]:
            continue
        a, b = out["output_ids"], other["output_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
        diverged.append({"id": rid, "workload": out.get("workload"), "first_diff": first,
                         "stock_len": len(a), "monitored_len": len(b)})
    missing = sorted(set(s) - set(m))
    extra = sorted(set(m) - set(s))
    return {
        "ok": bool(s) and not diverged and not missing and not extra,
        "compared": len(s),
        "diverged_count": len(diverged),
        "diverged": diverged[:20],
        "missing_in_monitored": missing[:20],
        "unexpected_in_monitored": extra[:20],
    }


def stock_determinism(stock: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stock's ``again-*`` repeats against the first runs (same ids, same batch)."""
    first = {o["id"]: o["output_ids"] for o in stock
             if not str(o.get("workload", "")).startswith("again-")}
    pairs = diverged = 0
    ids: list[str] = []
    for o in stock:
        if not str(o.get("workload", "")).startswith("again-"):
            continue
        rid = str(o["id"]).removeprefix("again-")
        if rid in first:
            pairs += 1
            if first[rid] != o["output_ids"]:
                diverged += 1
                ids.append(rid)
    return {"ok": pairs > 0 and diverged == 0, "compared": pairs, "diverged": diverged,
            "diverged_ids": ids[:20], "required": False}


def read_back(store: Path, run_id: str, outputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Everything the completeness check needs, read through the public reading API."""
    from dmi_sglang import open_store

    captures = open_store(f"chdb://{store}")
    started = time.perf_counter()
    incomplete: dict[str, list[str]] = {}
    manifests: dict[str, list[int | bool]] = {}
    with captures.session():
        run = captures.run(run_id)
        for out in outputs:
            rid = str(out["id"])
            missing = captures.handle(run_id, rid).missing
            if missing:
                incomplete[rid] = list(missing)
            manifest = captures.manifest(run_id, rid)
            if manifest is not None:
                manifests[rid] = [manifest.prompt_tokens, manifest.completion_tokens,
                                  manifest.overlap_extra_forward, manifest.computed_from]
        store_requests = [r.request_id for r in captures.requests(run_id)] if run else []
        totals = {t.act_name: [t.layers, t.records, t.rows, t.bytes]
                  for t in captures.hook_totals(run_id)} if run else {}
    return {
        "run_status": run.status.value if run is not None else None,
        "incomplete": incomplete,
        "manifests": manifests,
        "store_requests": store_requests,
        "hook_totals": totals,
        "read_s": time.perf_counter() - started,
    }


def check_rows(cell: Cell, outputs: Sequence[dict[str, Any]],
               back: dict[str, Any]) -> dict[str, Any]:
    """Row completeness from :func:`read_back`: every request, every row, nothing more."""
    problems: list[str] = []
    if back["run_status"] != "committed":
        problems.append(f"run status {back['run_status']!r}, not 'committed'")
    sent = {str(o["id"]) for o in outputs}
    stored = set(back["store_requests"])
    if sent - stored:
        problems.append(f"{len(sent - stored)} requests have no rows in the store")
    if stored - sent:
        problems.append(f"{len(stored - sent)} unexpected request ids in the store")
    mismatched = []
    for out in outputs:
        got = back["manifests"].get(str(out["id"]))
        if got is None or got[:2] != [out["prompt_tokens"], out["completion_tokens"]]:
            mismatched.append(str(out["id"]))
    if mismatched:
        problems.append(f"{len(mismatched)} manifests disagree with SGLang's token counts")
    expected = ep.expected_capture(
        cell.preset, cell.spec,
        ((int(m[0]), int(m[1]), bool(m[2])) for m in back["manifests"].values()))
    got_by_act = {a: [v[2], v[3]] for a, v in back["hook_totals"].items()}
    if back["incomplete"]:
        problems.append(f"{len(back['incomplete'])} requests incomplete (CaptureHandle.missing)")
    first = dict(list(back["incomplete"].items())[:5])
    return {
        "ok": not problems and bool(outputs),
        "requests": len(outputs),
        "problems": problems,
        "incomplete_examples": first,
        "manifest_mismatch_examples": mismatched[:5],
        "stored_bytes": sum(v[3] for v in back["hook_totals"].values()),
        "expected_bytes": expected.bytes,
        "stored_rows": sum(v[2] for v in back["hook_totals"].values()),
        "expected_rows": expected.rows,
        "per_hook_stored": got_by_act,
        "per_hook_expected": expected.by_act,
        "extra_forward_requests": sum(1 for m in back["manifests"].values() if m[2]),
        "read_s": back["read_s"],
    }


def check_exact(rows: dict[str, Any], outputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stored rows and bytes per hook equal what the manifests imply (informational:
    a retracted and recomputed request legitimately stores superseded rows too)."""
    retractions = sum(int(o.get("num_retractions") or 0) for o in outputs)
    return {
        "ok": rows.get("per_hook_stored") == rows.get("per_hook_expected"),
        "stored_bytes": rows.get("stored_bytes"),
        "expected_bytes": rows.get("expected_bytes"),
        "retractions": retractions,
        "required": False,
    }


def throughput(stock: dict[str, Any], mon: dict[str, Any]) -> dict[str, Any]:
    """Output tokens/s per timed workload: stock, monitored, ratio."""
    s = {w["name"]: w for w in stock.get("workloads", [])}
    out: dict[str, Any] = {}
    for w in mon.get("workloads", []):
        if not w["timed"] or w["name"] not in s:
            continue
        st = s[w["name"]]
        mt = w["output_tokens"] / w["seconds"] if w["seconds"] else None
        stt = st["output_tokens"] / st["seconds"] if st["seconds"] else None
        out[w["name"]] = {
            "requests": w["requests"], "output_tokens": w["output_tokens"],
            "monitored_tok_s": mt, "stock_tok_s": stt,
            "ratio": mt / stt if mt and stt else None,
        }
    return out


SOFTWARE_KEYS = ("python", "torch", "sglang", "device")
"""``env_info`` entries a stock baseline must share with the monitored engine."""


def same_software(stock: dict[str, Any], mon: dict[str, Any]) -> dict[str, Any]:
    """Whether stock and monitored engines ran the same Python, torch, SGLang and device
    (a baseline reused from an earlier lease might not have)."""
    a, b = stock.get("env_info") or {}, mon.get("env_info") or {}
    differ = {k: {"stock": a.get(k), "monitored": b.get(k)}
              for k in SOFTWARE_KEYS if a.get(k) != b.get(k)}
    return {"ok": not differ, "differ": differ}


def evaluate(cell: Cell, stock: dict[str, Any], mon: dict[str, Any],
             back: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checks, figures) of a cell from its two engine results and the read-back."""
    names = {w.name for w in cell_workloads(cell)}
    outputs = mon.get("outputs", [])
    stopped = mon.get("events", {}).get("dmi.stopped")
    tokens = compare_tokens(stock.get("outputs", []), outputs, names)
    tokens["required"] = cell.tokens_required
    eager = (stopped or {}).get("forced_eager")
    if not tokens["ok"] and cell.graphs and eager:
        tokens["note"] = (f"{eager} decode steps ran eagerly (ring full); SGLang's eager "
                          "decode is not bit-identical to graph replay")
    checks: dict[str, Any] = {
        "same_software": same_software(stock, mon),
        "token_identity": tokens,
        "stock_deterministic": stock_determinism(stock.get("outputs", [])),
    }
    if cell.persistence == "chdb":
        checks["rows_complete"] = check_rows(cell, outputs, back) if back is not None else {
            "ok": False, "problems": ["the store was not read back"]}
        checks["stored_exactly_expected"] = check_exact(checks["rows_complete"], outputs)
    else:
        reqs = [(int(o["prompt_tokens"]), int(o["completion_tokens"])) for o in outputs]
        checks["rows_complete"] = ep.check_transport_rows(stopped or {}, cell.preset,
                                                          cell.spec, reqs)
        if stopped is None:
            checks["rows_complete"]["problems"] = ["no dmi.stopped line in the engine log"]
    stored = checks["rows_complete"].get("stored_bytes")
    closed = mon.get("events", {}).get("store.closed") or {}
    head = throughput(stock, mon).get(throughput_workload(cell), {})
    figures = {
        "throughput": throughput(stock, mon),
        "headline_workload": throughput_workload(cell),
        "headline_ratio": head.get("ratio"),
        "headline_monitored_tok_s": head.get("monitored_tok_s"),
        "headline_stock_tok_s": head.get("stock_tok_s"),
        "capture_bytes": (stopped or {}).get("bytes", stored),
        "stored_bytes": stored,
        "transport": stopped,
        "store": closed or None,
        "store_insert_MBps": (closed["bytes_stored"] / closed["insert_seconds"] / 1e6
                              if closed.get("insert_seconds") else None),
        "forced_eager_steps": (stopped or {}).get("forced_eager"),
        "monitored_startup_s": mon.get("startup_s"),
        "stock_startup_s": stock.get("startup_s"),
        "monitored_durable_s": mon.get("durable_s"),
        "stop_s": mon.get("stop_s"),
    }
    return checks, figures


def status_of(checks: dict[str, Any]) -> str:
    """``passed`` when every required check is ok, else ``failed``."""
    required = [c for c in checks.values() if c.get("required", True)]
    return "passed" if required and all(c.get("ok") for c in required) else "failed"


# -- running -------------------------------------------------------------------------------
Launcher = Callable[[dict[str, Any], Path, str, float], dict[str, Any]]
ReadBack = Callable[[Path, str, Sequence[dict[str, Any]]], dict[str, Any]]


@dataclass
class Runner:
    """Runs a plan of cells; engines, read-back and the clock are injectable (tests)."""

    results: Path
    state: Path
    work: Path
    deadline: float | None
    command: str
    launcher: Launcher = ep.launch
    read_back: ReadBack = read_back
    clock: Callable[[], float] = time.time
    fresh: bool = False
    keep_stores: bool = False
    stock_from: Path | None = None
    """Stock baselines of an earlier lease, reused where their ``stock_hash`` matches."""
    git: dict[str, Any] = field(default_factory=ep.git_info)
    ran: dict[str, str] = field(default_factory=dict)
    """cell -> status, for this invocation."""

    def __post_init__(self) -> None:
        self.results.mkdir(parents=True, exist_ok=True)
        self.models = self.state / "models"
        self.timings_path = self.state / "timings.json"

    @property
    def cell_state(self) -> Path:
        """Saved cell results of this commit and code."""
        return self.state / "cells" / f"{self.git['commit'][:12]}-{self.git.get('code', '')}"

    def timings(self) -> dict[str, float]:
        """Measured engine startups of earlier calls (``<model>-<graph|eager>``)."""
        return _load(self.timings_path) or {}

    def _remember_startup(self, cell: Cell, result: dict[str, Any]) -> None:
        if result.get("startup_s"):
            t = self.timings()
            t[f"{cell.model}-{'graph' if cell.graphs else 'eager'}"] = result["startup_s"]
            ep.write_json(self.timings_path, t)

    def _left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - self.clock()

    def saved(self, cell: Cell) -> dict[str, Any] | None:
        """An earlier result of this cell for this commit and spec, if any."""
        if self.fresh:
            return None
        data = _load(self.cell_state / f"{cell.name}.json")
        if data and data.get("cell_hash") == cell_hash(cell) and \
                data.get("status") in ("passed", "failed"):
            return data
        return None

    def run(self, cells: Sequence[Cell]) -> int:
        """Run (or reuse) every cell; write one JSON each and a summary. Exit status."""
        if self.launcher is ep.launch:
            killed = ep.track_engines(self.state / "engines.pgids")
            if killed:
                print(f"[qualify] killed engines left by an earlier call: {killed}")
        todo = [c for c in cells if self.saved(c) is None]
        for cell in cells:
            if cell not in todo:
                data = self.saved(cell)
                assert data is not None
                data["from_earlier_call"] = True
                self._publish(cell, data, save=False)
        steps = self.plan(cells)
        stocks: dict[str, dict[str, Any]] = {}
        for step in steps:
            cell = step.cell
            if step.role == "stock":
                stocks[cell.stock_key] = self._stock(cell, step)
                continue
            self._cell(cell, step, stocks[cell.stock_key])
        return self._summary(cells)

    def plan(self, cells: Sequence[Cell]) -> list[Step]:
        """The engine starts still needed for ``cells`` (earlier results reused)."""
        todo = [c for c in cells if self.saved(c) is None]
        cached = frozenset(c.stock_key for c in todo if self._earlier_stock(c) is not None)
        return make_plan(todo, self.timings(), cached)

    def _earlier_stock(self, cell: Cell) -> dict[str, Any] | None:
        """A passed stock baseline of ``cell`` from an earlier call or ``stock_from``."""
        if self.fresh:
            return None
        own = self._stock_path(cell)
        candidates = [(own, "in an earlier call")]
        if self.stock_from is not None:
            candidates.append((self.stock_from / own.name, f"from {self.stock_from}"))
        key = stock_hash(cell)
        for path, origin in candidates:
            data = _load(path)
            if data and data.get("ok") and data.get("stock_hash") == key:
                data["source"] = f"reused: ran {data.get('ran_at_utc')} {origin}"
                return data
        return None

    def _stock_path(self, cell: Cell) -> Path:
        return self.state / "stock" / f"{cell.stock_key}-{stock_hash(cell)}.json"

    def _stock(self, cell: Cell, step: Step) -> dict[str, Any]:
        key = stock_hash(cell)
        path = self._stock_path(cell)
        cached = self._earlier_stock(cell)
        if cached is not None:
            return cached
        if step.estimate_s > self._left():
            return {"ok": False, "skipped": True,
                    "error": f"not started: needs ~{step.estimate_s:.0f} s, "
                             f"{max(self._left(), 0):.0f} s left in this call"}
        started = ep.utc_now()
        spec = stock_spec(cell, self._model_dir(cell))
        result = self.launcher(spec, self.work / "engines", f"stock-{cell.stock_key}",
                               self._timeout())
        result.update(ran_at_utc=started, finished_at_utc=ep.utc_now(), stock_hash=key,
                      source="this call")
        self._remember_startup(cell, result)
        self._keep_log_tail(result, f"stock-{cell.stock_key}")
        if result.get("ok"):
            ep.write_json(path, result)
        return result

    def _cell(self, cell: Cell, step: Step, stock: dict[str, Any]) -> None:
        base = self._base(cell)
        if stock.get("skipped"):
            base.update(status="skipped", error=f"stock baseline {stock['error']}")
            self._publish(cell, base)
            return
        if not stock.get("ok"):
            base.update(status="error", error=f"stock baseline failed: {stock.get('error')}",
                        stock=_engine_summary(stock))
            self._publish(cell, base)
            return
        if step.estimate_s > self._left():
            base.update(status="skipped",
                        error=f"not started: needs ~{step.estimate_s:.0f} s, "
                              f"{max(self._left(), 0):.0f} s left in this call")
            self._publish(cell, base)
            return
        store = self.work / "stores" / cell.name
        shutil.rmtree(store, ignore_errors=True)
        store.parent.mkdir(parents=True, exist_ok=True)
        run_id = f"{cell.name}-{ep.utc_now().replace(':', '').replace('-', '')[:15]}"
        spec = monitored_spec(cell, self._model_dir(cell), store, run_id)
        assert spec["engine"] == stock_spec(cell, self._model_dir(cell))["engine"], \
            "stock and monitored ServerArgs must be identical"
        base["ran_at_utc"] = ep.utc_now()
        mon = self.launcher(spec, self.work / "engines", f"monitored-{cell.name}",
                            self._timeout())
        self._remember_startup(cell, mon)
        self._keep_log_tail(mon, f"monitored-{cell.name}")
        base.update(stock=_engine_summary(stock), monitored=_engine_summary(mon))
        if not mon.get("ok"):
            base.update(status="error", error=f"monitored engine: {mon.get('error')}",
                        log_tail=mon.get("log_tail"))
            self._publish(cell, base)
            return
        back = None
        try:
            if cell.persistence == "chdb":
                back = self.read_back(store, mon.get("run_id") or run_id, mon["outputs"])
            checks, figures = evaluate(cell, stock, mon, back)
            base.update(checks=checks, figures=figures, status=status_of(checks))
        except Exception as exc:  # a broken read-back is a result, not a crash
            base.update(status="error", error=f"checks failed to run: {exc!r}")
        finally:
            if not self.keep_stores:
                shutil.rmtree(store, ignore_errors=True)
        base["finished_at_utc"] = ep.utc_now()
        self._publish(cell, base)

    def _base(self, cell: Cell) -> dict[str, Any]:
        model_dir = self._model_dir(cell)
        return {
            "cell": cell.name,
            "schema": SCHEMA,
            "ran_at_utc": None,
            "finished_at_utc": None,
            "commit": self.git["commit"],
            "dirty": self.git["dirty"],
            "code_fingerprint": self.git.get("code"),
            "command": self.command,
            "cell_hash": cell_hash(cell),
            "settings": {
                "cell": ep.as_dict(cell),
                "model": ep.as_dict(cell.spec),
                "config_json": ep.qwen3_config(cell.spec),
                "engine": engine_kwargs(cell, model_dir),
                "monitored_env": monitored_env(cell, Path("<store>"), "<run id>"),
                "stock_env": {"DMX_SGLANG_ENABLE": "0"},
                "seed": ep.SEED,
                "workloads": [_workload_summary(w) for w in cell_workloads(cell)],
                "stock_extra_workloads": [w.name for w in stock_workloads(cell.model)
                                          if w.name.startswith("again-")],
                "expected_capture_bytes": expected_bytes(cell),
            },
            "status": None,
            "error": None,
        }

    def _publish(self, cell: Cell, data: dict[str, Any], *, save: bool = True) -> None:
        data.setdefault("from_earlier_call", False)
        data.setdefault("written_at_utc", ep.utc_now())
        ep.write_json(self.results / f"{cell.name}.json", data)
        if save and data.get("status") != "skipped":
            ep.write_json(self.cell_state / f"{cell.name}.json", data)
        self.ran[cell.name] = str(data.get("status"))
        print(f"[qualify] {cell.name}: {data.get('status')}"
              + (f" ({data['error']})" if data.get("error") else ""), flush=True)

    def _summary(self, cells: Sequence[Cell]) -> int:
        rows = []
        for cell in cells:
            data = _load(self.results / f"{cell.name}.json") or {}
            fig = data.get("figures") or {}
            rows.append({
                "cell": cell.name, "status": data.get("status"),
                "ran_at_utc": data.get("ran_at_utc"),
                "from_earlier_call": data.get("from_earlier_call"),
                "headline_ratio": fig.get("headline_ratio"),
                "error": data.get("error"),
            })
        statuses = [r["status"] for r in rows]
        if all(s == "passed" for s in statuses):
            code = 0
        elif any(s in ("failed", "error") for s in statuses):
            code = 1
        else:
            code = EXIT_INCOMPLETE
        ep.write_json(self.results / "summary.json", {
            "written_at_utc": ep.utc_now(), "commit": self.git["commit"],
            "command": self.command, "cells": rows, "exit_status": code,
        })
        print("[qualify] summary:")
        for r in rows:
            ratio = r["headline_ratio"]
            print(f"  {r['cell']:<30} {r['status'] or '-':<8} "
                  f"{'' if ratio is None else f'{ratio:.3f}x stock':<14} "
                  f"{'(earlier call)' if r['from_earlier_call'] else ''}")
        if code == EXIT_INCOMPLETE:
            print("[qualify] some cells did not fit in this call: run the same command again")
        return code

    def _model_dir(self, cell: Cell) -> Path:
        return ep.write_model_dir(self.models, cell.spec)

    def _timeout(self) -> float:
        return min(900.0, max(self._left(), 30.0))

    def _keep_log_tail(self, result: dict[str, Any], name: str) -> None:
        log = result.get("log")
        if not log or not Path(log).exists():
            return
        lines = Path(log).read_text(errors="replace").splitlines()[-300:]
        (self.results / "logs").mkdir(parents=True, exist_ok=True)
        (self.results / "logs" / f"{name}.log.tail").write_text("\n".join(lines) + "\n")


def _engine_summary(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("ok", "error", "startup_s", "generate_s", "durable_s", "stop_s", "output_tokens",
            "run_id", "wall_s", "timed_out", "leftover_processes", "gpu_mib_before",
            "env_info", "ran_at_utc", "finished_at_utc", "source", "stock_hash", "events")
    out = {k: result[k] for k in keep if k in result}
    out["workloads"] = [{k: v for k, v in w.items() if k != "outputs"}
                        for w in result.get("workloads", [])]
    return out


def _workload_summary(w: ep.Workload) -> dict[str, Any]:
    return {"name": w.name, "requests": w.requests, "prompt_tokens": w.prompt_tokens,
            "output_tokens": w.output_tokens, "max_prompt": max(w.prompt_lens),
            "max_output": max(w.output_lens), "timed": w.timed}


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _stock_dir(text: str | None) -> Path | None:
    """The ``--stock-from`` directory, or None; a clear error for anything else."""
    if not text:
        return None
    path = Path(text)
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise SystemExit(f"qualify: --stock-from / DMI_V0519_STOCK_FROM {text!r} {problem} "
                         "(expected a directory of <stock_key>-<stock_hash>.json files)")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", help="directory for one JSON per cell")
    parser.add_argument("--cells", default=None,
                        help="comma-separated cells or groups (default: $DMI_V0519_CELLS "
                             "or 'core')")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds this invocation may use (0: no limit; default: "
                             "$DMI_V0519_BUDGET_S, else until 45 s before the device "
                             "call's 10-minute limit)")
    parser.add_argument("--state", default=None, help="state directory ($DMI_V0519_STATE)")
    parser.add_argument("--work", default=None, help="work directory ($DMI_V0519_WORK)")
    parser.add_argument("--fresh", action="store_true", help="ignore earlier results")
    parser.add_argument("--keep-stores", action="store_true")
    parser.add_argument("--stock-from", default=None,
                        help="stock baselines of an earlier lease ($DMI_V0519_STOCK_FROM)")
    args = parser.parse_args(argv)

    if args.list:
        for cell in CELLS:
            print(f"{cell.name:<30} {'core' if cell.core else 'optional':<9} {cell.preset:<14} "
                  f"{'graphs' if cell.graphs else 'eager':<7} store={cell.persistence} "
                  f"{cell.note}")
        return 0
    try:
        cells = select_cells(args.cells if args.cells is not None
                             else os.environ.get("DMI_V0519_CELLS"))
    except ValueError as exc:
        parser.error(str(exc))
    budget = args.budget_s
    if budget is None and os.environ.get("DMI_V0519_BUDGET_S"):
        budget = float(os.environ["DMI_V0519_BUDGET_S"])
    deadline = ep.call_deadline(budget)
    if args.dry_run:
        print(render_plan(make_plan(cells), deadline, time.time()))
        return 0
    if not args.results:
        parser.error("the results directory is required")
    results = Path(args.results).resolve()
    state = Path(args.state or os.environ.get("DMI_V0519_STATE") or
                 ep.default_state_dir("dmi-v0519-state", results / ".state"))
    work = Path(args.work or os.environ.get("DMI_V0519_WORK") or
                tempfile.mkdtemp(prefix="dmi-v0519-"))
    runner = Runner(
        results=results, state=state, work=work, deadline=deadline,
        command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]) +
        f"  [DMI_V0519_CELLS={','.join(c.name for c in cells)}]",
        fresh=args.fresh or _flag("DMI_V0519_FRESH"),
        keep_stores=args.keep_stores or _flag("DMI_V0519_KEEP_STORES"),
        stock_from=_stock_dir(args.stock_from or os.environ.get("DMI_V0519_STOCK_FROM")),
    )
    print(render_plan(runner.plan(cells), deadline, time.time()), flush=True)
    return runner.run(cells)


if __name__ == "__main__":
    sys.exit(main())
