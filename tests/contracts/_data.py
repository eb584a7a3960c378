"""A small run with known bytes, shared by the contract suites."""

from __future__ import annotations

import struct
import zlib

import attrs
import numpy as np

from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus

RUN = "contract-run"
RESID = "blocks.hook_resid_pre"
LOGITS = "final_logits"
WIDTH = 3
CAPTURES = ((RESID, 0), (RESID, 1), (LOGITS, -1))


def row_bytes(act: str, layer: int, request: str, pos: int, seq: int) -> bytes:
    """One fp32 row whose values name where it came from."""
    base = zlib.crc32(f"{act}|{layer}|{request}|{pos}|{seq}".encode()) % 1000
    return struct.pack(f"<{WIDTH}f", *(float(base + i) for i in range(WIDTH)))


def record(act: str, layer: int, request: str, start: int, end: int, seq: int = 1,
           run: str = RUN) -> CaptureRecord:
    """Rows ``[start, end)`` of one (hook, layer) of one request."""
    payload = b"".join(row_bytes(act, layer, request, p, seq) for p in range(start, end))
    return CaptureRecord(
        model_id=run, request_id=request, act_name=act, layer_no=layer, shard_rank=0,
        start_token_idx=start, end_token_idx=end, dtype="torch.float32",
        shape=(end - start, WIDTH), payload=payload, seq=seq,
    )


def run_info(run: str = RUN, started_at: str = "2026-12-01T10:00:00+00:00") -> RunInfo:
    """A running run of :data:`CAPTURES`."""
    return RunInfo(run, "/models/toy", (("DMX_HOOK_SELECTION", "x"),), CAPTURES, started_at)


def committed(run: RunInfo) -> RunInfo:
    """``run`` stopped and committed."""
    return attrs.evolve(run, status=RunStatus.COMMITTED,
                        stopped_at="2026-12-01T10:05:00+00:00")


def request_records(request: str, prompt: int, completion: int) -> list[CaptureRecord]:
    """Every record of a complete request: token rows then one logits row per token."""
    positions = prompt + completion - 1
    out = [record(RESID, layer, request, 0, prompt) for layer in (0, 1)]
    out += [record(RESID, layer, request, prompt, positions, seq=2) for layer in (0, 1)]
    out.append(record(LOGITS, -1, request, prompt - 1, positions))
    return out


def batch(records: list[CaptureRecord]) -> RecordBatch:
    """``records`` as one record batch."""
    return RecordBatch.from_records(records)


def empty_batch(run: str = RUN) -> RecordBatch:
    """A record batch without records."""
    return RecordBatch(run, (), (), [], [], [], [], [], [0], np.empty(0, dtype=np.uint8))


def manifest(request: str, prompt: int, completion: int, run: str = RUN) -> RequestManifest:
    """A committed manifest."""
    return RequestManifest(run, request, prompt, completion, committed=True)
