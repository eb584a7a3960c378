"""dmi-sglang: capture the internals of models served by SGLang 0.5.19.

Importing this package is free: it imports neither SGLang, torch nor ClickHouse.
``DMIEngine`` (capture) and ``open_store`` (read captures back, see
:mod:`dmi_sglang.app.reading`) are re-exported lazily (module ``__getattr__``) from
:mod:`dmi_sglang.app`, so that SGLang's plugin loader can import the package without
pulling in SGLang's Engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CaptureStore", "DMIEngine", "__version__", "open_store"]

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from dmi_sglang.app.engine import DMIEngine
    from dmi_sglang.app.reading import CaptureStore, open_store


def __getattr__(name: str) -> Any:
    if name in ("CaptureStore", "DMIEngine", "open_store"):
        from dmi_sglang import app

        return getattr(app, name)
    msg = f"module 'dmi_sglang' has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
