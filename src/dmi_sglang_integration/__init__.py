"""Alias package for users of the original DMI SGLang integration's examples.

``from dmi_sglang_integration import DMIEngine`` is ``dmi_sglang.DMIEngine``, imported
lazily so importing this package imports neither SGLang nor torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DMIEngine"]


def __getattr__(name: str) -> Any:
    if name == "DMIEngine":
        from dmi_sglang.app.engine import DMIEngine

        return DMIEngine
    msg = f"module 'dmi_sglang_integration' has no attribute {name!r}"
    raise AttributeError(msg)
