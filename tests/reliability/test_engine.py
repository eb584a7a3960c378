"""Engine RPC failures that must stay loud.

Each test's docstring is one row of docs/reliability.md.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang

_UNDER_O = """
import threading
import zmq
from types import SimpleNamespace
from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send
from dmi_sglang.adapters.sglang_v0519.engine import EngineRpcTap
from dmi_sglang.errors import CaptureError
assert not __debug__, "run me with python -O"
ctx = zmq.Context.instance()
engine_side, scheduler_side = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
engine_side.bind("inproc://o"); scheduler_side.connect("inproc://o")
def scheduler():
    sock_recv(scheduler_side)
    sock_send(scheduler_side, RpcReqOutput(success=False, message="flush failed: disk full"))
threading.Thread(target=scheduler).start()
try:
    EngineRpcTap(SimpleNamespace(send_to_rpc=engine_side)).stop_monitoring()
    print("STOP PASSED SILENTLY")
except CaptureError as exc:
    print("LOUD:", exc)
"""


def test_fault_a_failed_stop_under_python_dash_o() -> None:
    """The scheduler answers dmi_stop_monitoring with a failure while Python runs with
    -O (which strips SGLang's assert) -> DMIEngine's tap still raises CaptureError."""
    proc = subprocess.run([sys.executable, "-O", "-c", _UNDER_O], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "LOUD: dmi_stop_monitoring failed in the scheduler: flush failed: disk full" in (
        proc.stdout), proc.stdout + proc.stderr
