"""The monitoring RPCs of a started SGLang 0.5.19 ``Engine``: the EngineTap port.

``Engine.collective_rpc`` returns None and reports a failed RPC only as an
``AssertionError`` raised on rank 0; :class:`EngineRpcTap` turns that into a
:class:`~dmi_sglang.errors.CaptureError`.
"""

from __future__ import annotations

from typing import Any

from dmi_sglang.errors import CaptureError

__all__ = ["EngineRpcTap"]


class EngineRpcTap:
    """The :class:`~dmi_sglang.domain.ports.EngineTap` of one SGLang 0.5.19 engine.

    Args:
        engine: a started ``sglang.Engine`` whose schedulers loaded the plugin.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def assert_active(self, run_id: str) -> None:
        """Raise unless every scheduler monitors ``run_id`` and has not stopped.

        Raises:
            CaptureError: with the scheduler's reason.
        """
        self._call("dmi_assert_active", run_id=run_id)

    def stop_monitoring(self) -> None:
        """The authoritative flush in every scheduler (terminal).

        Raises:
            CaptureError: with the scheduler's reason.
        """
        self._call("dmi_stop_monitoring")

    def _call(self, name: str, **kwargs: Any) -> None:
        try:
            self._engine.collective_rpc(name, **kwargs)
        except AssertionError as exc:
            raise CaptureError(str(exc)) from exc
