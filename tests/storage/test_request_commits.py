"""Per-request commits on the real embedded store: a finished request's manifest is
stored only after the rows put before it, reads as complete while the run still runs,
and stays complete whatever the run's end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import attrs
import pytest
import torch
from clickhouse_connect.driver.exceptions import OperationalError

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink, _commits
from dmi_sglang.adapters.clickhouse._commits import COMMIT_INTERVAL_S
from dmi_sglang.adapters.clickhouse._insert import open_inserter
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import RunStatus
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import StoreError

from ._support import RESID, FaultyInserter, handle, manifest, records_of, run_info

CAPTURES = [(RESID, 0)]
PROMPT, COMPLETION = 3, 2  # rows [0, 5)


def _put(sink: ClickHouseSink, rid: str) -> None:
    t = torch.randn(PROMPT + COMPLETION, 4)
    sink.put(RecordBatch.from_records(records_of("run", rid, RESID, 0, t, [0, 3, 4, 5])))


def test_a_committed_request_is_complete_while_the_run_runs_and_after_it_fails(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", CAPTURES)
    sink.start_run(run)
    _put(sink, "done")
    sink.commit_requests([manifest("run", "done", PROMPT, COMPLETION)])
    _put(sink, "live")  # rows of a request that has not finished
    sink.flush()  # waits for the commit too
    done, live = handle(store, "run", "done"), handle(store, "run", "live")
    assert ClickHouseReader(store).run("run").status is RunStatus.RUNNING  # type: ignore[union-attr]
    assert done.missing == ()  # read in the owner's process while the run captures
    assert done.get("resid_pre", 0).shape == (4, 4)  # the last token is never forwarded
    assert "running, not committed" in live.missing[0]
    failed = attrs.evolve(run, status=RunStatus.FAILED, error="scheduler died")
    sink.finish_run(failed, [manifest("run", "live", PROMPT, COMPLETION, committed=False)])
    sink.close()
    assert done.available  # its rows were all stored before its manifest
    assert live.missing == ("run 'run' is failed, not committed: scheduler died",)


def test_a_commit_waits_for_the_rows_put_before_it(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    gate = threading.Event()

    def factory(config: StoreConfig) -> FaultyInserter:
        def held(_n: int) -> None:
            gate.wait(30)  # each insert waits for the gate

        return FaultyInserter(open_inserter(config), held)

    sink = open_sink(inserter_factory=factory, writers=1)
    sink.start_run(run_info("run", CAPTURES))
    _put(sink, "r")
    sink.commit_requests([manifest("run", "r", PROMPT, COMPLETION)])
    time.sleep(3 * COMMIT_INTERVAL_S)  # the commit thread had time: it must still wait
    reader = ClickHouseReader(store)
    assert reader.manifest("run", "r") is None
    assert reader.records("run", "r") == []
    gate.set()
    sink.flush()
    stored = reader.manifest("run", "r")
    assert stored is not None
    assert stored.committed
    assert len(reader.records("run", "r")) == 3  # the prefill and two decode rows
    sink.close()


def test_a_commit_behind_rows_that_failed_is_never_stored(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    def factory(config: StoreConfig) -> FaultyInserter:
        return FaultyInserter(open_inserter(config), lambda _n: OperationalError("disk gone"))

    sink = open_sink(inserter_factory=factory, writers=1, retries=0)
    sink.start_run(run_info("run", CAPTURES))
    _put(sink, "r")
    sink.commit_requests([manifest("run", "r", PROMPT, COMPLETION)])
    with pytest.raises(StoreError, match="disk gone"):
        sink.flush()
    with pytest.raises(StoreError, match="disk gone"):
        sink.commit_requests([manifest("run", "r2", PROMPT, COMPLETION)])
    with pytest.raises(StoreError):
        sink.close()
    assert ClickHouseReader(store).manifest("run", "r") is None


def _second_commit_within_the_interval(
    open_sink: Callable[..., ClickHouseSink], monkeypatch: pytest.MonkeyPatch,
) -> ClickHouseSink:
    """A sink whose first manifest is stored and whose second one, with its rows, came
    right after: it waits for the interval between two commits (60 s, so a regression
    fails instead of hanging)."""
    monkeypatch.setattr(_commits, "COMMIT_INTERVAL_S", 60.0)
    sink = open_sink()
    sink.start_run(run_info("run", CAPTURES))
    _put(sink, "first")
    sink.commit_requests([manifest("run", "first", PROMPT, COMPLETION)])
    sink.flush()  # the first insert of manifests: no interval before it
    _put(sink, "second")
    sink.commit_requests([manifest("run", "second", PROMPT, COMPLETION)])
    return sink


def test_a_flush_does_not_wait_out_the_interval_between_commits(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = _second_commit_within_the_interval(open_sink, monkeypatch)
    flushed = threading.Thread(target=sink.flush, daemon=True)
    flushed.start()
    flushed.join(20)  # not the minute between two commits
    assert not flushed.is_alive()
    reader = ClickHouseReader(store)
    assert [reader.manifest("run", r) is not None for r in ("first", "second")] == [True, True]
    sink.close()


def test_commits_keep_their_interval_while_nobody_waits(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = _second_commit_within_the_interval(open_sink, monkeypatch)
    time.sleep(1.0)  # rows stored, the manifest waits for the interval
    reader = ClickHouseReader(store)
    assert len(reader.records("run", "second")) == 3
    assert reader.manifest("run", "second") is None
    sink.close()  # closing cuts it short too: stored, not dropped
    assert ClickHouseReader(store).manifest("run", "second") is not None
