"""Helpers shared by the storage tests: configs, records and batches from tensors, fault
injection."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind

RESID = "blocks.hook_resid_pre"


def embedded(path: str, **kw: Any) -> StoreConfig:
    """An embedded store at ``path`` with a short linger (tests wait less)."""
    kw.setdefault("flush_timeout_us", 20_000)
    return StoreConfig(kind=StoreKind.EMBEDDED, path=path, **kw)


def raw(t: torch.Tensor) -> bytes:
    """The tensor's raw native-endian bytes."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def records_of(
    run_id: str,
    request_id: str,
    act_name: str,
    layer: int,
    tensor: torch.Tensor,
    bounds: Sequence[int],
    *,
    base: int = 0,
    seq: int = 1,
) -> list[CaptureRecord]:
    """Slice ``tensor`` (rows = positions ``base + i``) into records at ``bounds``.

    ``bounds`` are absolute positions ``[b0, b1, ..., bn]``: records ``[b0, b1)``, ...;
    record k gets ``seq + k``.
    """
    out = []
    for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        part = tensor[lo - base : hi - base]
        out.append(
            CaptureRecord(
                model_id=run_id,
                request_id=request_id,
                act_name=act_name,
                layer_no=layer,
                shard_rank=0,
                start_token_idx=lo,
                end_token_idx=hi,
                dtype=str(tensor.dtype),
                shape=tuple(part.shape),
                payload=raw(part),
                seq=seq + k,
            )
        )
    return out


def batch_of(
    run_id: str,
    request_id: str,
    act_name: str,
    layer: int,
    tensor: torch.Tensor,
    bounds: Sequence[int],
    *,
    base: int = 0,
    seq: int = 1,
) -> RecordBatch:
    """:func:`records_of` as one record batch."""
    return RecordBatch.from_records(
        records_of(run_id, request_id, act_name, layer, tensor, bounds, base=base, seq=seq))


def run_info(run_id: str, captures: Sequence[tuple[str, int]], **kw: Any) -> RunInfo:
    """A running run with the given captures."""
    kw.setdefault("started_at", "2026-11-29T10:00:00Z")
    return RunInfo(run_id, "/models/tiny", (("DMX_HOOK_SELECTION", "x"),), tuple(captures), **kw)


def commit(sink: ClickHouseSink, run: RunInfo, manifests: Sequence[RequestManifest]) -> RunInfo:
    """Finish ``run`` as committed."""
    done = attrs.evolve(run, status=RunStatus.COMMITTED, stopped_at="2026-11-29T10:05:00Z")
    sink.finish_run(done, manifests)
    return done


def manifest(
    run_id: str, request_id: str, prompt: int, completion: int, **kw: Any
) -> RequestManifest:
    """A committed manifest."""
    kw.setdefault("committed", True)
    return RequestManifest(run_id, request_id, prompt, completion, **kw)


def handle(config: StoreConfig, run_id: str, request_id: str) -> CaptureHandle:
    """A lazy handle reading through a fresh reader each time."""
    return CaptureHandle(run_id, request_id, lambda: ClickHouseReader(config))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


class FaultyInserter:
    """Wraps a real writer connection; ``insert_arrow`` obeys ``plan(call_number)``: None
    passes through, an exception is raised, a float sleeps that long first."""

    def __init__(self, inner: Any, plan: Any) -> None:
        self._inner = inner
        self._plan = plan
        self.calls = 0
        self._lock = threading.Lock()

    def insert_arrow(self, table: str, arrow_table: Any, token: str = "") -> Any:
        with self._lock:
            self.calls += 1
            n = self.calls
        action = self._plan(n)
        if isinstance(action, BaseException):
            raise action
        if isinstance(action, float):
            time.sleep(action)
        return self._inner.insert_arrow(table, arrow_table, token=token)

    def close(self) -> None:
        self._inner.close()
