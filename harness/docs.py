"""The result tables of ``docs/``, generated from the harness's JSON under ``docs/evidence/``.

Rewrites the blocks between ``<!-- BEGIN GENERATED: NAME ... -->`` and ``<!-- END
GENERATED: NAME -->``: ``qualified-cells`` (latest result per cell), ``serving-bench``
(latest serving benchmark), ``hooks-bench`` / ``transport-bench`` / ``store-bench``
(latest component benchmark: its ``figures["table"]``, a list of flat rows, and
``figures["note"]``) and ``copies-bench`` (latest ``python -m harness copies``). A block
with no result of the current schema is left as it is.

    python -m harness docs            # rewrite the docs
    python -m harness docs --check    # exit 1 when a doc is out of date
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness.constants import SCHEMA
from harness.results import REPO, Json, load_json

Found = list[tuple[Path, Json]]


COMPARISON_DIR = "comparison"
"""Results in a folder of this name are runs of two trees side by side (one of them not
the code of its day): evidence, never a doc's table."""


def evidence(root: Path) -> Found:
    """Every result of the current schema under ``root`` (none in a
    :data:`COMPARISON_DIR` folder), oldest run first."""
    found = [(p, d) for p in sorted(root.rglob("*.json"))
             if COMPARISON_DIR not in p.relative_to(root).parts[:-1]
             and (d := load_json(p)) is not None and d.get("schema") == SCHEMA and "kind" in d]
    return sorted(found, key=lambda item: str(item[1].get("ran_at_utc")))


def _latest(found: Found, kind: str) -> dict[str, tuple[Path, Json]]:
    """name -> its latest result of ``kind`` (a skipped run never replaces a real one; a
    profiled, sampled, ``--busy`` or ``--busy-ms`` run is a diagnostic, a run on the CPU or
    a ``--quick`` one a rehearsal, a run with ``DMX_*`` tuning from the environment
    (``settings.env``) a comparison: none is shown)."""
    best: dict[str, tuple[Path, Json]] = {}
    for path, data in found:
        settings = data.get("settings") or {}
        if (settings.get("profile") or settings.get("sample") or settings.get("busy")
                or settings.get("busy_ms") or settings.get("quick")
                or settings.get("device") == "cpu" or settings.get("env")):
            continue
        if data["kind"] == kind and (data["status"] != "skipped" or data["name"] not in best):
            best[data["name"]] = (path, data)
    return best


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _source(path: Path, data: Json, docs: Path) -> str:
    link = path.relative_to(docs) if path.is_relative_to(docs) else path
    return f"[{str(data.get('commit'))[:8]}, {str(data.get('ran_at_utc'))[:10]}]({link})"


def cells_table(found: Found, docs: Path) -> str:
    """One row per qualification cell ("" without results)."""
    cells = _latest(found, "qualify-cell")
    if not cells:
        return ""
    lines = ["| cell | status | tokens = stock | rows complete | bytes stored = captured "
             "| x stock (workload, stock spread) | captured | result |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (path, d) in cells.items():
        c, fig = d["checks"], d["figures"]
        tput = (fig.get("throughput") or {}).get(fig.get("headline_workload"), {})

        def ok(check: str, c: Json = c) -> str:
            return "-" if check not in c else ("yes" if c[check]["ok"] else "NO")

        tokens = c.get("token_identity") or {}
        lines.append(
            f"| {name} | {d['status']} | {ok('token_identity')} ({tokens.get('compared', 0)} "
            f"req.) | {ok('rows_complete')} | {ok('bytes_stored_equal_captured')} | "
            f"{_f(fig.get('headline_ratio'), '.3f')} ({fig.get('headline_workload')}, "
            f"{_f(tput.get('stock_spread'), '.1%')}) | "
            f"{_f((fig.get('capture_bytes') or 0) / 1e9, '.2f')} GB | {_source(path, d, docs)} |")
    return "\n".join(lines)


def serving_table(found: Found, docs: Path) -> str:
    """Per model and mode, its latest measured row of any serving benchmark (modes are
    often measured by different invocations), with the workload and the result it comes
    from."""
    from harness.serving import summarize

    rows: dict[tuple[str, str, str], tuple[Path, Json, Json]] = {}
    for path, d in found:
        if d["kind"] == "serving" and d["name"] == "serving":
            stored = {r["mode"]: r for r in d.get("summary") or []}
            # rows as today's summary names and judges them (a unit's --env settings in
            # its name; a failed unit's figures left out); the written ones for results
            # without units, and, where every unit passed, a figure older units did not
            # keep (their stock rates, say) as the result wrote it
            for made in summarize(d["units"]) if d.get("units") else list(stored.values()):
                old = stored.get(made["mode"], {}) if made.get("status") == "passed" else {}
                r = {k: old.get(k) if v is None and k != "ratio_spread" else v
                     for k, v in made.items()}  # one unit's spread: none, not 0 %
                if r.get("units"):
                    key = (str(d["settings"]["model"]), str(r["mode"]), card(d))
                    rows[key] = (path, d, r)
    known = {(model, mode) for model, mode, gpu in rows if gpu != "-"}
    rows = {k: v for k, v in rows.items() if k[2] != "-" or k[:2] not in known}
    if not rows:
        return ""
    lines = ["| mode | card | workload | engines | x stock (median) | spread | stock spread | "
             "bound | bound share | status | target | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (_, mode, gpu), (path, d, r) in rows.items():
        s = d["settings"]
        cap = s.get("stored_cell_capture_bytes") if str(mode).startswith("store:") else None
        work = (f"{s['model']}, {s['batch']} x {s['prompt_len']} + {s['output_len']}, "
                f">= {s['min_seconds']:g} s" + (f" or {cap / 1e9:g} GB" if cap else ""))
        lines.append(
            f"| {mode} | {gpu} | {work} | {r['units']} | {_f(r['ratio'], '.3f')} | "
            f"{_f(r['ratio_spread'], '.1%')} | {_f(r['stock_spread'], '.1%')} | "
            f"{_f(r['bound'], '.2f')} | {_f(r.get('bound_share', r.get('of_bound')), '.2f')} "
            f"| {r['status']} | {_target(d, r)} | {_source(path, d, docs)} |")
    return "\n".join(lines)


def card(result: Json) -> str:
    """The GPU a serving result ran on, as its units' software check compared it (``-``
    for results that did not record it): ratios of different cards are not comparable, so
    each card keeps its own rows."""
    for unit in result.get("units") or []:
        compared = ((unit.get("checks") or {}).get("same_software") or {}).get("compared")
        devices = (compared or {}).get("device") or []
        if devices and devices[0]:
            return str(devices[0]).removeprefix("NVIDIA ")
    return "-"


def _target(result: Json, row: Json) -> str:
    """A summary row's target and verdict, judged against today's targets from the
    result's units (:func:`harness.serving.verdict`); a result without units keeps the
    verdict it was written with (before targets were stated: -)."""
    from harness.serving import units_of, verdict

    units = units_of(result.get("units") or [], row["mode"])
    judged = verdict(row["mode"], {"ratio": row.get("ratio"),
                                   "bound_share": row.get("bound_share", row.get("of_bound"))},
                     units) if units else row
    return "-" if not judged.get("target") else f"{judged['target']}: {judged['verdict']}"


def rows_table(kind: str) -> Callable[[Found, Path], str]:
    """The table of the latest result of a component benchmark: its ``figures["table"]``
    (flat rows; see :func:`table_lines`) under its source and ``figures["note"]``."""
    def render(found: Found, docs: Path) -> str:
        latest = _latest(found, kind)
        if not latest:
            return ""
        path, d = max(latest.values(), key=lambda item: str(item[1]["ran_at_utc"]))
        figures = d.get("figures") or {}
        if not figures.get("table"):
            return ""
        note = f"; {figures['note']}" if figures.get("note") else ""
        return "\n".join([_source(path, d, docs) + note, "",
                          *table_lines(figures["table"], markdown=True)])
    return render


def copies_table(found: Found, docs: Path) -> str:
    """The latest ``python -m harness copies`` result: per variant the small copy's
    latency (its thread's view and the device's) and the drain's rate, with the settings
    it suggests."""
    latest = _latest(found, "copies")
    if not latest:
        return ""
    path, d = max(latest.values(), key=lambda item: str(item[1]["ran_at_utc"]))
    figures = d.get("figures") or {}
    table = [{"drain copies": r["variant"], "small copy p50 µs": r["p50_us"],
              "p99 µs": r["p99_us"], "max µs": r["max_us"],
              "on device p50 µs": r["device_p50_us"], "on device p99 µs": r["device_p99_us"],
              "drain GB/s": r["bulk_gbps"],
              **({"matmul beside µs": r["compute_p50_us"]} if "compute_p50_us" in r else {})}
             for r in figures.get("rows") or []]
    if not table:
        return ""
    settings = d.get("settings") or {}
    note = (f"; {settings.get('bulk_mb')} MiB a round, {settings.get('probes')} small copies "
            f"a variant, one every {settings.get('period_ms')} ms")
    if "suggested_env" in figures:
        s = figures["suggested_env"]
        why = figures.get("no_suggestion")
        note += "; suggested: " + (("none" + (f" ({why})" if why else "")) if s is None
                                   else f"`{s}`" if s else "the defaults")
    return "\n".join([_source(path, d, docs) + note, "", *table_lines(table, markdown=True)])


def table_lines(rows: Sequence[Json], *, markdown: bool = False) -> list[str]:
    """Flat rows (short column names as keys) as text or markdown tables: one table per
    run of rows with the same columns, a blank line between tables."""
    groups: list[list[Json]] = []
    for row in rows:
        if groups and list(groups[-1][0]) == list(row):
            groups[-1].append(row)
        else:
            groups.append([row])
    lines: list[str] = []
    for group in groups:
        keys, cells = list(group[0]), [[_cell(r.get(k)) for k in group[0]] for r in group]
        lines += [""] if lines else []
        if markdown:
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(c) + " |" for c in cells]
            continue
        widths = [max(len(x) for x in col) for col in zip(keys, *cells, strict=True)]
        lines += ["  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True))
                  for c in [keys, *cells]]
    return lines


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "-" if value is None else str(value)


BLOCKS: dict[str, Callable[[Found, Path], str]] = {
    "qualified-cells": cells_table, "serving-bench": serving_table,
    "hooks-bench": rows_table("hooks"), "transport-bench": rows_table("transport"),
    "store-bench": rows_table("store"), "copies-bench": copies_table}
_BLOCK = re.compile(r"(<!-- BEGIN GENERATED: ([\w-]+)[^>]*-->\n)(.*?)(<!-- END GENERATED: \2 -->)",
                    re.S)


def regenerate(text: str, found: Found, docs: Path) -> str:
    """``text`` with every known block rewritten (blocks without results kept)."""
    def sub(m: re.Match[str]) -> str:
        render = BLOCKS.get(m.group(2))
        body = render(found, docs) if render else ""
        return m.group(0) if not body else f"{m.group(1)}{body}\n{m.group(4)}"
    return _BLOCK.sub(sub, text)


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite (or ``--check``) every doc under ``docs/``."""
    parser = argparse.ArgumentParser(prog="python -m harness docs",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when out of date")
    parser.add_argument("--docs", default=str(REPO / "docs"))
    args = parser.parse_args(argv)
    docs = Path(args.docs).resolve()
    found = evidence(docs / "evidence")
    stale = []
    for doc in sorted(docs.glob("*.md")):
        text = doc.read_text()
        new = regenerate(text, found, docs)
        if new != text:
            stale.append(doc.name)
            if not args.check:
                doc.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "docs are up to date")
    return 1 if args.check and stale else 0
