"""``python -m harness waves FILE...``: the timed waves of serving results, run by run.

A unit's ratio is its timed output tokens over its seconds, so one stalled wave counts in
full: in a 30 s run, a wave that took 0.35 s longer than the others costs 1 %. For every
unit of each serving result (``python -m harness serving --out FILE``) this prints, per
run (the monitored one and the stock runs around it): its waves, their median and mean
(milliseconds), the slow ones (``--slow`` times the median or more: ``index:seconds``),
and the full garbage collections of the engine's own process (its tokenizer side:
``index:seconds`` of each wave with one, in results made since that was recorded); on
the monitored run, the full collections its scheduler process counted over the whole
run (warm-up included), the unit's ratio, and the ratio of the median waves (stock over
monitored), which one slow wave does not move.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.docs import table_lines
from harness.results import Json, load_json

SLOW = 1.4
"""A wave this many times its run's median, or more, is slow."""


Collections = list[list[float]] | None
"""``[wave, seconds]`` per wave with a full collection; None where not recorded."""


def runs(unit: Json) -> list[tuple[str, list[float], Collections]]:
    """The unit's timed runs of its main workload that have waves: ``(side, wave
    seconds, full collections)``, the monitored run first."""
    figures = unit.get("figures") or {}
    waves = figures.get("wave_seconds") or {}
    collected = figures.get("gc_full_waves") or {}
    out: list[tuple[str, list[float], Collections]] = [
        ("monitored", list(waves.get("measured") or []), collected.get("measured"))]
    for side in ("stock_before", "stock_after"):
        gcs = collected.get(side) or []
        for i, seconds in enumerate(waves.get(side) or []):
            out.append((side.replace("_", " "), list(seconds),
                        gcs[i] if i < len(gcs) else None))
    return [run for run in out if run[1]]


def unit_rows(name: str, unit: Json, slow: float = SLOW) -> list[Json]:
    """One row per run of ``unit`` (see the module docstring)."""
    figures = unit.get("figures") or {}
    rows: list[Json] = []
    medians: dict[str, list[float]] = {"monitored": [], "stock": []}
    for side, seconds, gcs in runs(unit):
        median = statistics.median(seconds)
        medians["monitored" if side == "monitored" else "stock"].append(median)
        rows.append({"result": name, "unit": unit.get("name"), "run": side,
                     "waves": len(seconds), "median ms": 1000 * median,
                     "mean ms": 1000 * statistics.fmean(seconds),
                     "slow waves": " ".join(f"{i}:{s:.3f}" for i, s in enumerate(seconds)
                                            if s >= slow * median) or "-",
                     "full gc (own)": "n/a" if gcs is None else
                     (" ".join(f"{int(i)}:{s:.3f}" for i, s in gcs) or "-"),
                     "full gc (scheduler)": None, "x stock": None,
                     "x stock, median waves": None})
    if not medians["monitored"]:  # runs() puts the monitored run first, when it has waves
        return rows
    row = rows[0]
    timing = figures.get("timing") or {}
    if timing.get("gc_full_collections") is not None:
        row["full gc (scheduler)"] = (f"{int(timing['gc_full_collections'])} "
                                      f"({timing.get('gc_full_seconds', 0.0):.3f} s)")
    ratio = (figures.get("throughput") or {}).get("ratio")
    row["x stock"] = None if ratio is None else round(ratio, 3)
    if medians["stock"]:
        row["x stock, median waves"] = round(
            statistics.fmean(medians["stock"]) / medians["monitored"][0], 3)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; exit 1 when a file is no JSON object or holds no unit with
    waves (each named on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m harness waves",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="serving result JSON files")
    parser.add_argument("--slow", type=float, default=SLOW,
                        help=f"a wave this many times its run's median is slow ({SLOW})")
    args = parser.parse_args(argv)
    if not args.slow > 1:
        parser.error(f"--slow must be a number above 1, got {args.slow}")
    rows: list[Json] = []
    problems = []
    for path in map(Path, args.results):
        data = load_json(path)
        if data is None:
            problems.append(f"{path}: not a readable JSON object")
            continue
        name = f"{path.parent.name}/{path.name}" if path.parent.name else path.name
        found = [row for unit in data.get("units") or []
                 for row in unit_rows(name, unit, args.slow)]
        if not found:
            problems.append(f"{path}: no unit with timed waves")
        rows += found
    for line in table_lines(rows):
        print(line)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
