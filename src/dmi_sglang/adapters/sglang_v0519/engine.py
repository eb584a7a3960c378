"""The monitoring RPCs of a started SGLang 0.5.19 ``Engine``: the EngineTap port.

SGLang's ``Engine.collective_rpc`` reports a failed RPC only through ``assert``, which
``python -O`` strips: a failed attach or stop would pass silently. :class:`EngineRpcTap`
sends the same request over the engine's RPC socket and checks the scheduler's answer
itself, raising :class:`~dmi_sglang.errors.CaptureError` when it says no.
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

    def _call(self, method: str, **parameters: Any) -> None:
        import zmq
        from sglang.srt.managers.io_struct import (
            RpcReqInput,
            RpcReqOutput,
            sock_recv,
            sock_send,
        )

        socket = self._engine.send_to_rpc
        sock_send(socket, RpcReqInput(method=method, parameters=parameters))
        answer = sock_recv(socket, flags=zmq.BLOCKY)
        if not isinstance(answer, RpcReqOutput):
            msg = f"{method}: the scheduler answered {type(answer).__name__}, not RpcReqOutput"
            raise CaptureError(msg)
        if not answer.success:
            raise CaptureError(f"{method} failed in the scheduler: {answer.message}")
