"""The monitoring RPCs of a started SGLang 0.5.19 ``Engine``: the EngineTap port.

SGLang's ``Engine.collective_rpc`` reports a failed RPC only through ``assert``, which
``python -O`` strips: a failed attach or stop would pass silently. :func:`rpc_call` sends
the same request over an RPC socket (a DEALER at ``PortArgs.rpc_ipc_name``) and checks the
scheduler's answer itself, raising :class:`~dmi_sglang.errors.CaptureError` when it says
no or does not answer in time. :class:`EngineRpcTap` uses the engine's socket; SGLang's
HTTP server has none, so the server side binds its own (``server.py``).
"""

from __future__ import annotations

from typing import Any

from dmi_sglang.errors import CaptureError

__all__ = ["EngineRpcTap", "SchedulerSilentError", "check_answer", "rpc_call"]


class SchedulerSilentError(CaptureError):
    """No scheduler took the request, or none answered, within the socket's timeouts."""


def rpc_call(socket: Any, method: str, **parameters: Any) -> None:
    """Call the ``Scheduler`` method ``method`` over ``socket`` and check its answer.

    The wait is bounded by the socket's ``SNDTIMEO`` (no scheduler connected) and
    ``RCVTIMEO`` (no answer); unbounded where they are unset.

    Raises:
        SchedulerSilentError: a timeout ran out.
        CaptureError: the scheduler said no (with its reason) or answered something else.
    """
    import zmq
    from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

    try:
        sock_send(socket, RpcReqInput(method=method, parameters=parameters))
    except zmq.Again:
        timeout_s = socket.getsockopt(zmq.SNDTIMEO) / 1000
        msg = f"{method}: no scheduler took the request within {timeout_s:g} s"
        raise SchedulerSilentError(msg) from None
    try:
        answer = sock_recv(socket, flags=0)
    except zmq.Again:
        timeout_s = socket.getsockopt(zmq.RCVTIMEO) / 1000
        msg = f"{method}: the scheduler did not answer within {timeout_s:g} s"
        raise SchedulerSilentError(msg) from None
    check_answer(method, answer)


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
