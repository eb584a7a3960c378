"""docs/reliability.md's table is generated from tests/reliability and must be current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_faults_table_is_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/make_reliability_doc.py", "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_fault_test_says_its_case_and_outcome(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_reliability_doc",
                                                  ROOT / "scripts" / "make_reliability_doc.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.rows()
    assert len(rows) >= 20
    assert all(case and outcome for _, _, case, outcome, _, _ in rows)
    module.TESTS = tmp_path
    (tmp_path / "test_x.py").write_text('def test_fault_y():\n    """No arrow here."""\n')
    with pytest.raises(SystemExit, match="needs 'case -> outcome'"):
        module.rows()
