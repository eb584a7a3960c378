"""Fixtures of the harness's CPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without a deadline and without a state directory from outside."""
    monkeypatch.delenv("DMI_HARNESS_DEADLINE_S", raising=False)
    monkeypatch.delenv("DMI_HARNESS_STATE", raising=False)
    for name in ("FAKE_DIVERGE", "FAKE_DROP_ROWS", "FAKE_FAIL_START"):
        monkeypatch.delenv(name, raising=False)
