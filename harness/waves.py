"""``python -m harness waves FILE...``: the timed waves of serving results, run by run.

A unit's ratio is its timed output tokens over its seconds, so one stalled wave counts in
full: in a 30 s run, a wave that took 0.35 s longer than the others costs 1 %. For every
unit of each serving result (``python -m harness serving --out FILE``) this prints, per
run (the monitored one and the stock runs around it): its waves, their median and mean
seconds, the slow ones (longer than ``--slow`` times the median: ``index:seconds``), and
the waves in which the engine's own process ran a full garbage collection (results made
since that was recorded); then the unit's ratio, and the ratio of the median waves (stock
over monitored), which one slow wave does not move.
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


def runs(unit: Json) -> list[tuple[str, list[float], list[int] | None]]:
    """The unit's timed runs of its main workload: ``(side, wave seconds, waves with a
    full collection or None where not recorded)``, the monitored run first."""
    figures = unit.get("figures") or {}
    waves = figures.get("wave_seconds") or {}
    collected = figures.get("gc_full_waves") or {}
    out: list[tuple[str, list[float], list[int] | None]] = []
    if waves.get("measured"):
        out.append(("monitored", list(waves["measured"]), collected.get("measured")))
    for side in ("stock_before", "stock_after"):
        gcs = collected.get(side) or []
        for i, seconds in enumerate(waves.get(side) or []):
            out.append((side.replace("_", " "), list(seconds),
                        gcs[i] if i < len(gcs) else None))
    return out


def unit_rows(name: str, unit: Json, slow: float = SLOW) -> list[Json]:
    """One row per run of ``unit`` (see the module docstring)."""
    rows: list[Json] = []
    medians: dict[str, list[float]] = {"monitored": [], "stock": []}
    for side, seconds, gcs in runs(unit):
        median = statistics.median(seconds)
        medians["monitored" if side == "monitored" else "stock"].append(median)
        rows.append({"result": name, "unit": unit.get("name"), "run": side,
                     "waves": len(seconds), "median s": round(median, 4),
                     "mean s": round(statistics.fmean(seconds), 4),
                     "slow waves": " ".join(f"{i}:{s:.3f}" for i, s in enumerate(seconds)
                                            if s >= slow * median) or "-",
                     "full gc waves": "n/a" if gcs is None else
                     (" ".join(map(str, gcs)) or "-")})
    ratio = ((unit.get("figures") or {}).get("throughput") or {}).get("ratio")
    if rows:
        by_median = (statistics.fmean(medians["stock"]) / medians["monitored"][0]
                     if medians["stock"] and medians["monitored"] else None)
        rows[0]["x stock"] = None if ratio is None else round(ratio, 3)
        rows[0]["x stock, median waves"] = None if by_median is None else round(by_median, 3)
        for row in rows[1:]:
            row["x stock"] = row["x stock, median waves"] = None
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; exit 1 when a file holds no unit with waves."""
    parser = argparse.ArgumentParser(prog="python -m harness waves",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="serving result JSON files")
    parser.add_argument("--slow", type=float, default=SLOW,
                        help=f"a wave this many times its run's median is slow ({SLOW})")
    args = parser.parse_args(argv)
    if not args.slow > 1:
        parser.error(f"--slow must be a number above 1, got {args.slow}")
    rows: list[Json] = []
    empty = []
    for path in map(Path, args.results):
        data = load_json(path)
        found = [row for unit in (data or {}).get("units") or []
                 for row in unit_rows(path.parent.name or path.name, unit, args.slow)]
        if not found:
            empty.append(str(path))
        rows += found
    for line in table_lines(rows):
        print(line)
    if empty:
        print(f"no unit with timed waves in: {', '.join(empty)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
