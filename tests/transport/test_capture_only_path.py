"""Capture without storage runs the same drain and batch path as storage, up to the sink
call: the batches a NullSink gets equal, column for column and byte for byte, those a real
embedded ClickHouse sink gets for the same steps (so capture-only figures skip no work)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.app.null_sink import NullSink
from dmi_sglang.columns import RecordBatch, RecordSink
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.records import RequestManifest, RunInfo
from dmi_sglang.domain.store_config import StoreConfig, StoreKind


class _Spy:
    """A sink that fingerprints every batch, then hands it on."""

    def __init__(self, inner: RecordSink) -> None:
        self.inner = inner
        self.seen: list[tuple[object, ...]] = []

    def start_run(self, run: RunInfo) -> None:
        self.inner.start_run(run)

    def put(self, batch: RecordBatch) -> None:
        payload = batch.payload[batch.offsets[0] : batch.offsets[-1]]
        self.seen.append((
            batch.run_id, batch.request_ids, batch.captures, len(batch), batch.nbytes,
            *(getattr(batch, c).tobytes() for c in ("request", "capture", "start", "end",
                                                    "seq")),
            (batch.offsets - batch.offsets[0]).tobytes(),
            hashlib.sha256(payload.tobytes()).hexdigest(),
        ))
        self.inner.put(batch)

    def flush(self) -> None:
        self.inner.flush()

    def finish_run(self, run: RunInfo, manifests: Sequence[RequestManifest]) -> None:
        self.inner.finish_run(run, manifests)

    def close(self) -> None:
        self.inner.close()


def _drive(make_driver, sink: _Spy) -> None:
    d, _ = make_driver("resid_pre,token_ids,final_logits", sink=sink, flush_timeout_s=30.0,
                       coalesce_max_bytes=2048)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [5, 3]))
    for n in range(9):
        d.forward(BatchLayout.decode(["a", "b"], [6 + n, 4 + n]))
    d.t.finish_request("b", 12)
    d.forward(BatchLayout.extend(["c"], [0], [4]))
    for n in range(3):
        d.forward(BatchLayout.decode(["a", "c"], [15 + n, 5 + n]))
    d.t.stop()


def test_capture_only_and_stored_runs_hand_the_sink_identical_batches(make_driver, tmp_path):
    null = _Spy(NullSink())
    _drive(make_driver, null)
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=str(tmp_path / "store"))
    stored = _Spy(ClickHouseSink(config))
    try:
        stored.start_run(RunInfo("run-1", "toy", (), (), "2026-12-01T10:00:00Z"))
        _drive(make_driver, stored)
    finally:
        stored.close()
    assert len(null.seen) > 3  # prefills, windows and held rows: several batches
    assert null.seen == stored.seen
    assert isinstance(null.inner, NullSink)
    total = sum(entry[4] for entry in null.seen)  # type: ignore[misc]
    assert null.inner.bytes_put == total > 0
