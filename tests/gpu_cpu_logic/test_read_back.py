"""The harness's read-back functions against a real embedded store (no GPU): what the
qualification cells and the serving benchmark check is read through the public API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind

RUN = "harness-run"
RESID = "blocks.hook_resid_pre"


def _rec(request: str, start: int, end: int) -> CaptureRecord:
    return CaptureRecord(model_id=RUN, request_id=request, act_name=RESID, layer_no=0,
                         shard_rank=0, start_token_idx=start, end_token_idx=end,
                         dtype="torch.float32", shape=(end - start, 2),
                         payload=bytes(8 * (end - start)), seq=1)


def _store(tmp_path: Path, *, commit: bool) -> Path:
    path = tmp_path / "store"
    sink = ClickHouseSink(StoreConfig(kind=StoreKind.EMBEDDED, path=str(path),
                                      flush_timeout_us=20_000))
    run = RunInfo(RUN, "/m", (), ((RESID, 0),), "2026-12-01T10:00:00+00:00")
    sink.start_run(run)
    sink.put([_rec("main-0.w0", 0, 5), _rec("main-1.w0", 0, 3)])
    if commit:
        sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED),
                        [RequestManifest(RUN, "main-0.w0", 4, 2, committed=True),
                         RequestManifest(RUN, "main-1.w0", 2, 2, committed=True)])
    sink.close()
    return path


def test_qualify_reads_back_totals_manifests_and_completeness(qualify: Any,
                                                              tmp_path: Path) -> None:
    store = _store(tmp_path, commit=True)
    outputs = [{"id": "main-0.w0"}, {"id": "main-1.w0"}, {"id": "never-stored"}]
    back = qualify.read_back(store, RUN, outputs)
    assert back["run_status"] == "committed"
    assert back["hook_totals"] == {RESID: [1, 2, 8, 64]}
    assert back["manifests"] == {"main-0.w0": [4, 2, False, 0], "main-1.w0": [2, 2, False, 0]}
    assert sorted(back["store_requests"]) == ["main-0.w0", "main-1.w0"]
    assert list(back["incomplete"]) == ["never-stored"]
    assert qualify.read_back(store, "no-such-run", outputs[:1])["run_status"] is None


def test_bench_reads_back_stored_bytes_and_a_sample(bench: Any, tmp_path: Path) -> None:
    store = _store(tmp_path, commit=False)
    back = bench.read_back_sample(store, RUN, waves=1, batch=2, seed=0)
    assert back["run_status"] == "interrupted"  # its sink closed without finishing it
    assert back["stored_bytes"] == 64
    assert set(back["incomplete"]) == {"main-0.w0", "main-1.w0"}  # the sample drew both
    assert all("is interrupted, not committed" in m[0] for m in back["incomplete"].values())
