"""The upstream basis pin: a different SGLang (files, classes, signatures) fails loudly."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang


def test_installed_sglang_matches_the_pinned_basis() -> None:
    from dmi_sglang.adapters.sglang_v0519.pins import verify_upstream_basis

    assert verify_upstream_basis() == []


def test_differences_are_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.adapters.sglang_v0519 import pins

    monkeypatch.setattr(pins, "PINNED_VERSION", "0.5.18")
    monkeypatch.setattr(pins, "PINNED_FILES", {"srt/models/qwen3.py": "0" * 64,
                                               "srt/models/gone.py": "0" * 64})
    monkeypatch.setattr(pins, "PINNED_SIGNATURES", {
        "sglang.srt.server_args:ServerArgs.check_server_args": ("self", "strict"),
        "sglang.srt.server_args:ServerArgs.no_such_method": None,
        "sglang.no_such_module:Thing": None,
    })
    monkeypatch.setattr(pins, "PINNED_FIELDS", {
        "sglang.srt.model_executor.forward_batch_info:ForwardBatch": ("rids", "gone_field"),
    })
    problems = pins.verify_upstream_basis()
    assert len(problems) == 7, problems
    text = "\n".join(problems)
    for needle in ("sglang 0.5.19 is installed; the pinned basis is 0.5.18",
                   "sglang/srt/models/qwen3.py: sha256", "sglang/srt/models/gone.py: cannot",
                   "check_server_args: parameters ('self',) differ",
                   "no_such_method: cannot be resolved", "sglang.no_such_module:Thing",
                   "fields ['gone_field'] are gone"):
        assert needle in text
