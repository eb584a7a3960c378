"""Helpers of the fault-injection tests: small records, stores, and a bounded wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind

RESID = "blocks.hook_resid_pre"
WITHIN_S = 20.0
"""Longest any failure here may take to surface: none may hang."""


def embedded(path: Path, **kw: Any) -> StoreConfig:
    """An embedded store with a short linger."""
    kw.setdefault("flush_timeout_us", 20_000)
    return StoreConfig(kind=StoreKind.EMBEDDED, path=str(path), **kw)


def record(request: str = "r", start: int = 0, end: int = 2, **kw: Any) -> CaptureRecord:
    """``end - start`` rows of 2 float32 zeros of resid_pre layer 0."""
    values: dict[str, Any] = {
        "model_id": "run", "request_id": request, "act_name": RESID, "layer_no": 0,
        "shard_rank": 0, "start_token_idx": start, "end_token_idx": end,
        "dtype": "torch.float32", "shape": (end - start, 2),
        "payload": bytes(8 * (end - start)), "seq": 1,
    }
    values.update(kw)
    return CaptureRecord(**values)


def run_info(run_id: str = "run") -> RunInfo:
    """A running run of resid_pre layer 0."""
    return RunInfo(run_id, "/m", (), ((RESID, 0),), "2026-12-01T10:00:00+00:00")


def commit(sink: ClickHouseSink, run: RunInfo, requests: dict[str, int]) -> None:
    """Finish ``run`` as committed with one manifest per request (prompt tokens given,
    one generated token)."""
    sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED),
                    [RequestManifest(run.run_id, r, n, 1, committed=True)
                     for r, n in requests.items()])


def store_with_run(path: Path, run_id: str = "run", request: str = "r") -> StoreConfig:
    """An embedded store at ``path`` holding one committed run ``run_id`` with one complete
    request (positions 0-1 of resid_pre layer 0)."""
    config = embedded(path)
    sink = ClickHouseSink(config)
    run = run_info(run_id)
    sink.start_run(run)
    sink.put(RecordBatch.from_records([record(request=request, start=0, end=2,
                                              model_id=run_id)]))
    commit(sink, run, {request: 2})
    sink.close()
    return config


def within(action: Callable[[], object], seconds: float = WITHIN_S) -> BaseException | None:
    """Run ``action`` on a thread; the exception it raised (None if it returned).

    Fails the test if it has not finished after ``seconds``: the failure hung.
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"still blocked after {seconds} s: it hangs"
    return outcome[0]


def ends(pid: int, seconds: float = 30.0) -> bool:
    """Process ``pid`` ends (:func:`ended`) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not ended(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def ended(pid: int) -> bool:
    """Process ``pid`` is gone (reaped, or a zombie no one reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
