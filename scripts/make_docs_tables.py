"""Generate the result tables of the docs from the JSON evidence (never typed by hand).

Reads every ``*.json`` under ``docs/evidence/`` and rewrites the blocks between marker
comments, leaving the hand-written text around them alone::

    <!-- BEGIN GENERATED: qualified-cells -->
    ...
    <!-- END GENERATED: qualified-cells -->

Blocks: ``qualified-cells`` (docs/v0519-port.md; cell results of tests/gpu/qualify.py),
``serving-bench`` and ``transport-bench`` (docs/benchmarks.md; bench/bench_serving.py and
bench/bench_transport.py results). For a cell measured more than once the latest run wins
(results marked ``skipped`` never replace a real one); the files of one serving-benchmark
configuration are merged, each mode's latest run winning.

    python scripts/make_docs_tables.py            # rewrite the docs
    python scripts/make_docs_tables.py --check    # exit 1 when a doc is out of date
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "bash scripts/gpu-run.sh bash tests/run_v0519_smoke.sh $OUT/cells"
NA = "-"
"""Shown for a value that was not measured."""
BENCH = "bash scripts/gpu-run.sh python bench/bench_serving.py --out $OUT/bench_serving.json"


# -- evidence ------------------------------------------------------------------------------
def load_evidence(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every JSON object under ``root`` (unreadable files are skipped)."""
    out = []
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append((path, data))
    return out


def is_cell(data: dict[str, Any]) -> bool:
    """A qualification cell result (tests/gpu/qualify.py)."""
    return "cell" in data and "cell_hash" in data and "status" in data


def is_serving(data: dict[str, Any]) -> bool:
    """A serving benchmark result (bench/bench_serving.py)."""
    return data.get("bench") == "serving" and "modes" in data


def is_transport(data: dict[str, Any]) -> bool:
    """A transport micro-benchmark result (bench/bench_transport.py)."""
    return isinstance(data.get("overhead"), list) and "d2h" in data


def latest_cells(items: Iterable[tuple[Path, dict[str, Any]]]) -> dict[str, tuple[Path, dict]]:
    """cell name -> (file, result) of its latest run; real runs beat ``skipped`` ones."""
    best: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path, data in items:
        if not is_cell(data):
            continue
        name = str(data["cell"])
        key = (data.get("status") != "skipped", str(data.get("ran_at_utc") or ""))
        cur = best.get(name)
        if cur is None or key > (cur[1].get("status") != "skipped",
                                 str(cur[1].get("ran_at_utc") or "")):
            best[name] = (path, data)
    return best


def _rel(path: Path, docs: Path) -> str:
    try:
        return str(path.resolve().relative_to(docs.resolve()))
    except ValueError:
        return str(path)


def _fmt(value: Any, spec: str, scale: float = 1.0, none: str = NA) -> str:
    if value is None:
        return none
    try:
        return format(value if scale == 1.0 else value * scale, spec)
    except (TypeError, ValueError):
        return str(value)


def _commit(commit: Any, code: Any) -> str:
    """A commit with the fingerprint of the code that ran (``engine_proc.code_fingerprint``:
    the device's git HEAD may lag the working tree it was sent)."""
    text = str(commit or NA)[:8]
    return f"{text} (code {str(code)[:8]})" if code else text


def _module(path: Path, name: str) -> Any:
    """Import the script at ``path`` under ``name`` (not left in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def _catalogue() -> list[Any]:
    """The cells tests/gpu/qualify.py defines (empty if it cannot be imported here)."""
    try:
        return list(_module(ROOT / "tests" / "gpu" / "qualify.py", "_dmi_qualify").CELLS)
    except Exception:  # the table still lists the results
        return []


def _breakdown_table(data: dict[str, Any]) -> list[str]:
    """bench/bench_serving.py's "where the time goes" rows of one result, as Markdown."""
    rows = _bench().breakdown(data)
    if not rows:
        return []
    out = ["Where the time goes (counters of the same runs; `-`: not reported by that run):",
           "",
           "| mode | capture rate stock speed needs, GB/s | most x stock the 55 GB/s D2H "
           "ceiling allows | waiting for ring space, s (share) | hook time per forward (waits "
           "included), us "
           "| drain CPU building records (window copy threads included), s "
           "| drain blocked in sink.put, s "
           "| store writers (busy) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stall = NA if r["stall_s"] is None else (
            f"{r['stall_s']:.1f} ({_fmt(r['stall_share'], '.0f', 100)} %)")
        writers = NA if r["store_writers"] is None else (
            f"{r['store_writers']} ({_fmt(r['store_writer_busy'], '.0f', 100)} %)")
        out.append(
            f"| {r['mode']} | {_fmt(r['needed_bps_at_stock'], '.2f', 1e-9)} | "
            f"{_fmt(r['d2h_bound_ratio'], '.2f')} | {stall} | "
            f"{_fmt(r['hook_us_per_forward'], '.0f')} | {_fmt(r['drain_build_cpu_s'], '.1f')} | "
            f"{_fmt(r['drain_sink_blocked_s'], '.1f')} | {writers} |")
    return [*out, ""]


# -- tables --------------------------------------------------------------------------------
def cells_table(items: list[tuple[Path, dict[str, Any]]], docs: Path,
                catalogue: list[Any] | None = None) -> str:
    """The qualified-cells table (markdown)."""
    best = latest_cells(items)
    catalogue = _catalogue() if catalogue is None else catalogue
    names = [c.name for c in catalogue] + sorted(set(best) - {c.name for c in catalogue})
    lines = []
    if not best:
        lines += [f"_No qualification results under docs/evidence/ yet. Run `{SMOKE}` on the "
                  "H200 machine, copy `$OUT/cells` to `docs/evidence/<date>-h200/cells/` and "
                  "run `python scripts/make_docs_tables.py`._", ""]
    lines += [
        "| cell | model | decode | preset | overlap | store | status | tokens = stock "
        "| rows complete | tok/s monitored / stock (workload) | captured | ran (UTC) "
        "| commit (code) | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_name = {c.name: c for c in catalogue}
    for name in names:
        path, data = best.get(name, (None, {}))
        settings = (data.get("settings") or {}).get("cell") or {}
        cell = by_name.get(name)
        model = settings.get("model", getattr(cell, "model", "?"))
        graphs = settings.get("graphs", getattr(cell, "graphs", None))
        preset = settings.get("preset", getattr(cell, "preset", "?"))
        overlap = settings.get("overlap", getattr(cell, "overlap", None))
        store = settings.get("persistence", getattr(cell, "persistence", "?"))
        ring = settings.get("ring_mb", getattr(cell, "ring_mb", None))
        if ring:
            store = f"{store}, ring {ring} MiB"
        checks = data.get("checks") or {}
        tokens = checks.get("token_identity") or {}
        rows = checks.get("rows_complete") or {}
        fig = data.get("figures") or {}
        captured = fig.get("stored_bytes") or fig.get("capture_bytes")
        status = data.get("status") or "not run"
        if data.get("error") and status != "passed":
            status += f" ({str(data['error'])[:60]})"
        tput = NA
        if fig.get("headline_monitored_tok_s") is not None:
            tput = (f"{_fmt(fig['headline_monitored_tok_s'], ',.0f')} / "
                    f"{_fmt(fig.get('headline_stock_tok_s'), ',.0f')} = "
                    f"{_fmt(fig.get('headline_ratio'), '.3f')}x ({fig.get('headline_workload')})")
        token_txt = NA if not tokens else (
            f"{'yes' if tokens.get('ok') else 'NO'} ({tokens.get('compared')} req.)")
        rows_txt = NA if not rows else (
            f"{'yes' if rows.get('ok') else 'NO'}"
            + (f" ({rows['requests']} req.)" if rows.get("requests") else ""))
        decode = "?" if graphs is None else "graphs" if graphs else "eager"
        sched = "?" if overlap is None else "on" if overlap else "off"
        lines.append(
            f"| {name} | {model} | {decode} | {preset} | {sched} | {store}"
            f" | {status} | {token_txt} | {rows_txt} | {tput} | "
            f"{_fmt(captured, '.2f', 1e-9)}{' GB' if captured else ''} | "
            f"{data.get('ran_at_utc') or NA} | "
            f"{_commit(data.get('commit'), data.get('code_fingerprint'))} | "
            f"{'[json](' + _rel(path, docs) + ')' if path else NA} |")
    return "\n".join(lines)


_BENCH: list[Any] = []


def _bench() -> Any:
    """bench/bench_serving.py as a module (loaded once)."""
    if not _BENCH:
        _BENCH.append(_module(ROOT / "bench" / "bench_serving.py", "_dmi_bench_serving"))
    return _BENCH[0]


def merged_serving(items: Iterable[tuple[Path, dict[str, Any]]]
                   ) -> list[tuple[list[Path], dict[str, Any]]]:
    """Serving results merged per configuration: every file of the configuration, oldest
    first, each mode's latest run winning (modes keep their own commit and time, as
    ``bench_serving.py --merge-from`` does); the summary is recomputed from the merge."""
    groups: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path, data in items:
        if is_serving(data):
            groups.setdefault(str(data.get("config_hash")), []).append((path, data))
    bench = _bench()
    out = []
    for files in groups.values():
        files.sort(key=lambda f: str(f[1].get("written_at_utc") or ""))
        merged = json.loads(json.dumps(files[0][1]))
        for _, data in files[1:]:
            merged = bench.merge(merged, data)
        measured = set(merged["modes"])
        merged["pending_modes"] = [m for m in files[-1][1].get("pending_modes") or []
                                   if m not in measured]
        merged["summary"] = bench.summarize(merged)
        out.append(([f[0] for f in files], merged))
    return out


def serving_tables(items: list[tuple[Path, dict[str, Any]]], docs: Path) -> str:
    """One table per serving-benchmark configuration (its files merged, latest mode wins)."""
    best = merged_serving(items)
    if not best:
        return (f"_No serving-benchmark results under docs/evidence/ yet. Run `{BENCH}` on "
                "the H200 machine (repeat the same command until it reports no pending "
                "mode), copy the JSON to `docs/evidence/<date>-h200/` and run "
                "`python scripts/make_docs_tables.py`._")
    out = []
    for paths, data in sorted(best, key=lambda x: json.dumps(x[1].get("config", {}),
                                                            sort_keys=True)):
        cfg = data.get("config") or {}
        summary = data.get("summary") or {}
        out += [
            f"**Qwen3-{str(cfg.get('model', '?')).upper()} shape, {cfg.get('batch')} x "
            f"{cfg.get('prompt_len')} prompt x {cfg.get('output_len')} output tokens, "
            f">= {cfg.get('min_seconds')} s per mode"
            + (f", py-spy sampling for {cfg['profile_seconds']:g} s per pass"
               if cfg.get("profile_seconds") else "")
            + (f", torch profiler over {cfg['torch_profile_steps']} decode steps"
               if cfg.get("torch_profile_steps") else "")
            + (f", monitored with {cfg['monitored_env']}" if cfg.get("monitored_env") else "")
            + "** (" + ", ".join(f"[json]({_rel(p, docs)})" for p in paths) + ")",
            "",
            "| mode | output tok/s | x stock | waves | capture GB | capture GB/s | % of 55 GB/s "
            "| store insert MB/s | store end-to-end MB/s | commit (code) | ran (UTC) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary.get("rows", []):
            mode = r["mode"] + ("" if r.get("ok") else " (error)")
            out.append(
                f"| {mode} | {_fmt(r.get('tok_s'), ',.0f')} | {_fmt(r.get('ratio'), '.3f')} | "
                f"{_fmt(r.get('waves'), 'd')} | {_fmt(r.get('capture_bytes'), '.2f', 1e-9)} | "
                f"{_fmt(r.get('capture_bps'), '.2f', 1e-9)} | "
                f"{_fmt(r.get('d2h_fraction'), '.1f', 100)} | "
                f"{_fmt(r.get('store_insert_MBps'), '.0f')} | "
                f"{_fmt(r.get('store_e2e_MBps'), '.0f')} | "
                f"{_commit(r.get('commit'), r.get('code'))} | "
                f"{r.get('ran_at_utc') or NA} |")
        out.append("")
        for t in summary.get("targets", []):
            ratio = "" if t.get("ratio") is None else f" ({t['ratio']:.3f}x)"
            out.append(f"- target: {t['target']}: **{t['verdict']}**{ratio}")
        if data.get("pending_modes"):
            out.append(f"- not measured yet: {', '.join(data['pending_modes'])}")
        out.append("")
        out += _breakdown_table(data)
        profile = _bench().profile_lines(data)
        if profile:
            out += ["py-spy digest (per mode and pass: a thread's share of the samples, then "
                    "its top frames by own samples; `gil`: samples holding the GIL):", "",
                    *[f"- `{line}`" for line in profile], ""]
        torch_profile = _bench().torch_profile_lines(data)
        if torch_profile:
            out += ["torch profiler digest (SGLang's profiler over the first decode steps of "
                    "the timed workload; profiled runs are not timing results):", "",
                    *[f"- `{line}`" for line in torch_profile], ""]
    return "\n".join(out).rstrip()


def transport_tables(items: list[tuple[Path, dict[str, Any]]], docs: Path) -> str:
    """Per-step capture overhead of the transport micro-benchmark (every result file)."""
    files = [(p, d) for p, d in items if is_transport(d)]
    if not files:
        return "_No transport-benchmark results under docs/evidence/ yet._"
    out = []
    for path, data in files:
        env = data.get("env") or {}
        d2h = data.get("d2h") or {}
        out += [
            f"**{env.get('device', '?')}, torch {env.get('torch', '?')}** "
            f"([json]({_rel(path, docs)}))",
            "",
            "| preset | batch | captures/step | overhead µs (synchronised) | overhead µs "
            "(pipelined) | host commit+seal µs | rows ok | stalls |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["overhead"]:
            out.append(
                f"| {r.get('preset')} | {r.get('batch')} | {r.get('captures')} | "
                f"{_fmt(r.get('overhead_us_sync'), '.0f')} | "
                f"{_fmt(r.get('overhead_us_pipelined'), '.0f')} | "
                f"{_fmt(r.get('host_commit_seal_us'), '.0f')} | "
                f"{'yes' if r.get('rows_ok') else 'NO'} | {r.get('stalls')} |")
        out += ["",
                f"- pinned device-to-host ceiling {_fmt(d2h.get('ceiling_64mib_gbps'), '.1f')} "
                f"GB/s; drain copies {_fmt(d2h.get('drain_copy_gbps'), '.1f')} GB/s; records "
                f"end to end {_fmt(d2h.get('drain_end_to_end_gbps'), '.2f')} GB/s",
                ""]
    return "\n".join(out).rstrip()


BLOCKS: dict[str, tuple[str, Callable[[list[tuple[Path, dict[str, Any]]], Path], str]]] = {
    "qualified-cells": ("v0519-port.md", cells_table),
    "serving-bench": ("benchmarks.md", serving_tables),
    "transport-bench": ("benchmarks.md", transport_tables),
}


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name`` holding ``body``.

    Raises:
        ValueError: the markers are missing or not in order.
    """
    pattern = re.compile(
        rf"(<!-- BEGIN GENERATED: {re.escape(name)}[^>]*-->\n)(.*?)(<!-- END GENERATED: "
        rf"{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        msg = f"markers of block {name!r} not found"
        raise ValueError(msg)
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(3), text, count=1)


def generate(docs: Path, evidence: Path) -> dict[Path, str]:
    """New contents of every doc that holds a block (unchanged docs included)."""
    items = load_evidence(evidence)
    texts: dict[Path, str] = {}
    for name, (doc, render) in BLOCKS.items():
        path = docs / doc
        if not path.exists():
            continue
        text = texts.get(path, path.read_text())
        texts[path] = replace_block(text, name, render(items, docs))
    return texts


def main(argv: list[str] | None = None) -> int:
    """Rewrite the docs (or ``--check`` them); exit 1 when out of date under --check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", default=str(ROOT / "docs"))
    parser.add_argument("--evidence", default=None, help="default: DOCS/evidence")
    parser.add_argument("--check", action="store_true", help="report, do not write")
    args = parser.parse_args(argv)
    docs = Path(args.docs)
    evidence = Path(args.evidence) if args.evidence else docs / "evidence"
    try:
        texts = generate(docs, evidence)
    except ValueError as exc:
        print(f"make_docs_tables: {exc}", file=sys.stderr)
        return 2
    stale = [p for p, t in texts.items() if p.read_text() != t]
    if args.check:
        for p in stale:
            print(f"out of date: {p}")
        return 1 if stale else 0
    for p in stale:
        p.write_text(texts[p])
        print(f"updated {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
