"""What the GPU end-to-end modules share: the demo checkpoint in each module's ``workdir``
and the JSON summaries they write for the evidence."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

Evidence = Callable[[str, dict[str, Any]], None]


def pytest_configure(config: pytest.Config) -> None:
    """Refuse the original integration's GPU-smoke variables (``DMI_V0519_*``), naming
    what replaces each, rather than ignore them, when GPU tests are selected (``-m
    gpu``; the CPU suite, ``-m 'not gpu'``, does not read them and runs)."""
    from harness.__main__ import legacy_problem

    marks = str(config.getoption("markexpr", "") or "")
    problem = legacy_problem(dict(os.environ))
    if problem and "gpu" in marks and "not gpu" not in marks:
        raise pytest.UsageError(f"tests/gpu: {problem}")


@pytest.fixture(scope="module")
def checkpoint(workdir: Path) -> Path:
    """A 4-layer random-weight Qwen3 checkpoint (with its tokenizer) in ``workdir``."""
    from dmi_sglang.adapters.demo_model import write_demo_checkpoint

    return Path(write_demo_checkpoint(workdir / "qwen3-demo", layers=4))


@pytest.fixture(scope="module")
def evidence(workdir: Path) -> Evidence:
    """``evidence(name, data)`` writes ``name.json`` to ``$DMI_EVIDENCE_DIR`` (default:
    the module's ``workdir``)."""

    def write(name: str, data: dict[str, Any]) -> None:
        out = Path(os.environ.get("DMI_EVIDENCE_DIR", str(workdir)))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))

    return write
