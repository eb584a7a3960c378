"""scripts/make_docs_tables.py: tables from sample evidence, markers, --check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

DOC = """# Title

Hand-written text stays.

<!-- BEGIN GENERATED: qualified-cells (scripts/make_docs_tables.py) -->
old table
<!-- END GENERATED: qualified-cells -->

More hand-written text.
"""
BENCH_DOC = """# Benchmarks
<!-- BEGIN GENERATED: serving-bench (scripts/make_docs_tables.py) -->
<!-- END GENERATED: serving-bench -->
text
<!-- BEGIN GENERATED: transport-bench (scripts/make_docs_tables.py) -->
<!-- END GENERATED: transport-bench -->
"""


def _cell(name: str, status: str, ran: str, ratio: float | None = 0.97) -> dict[str, Any]:
    return {
        "cell": name, "cell_hash": "h", "status": status, "ran_at_utc": ran,
        "commit": "0123456789abcdef", "error": None if status == "passed" else "boom",
        "settings": {"cell": {"model": "0.6b", "graphs": True, "preset": "hidden-states",
                              "overlap": True, "persistence": "chdb"}},
        "checks": {"token_identity": {"ok": True, "compared": 91},
                   "rows_complete": {"ok": status == "passed", "requests": 91}},
        "figures": {"headline_monitored_tok_s": 18500.0, "headline_stock_tok_s": 19000.0,
                    "headline_ratio": ratio, "headline_workload": "bs64",
                    "stored_bytes": 2.0e9},
    }


def _mode(written: str, **figures: Any) -> dict[str, Any]:
    return {"ok": True, "ran_at_utc": written, "commit": "0123456789",
            "code_fingerprint": "feedc0de1234", "figures": figures}


def _bench(written: str) -> dict[str, Any]:
    return {
        "bench": "serving", "config_hash": "c1", "written_at_utc": written,
        "config": {"model": "0.6b", "batch": 64, "prompt_len": 256, "output_len": 128,
                   "min_seconds": 30.0},
        "modes": {
            "stock": _mode(written, tok_s=19000.0, waves=40),
            "store[hidden-states]": _mode(
                written, tok_s=18200.0, waves=38, capture_bytes_timed=5.4e10,
                capture_bps=1.8e9, d2h_fraction=0.033, store_insert_MBps=340.0,
                store_e2e_MBps=310.0),
        },
        "pending_modes": ["stock-eager"],
    }


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    (d / "evidence" / "day1" / "cells").mkdir(parents=True)
    (d / "evidence" / "day2" / "cells").mkdir(parents=True)
    (d / "v0519-port.md").write_text(DOC)
    (d / "benchmarks.md").write_text(BENCH_DOC)
    return d


def _write(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data))


def test_tables_from_evidence(docs_tables: Any, docs: Path) -> None:
    ev = docs / "evidence"
    _write(ev / "day1" / "cells" / "0.6b-graph-hidden.json",
           _cell("0.6b-graph-hidden", "failed", "2026-11-30T10:00:00+00:00"))
    _write(ev / "day2" / "cells" / "0.6b-graph-hidden.json",
           _cell("0.6b-graph-hidden", "passed", "2026-12-01T10:00:00+00:00"))
    _write(ev / "day2" / "cells" / "0.6b-graph-full.json",
           _cell("0.6b-graph-full", "passed", "2026-12-01T09:00:00+00:00"))
    _write(ev / "day1" / "cells" / "0.6b-graph-full.json",  # a later skip never wins
           _cell("0.6b-graph-full", "skipped", "2026-12-02T09:00:00+00:00", None))
    _write(ev / "day2" / "bench.json", _bench("2026-12-01T11:00:00+00:00"))
    older = _bench("2026-11-30T11:00:00+00:00")  # its stock loses; its eager mode is kept
    older["modes"]["stock"]["figures"]["tok_s"] = 1.0
    older["modes"]["stock-eager"] = _mode("2026-11-30T11:00:00+00:00", tok_s=2375.0, waves=9)
    _write(ev / "day1" / "bench.json", older)
    shutil.copy(ROOT / "docs" / "evidence" / "2026-11-29-h200" / "bench_transport.json",
                ev / "day1" / "bench_transport.json")
    (ev / "day1" / "broken.json").write_text("{not json")

    assert docs_tables.main(["--docs", str(docs), "--check"]) == 1
    assert docs_tables.main(["--docs", str(docs)]) == 0
    assert docs_tables.main(["--docs", str(docs), "--check"]) == 0  # idempotent

    port = (docs / "v0519-port.md").read_text()
    assert port.startswith("# Title\n\nHand-written text stays.")
    assert "More hand-written text." in port
    assert "old table" not in port
    line = next(x for x in port.splitlines() if x.startswith("| 0.6b-graph-hidden |"))
    assert "| passed |" in line
    assert "18,500 / 19,000 = 0.970x (bs64)" in line
    assert "yes (91 req.)" in line
    assert "2026-12-01T10:00:00+00:00" in line
    assert "[json](evidence/day2/cells/0.6b-graph-hidden.json)" in line
    assert "2.00 GB" in line
    full = next(x for x in port.splitlines() if x.startswith("| 0.6b-graph-full |"))
    assert "| passed |" in full
    # catalogue cells without results are listed as not run
    assert "| 8b-graph-hidden | 8b | graphs | hidden-states | on | chdb | not run |" in port

    bench = (docs / "benchmarks.md").read_text()
    assert "| store[hidden-states] | 18,200 | 0.958 | 38 | 54.00 | 1.80 | 3.3 | 340 | 310 " \
        "| 01234567 (code feedc0de) | 2026-12-01T11:00:00+00:00 |" in bench
    assert "| stock-eager | 2,375 | 0.125 | 9 |" in bench  # merged from the older file
    assert "target: hidden-states with persistence >= 0.95x stock (batch 64, graphs): " \
        "**PASS** (0.958x)" in bench
    assert "not measured yet" not in bench  # the older file measured stock-eager
    assert "[json](evidence/day1/bench.json), [json](evidence/day2/bench.json)" in bench
    assert "| hidden-states | 64 | 28 | 122 | 450 | 795 | yes | 286 |" in bench


def test_no_results_and_missing_markers(docs_tables: Any, docs: Path) -> None:
    assert docs_tables.main(["--docs", str(docs)]) == 0
    port = (docs / "v0519-port.md").read_text()
    assert "_No qualification results under docs/evidence/ yet." in port
    assert "| 0.6b-eager-hidden | 0.6b | eager | hidden-states | on | chdb | not run |" in port
    assert "_No serving-benchmark results" in (docs / "benchmarks.md").read_text()
    (docs / "benchmarks.md").write_text("# no markers\n")
    assert docs_tables.main(["--docs", str(docs)]) == 2


def test_repository_docs_are_up_to_date(docs_tables: Any) -> None:
    """The committed tables match docs/evidence (regenerate with the script if not)."""
    assert docs_tables.main(["--check"]) == 0, \
        "docs tables are stale: run python scripts/make_docs_tables.py"
