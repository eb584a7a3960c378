"""The drain's CPU for the held request rows of one decode-window flush.

A flush confirms the newest request row each request held at the flush before (the rows
become a batch for the sink), then holds this flush's newest rows. 64 requests, two
request-row captures of 256 bytes a row (``final_logits:topk(64)``'s ids and values), best
of 5 x 200 flushes on one thread:

    PYTHONPATH=src python docs/evidence/2026-12-07-cpu-held-blocks/commands/held_flush.py

"per record" holds one ``CaptureRecord`` a request and capture, as the window did before
``HeldBlock``; "block" holds one ``HeldBlock`` a capture group (skipped on a tree
without it, so the same script measures the commit before).
"""

from __future__ import annotations

import time

import numpy as np

from dmi_sglang.adapters.transport import _records
from dmi_sglang.adapters.transport._pool import PayloadPool
from dmi_sglang.columns import CaptureKey, RecordBatch
from dmi_sglang.domain.records import CaptureRecord

N, ROW = 64, 256
KEYS = (CaptureKey("logits_topk_ids", -1, "int32", (64,)),
        CaptureKey("logits_topk_values", -1, "float32", (64,)))
RIDS = [f"r{i}" for i in range(N)]
POOL = PayloadPool(slab_bytes=1 << 20)


def _release(held: _records.HeldRows, out: _records.Emitted) -> None:
    for rid in RIDS:  # the next flush confirms every request's held rows
        held.confirm(rid, out, before=10)
    held.detach_pinned()


def per_record(held: _records.HeldRows) -> list[RecordBatch]:
    out = _records.Emitted()
    _release(held, out)
    chunk = POOL.alloc(N * len(KEYS) * ROW)
    for g, key in enumerate(KEYS):
        own = chunk.view[chunk.offset + g * N * ROW : chunk.offset + (g + 1) * N * ROW]
        for i, rid in enumerate(RIDS):
            held.hold(CaptureRecord("run", rid, key.act_name, key.layer_no, 0, 5, 6,
                                    key.dtype, (1, 64), own[i * ROW : (i + 1) * ROW], 9),
                      pinned=True, copied=False)
    return out.batches_out()


def block(held: _records.HeldRows) -> list[RecordBatch]:
    out = _records.Emitted()
    _release(held, out)
    chunk = POOL.alloc(N * len(KEYS) * ROW)
    for g, key in enumerate(KEYS):
        held.hold_block(_records.HeldBlock(  # type: ignore[attr-defined,unused-ignore]
            "run", (key,), row_nbytes=ROW, request_ids=RIDS,
            positions=np.full(N, 5, dtype=np.int64), seqs=np.full(N, 9, dtype=np.int64),
            memory=chunk.array[g * N * ROW : (g + 1) * N * ROW]))
    return out.batches_out()


def main() -> None:
    ways = [("per record", per_record)]
    if hasattr(_records, "HeldBlock"):
        ways.append(("block", block))
    for name, flush in ways:
        held = _records.HeldRows()
        flush(held)  # the rows the first timed flush releases
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                batches = flush(held)
            best = min(best, (time.perf_counter() - t0) / 200)
        rows = sum(len(b) for b in batches)
        print(f"{name}: {best * 1e6:,.0f} us a flush ({N} requests x {len(KEYS)} captures: "
              f"{rows} records released in {len(batches)} batches)")


if __name__ == "__main__":
    main()
