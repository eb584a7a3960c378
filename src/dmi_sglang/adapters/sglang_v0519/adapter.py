"""The SGLang 0.5.19 adapter as the composition root sees it: :data:`ADAPTER`.

Importing this module is free (no SGLang, no torch): every method imports what it needs.
"""

from __future__ import annotations

from typing import Any

from dmi_sglang.adapters.sglang_v0519.version import SGLANG_VERSION
from dmi_sglang.domain.ports import EngineTap
from dmi_sglang.tensor_ports import CaptureFactory

__all__ = ["ADAPTER", "SGLangV0519"]


class SGLangV0519:
    """The :class:`~dmi_sglang.tensor_ports.SGLangAdapter` for SGLang 0.5.19."""

    sglang_version = SGLANG_VERSION

    def register(self, factory: CaptureFactory) -> None:
        """Install the hooks in this SGLang process (see :mod:`.plugin`). Never raises."""
        from dmi_sglang.adapters.sglang_v0519.plugin import register

        register(factory)

    def engine_base(self) -> type[Any]:
        """``sglang.srt.entrypoints.engine.Engine``."""
        from sglang.srt.entrypoints.engine import Engine

        return Engine  # type: ignore[no-any-return]

    def engine_tap(self, engine: Any) -> EngineTap:
        """The monitoring RPCs of ``engine``."""
        from dmi_sglang.adapters.sglang_v0519.engine import EngineRpcTap

        return EngineRpcTap(engine)


ADAPTER = SGLangV0519()
"""The adapter instance the composition root registers."""
