"""Fixtures of the harness's CPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests start without a deadline and with a state directory of their own (never the
    machine's, whose saved results and engine records belong to real runs)."""
    monkeypatch.delenv("DMI_HARNESS_DEADLINE_S", raising=False)
    monkeypatch.setenv("DMI_HARNESS_STATE", str(tmp_path_factory.mktemp("state")))
    for name in ("FAKE_DIVERGE", "FAKE_DROP_ROWS", "FAKE_FAIL_START", "FAKE_RUN_FAULT",
                 "FAKE_SHUTDOWN_S"):
        monkeypatch.delenv(name, raising=False)
