"""The application layer: entry points, version-neutral services, the composition root.

``DMIEngine``, :func:`~dmi_sglang.app.reading.open_store` and
:class:`~dmi_sglang.app.reading.CaptureStore` are re-exported lazily (module
``__getattr__``), so importing this package (as SGLang's plugin loader does through
``dmi_sglang.app.plugin``) never imports SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CaptureStore", "DMIEngine", "open_store"]

if TYPE_CHECKING:  # pragma: no cover
    from dmi_sglang.app.engine import DMIEngine
    from dmi_sglang.app.reading import CaptureStore, open_store


def __getattr__(name: str) -> Any:
    if name == "DMIEngine":
        from dmi_sglang.app.engine import DMIEngine

        return DMIEngine
    if name in ("CaptureStore", "open_store"):
        from dmi_sglang.app import reading

        return getattr(reading, name)
    msg = f"module 'dmi_sglang.app' has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
