"""The monitoring RPCs of a started SGLang 0.5.19 ``Engine``: the EngineTap port.

SGLang's ``Engine.collective_rpc`` reports a failed RPC only through ``assert``, which
``python -O`` strips: a failed attach or stop would pass silently. :func:`rpc_call` sends
the same request over the engine's RPC socket (a DEALER at ``PortArgs.rpc_ipc_name``) and
checks the scheduler's answer itself (:func:`check_answer`), raising
:class:`~dmi_sglang.errors.CaptureError` when it says no. SGLang's HTTP server has no such
socket, so the server side binds its own and bounds its waits (``server.py``).
"""

from __future__ import annotations

from typing import Any

from dmi_sglang.errors import CaptureError

__all__ = ["EngineRpcTap", "SchedulerSilentError", "check_answer", "rpc_call"]


class SchedulerSilentError(CaptureError):
    """No scheduler took the request, or none answered, within the socket's timeouts."""


def rpc_call(socket: Any, method: str, **parameters: Any) -> None:
    """Call the ``Scheduler`` method ``method`` over ``socket`` and check its answer.

    Raises:
        CaptureError: the scheduler said no (with its reason) or answered something else.
    """
    from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

    sock_send(socket, RpcReqInput(method=method, parameters=parameters))
    check_answer(method, sock_recv(socket, flags=0))


def check_answer(method: str, answer: Any) -> None:
    """Raise unless ``answer`` is the scheduler's ``RpcReqOutput`` saying ``method`` worked.

    Raises:
        CaptureError: the scheduler said no (with its reason) or answered something else.
    """
    from sglang.srt.managers.io_struct import RpcReqOutput

    if not isinstance(answer, RpcReqOutput):
        msg = f"{method}: the scheduler answered {type(answer).__name__}, not RpcReqOutput"
        raise CaptureError(msg)
    if not answer.success:
        raise CaptureError(f"{method} failed in the scheduler: {answer.message}")


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
        rpc_call(self._engine.send_to_rpc, "dmi_assert_active", run_id=run_id)

    def stop_monitoring(self) -> None:
        """The authoritative flush in every scheduler (terminal).

        Raises:
            CaptureError: with the scheduler's reason.
        """
        rpc_call(self._engine.send_to_rpc, "dmi_stop_monitoring")
