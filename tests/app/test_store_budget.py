"""The store budget: new requests stop being captured at the store's cap or when its
disk runs short, and requests already captured go on."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import structlog.testing

from dmi_sglang.app.session import RequestTracker
from dmi_sglang.app.store_budget import (
    MIN_FREE_BYTES,
    REFRESH_S,
    RESUME_FREE_BYTES,
    StoreBudget,
    directory_bytes,
)
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.store_config import StoreConfig, StoreKind


def _embedded(path: Path) -> StoreConfig:
    return StoreConfig(kind=StoreKind.EMBEDDED, path=str(path))


def test_the_cap_counts_the_store_as_it_was_plus_what_the_run_stored(tmp_path: Path) -> None:
    (tmp_path / "part.bin").write_bytes(b"x" * 4000)
    stored = [0]
    now = [0.0]
    budget = StoreBudget(_embedded(tmp_path), 1, lambda: stored[0],
                         free_bytes=lambda _p: 100 << 30, clock=lambda: now[0])
    assert budget.base_bytes == 4000
    assert budget() is None
    stored[0] = 10**9 - 4000  # exactly the cap with the store's own 4000 B
    assert budget() is None  # the answer of the last second still holds
    now[0] += REFRESH_S
    refusal = budget()
    assert refusal is not None
    assert "reached its cap: 1.0 GB of DMX_STORE_MAX_GB=1" in refusal


def test_a_disk_running_short_refuses_without_a_cap(tmp_path: Path) -> None:
    free = [MIN_FREE_BYTES]
    now = [0.0]
    budget = StoreBudget(_embedded(tmp_path), 0, lambda: 0, free_bytes=lambda _p: free[0],
                         clock=lambda: now[0])
    assert budget() is None
    free[0] = MIN_FREE_BYTES - 1
    now[0] += REFRESH_S
    refusal = budget()
    assert refusal is not None
    assert "disk has 2.1 GB free, below 2.1 GB" in refusal
    free[0] = 50 << 30  # space came back
    now[0] += REFRESH_S
    assert budget() is None


def test_a_run_that_stores_nothing_has_no_cap() -> None:
    budget = StoreBudget(StoreConfig(kind=StoreKind.NONE), 1, lambda: 10**12)
    assert budget() is None


def _req(rid: str) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=[1, 2, 3], output_ids=[],
                           finished=lambda: False)


def test_a_refusing_gate_leaves_new_requests_out_and_keeps_those_captured() -> None:
    refusal: list[str | None] = [None]
    tracker = RequestTracker(gate=lambda: refusal[0])
    a = _req("a")
    tracker.add_reqs([a])
    tracker.add_layout(BatchLayout.extend(["a"], [0], [3]))
    refusal[0] = "the store reached its cap"
    b = _req("b")
    tracker.add_reqs([a, b])
    assert tracker.skipped == frozenset({"b"})
    assert tracker.refused_requests == 1
    assert tracker.refusal == "the store reached its cap"
    refusal[0] = None
    c = _req("c")
    tracker.add_reqs([a, b, c])
    assert tracker.skipped == frozenset({"b"})  # b stays out, c is taken again
    assert tracker.refusal is None
    assert [m.request_id for m in tracker.manifests("run", committed=False)] == ["a", "c"]


def test_a_disk_that_cannot_be_checked_refuses_instead_of_failing_the_run(
        tmp_path: Path) -> None:
    def broken(_path: str) -> int:
        raise FileNotFoundError(2, "No such file or directory", _path)

    budget = StoreBudget(_embedded(tmp_path), 0, lambda: 0, free_bytes=broken)
    refusal = budget()
    assert refusal is not None
    assert "cannot be checked" in refusal


def test_a_disk_hovering_at_the_threshold_does_not_pause_and_resume_every_check(
        tmp_path: Path) -> None:
    now = [0.0]
    free = [MIN_FREE_BYTES - (4 << 20), MIN_FREE_BYTES + (4 << 20)]  # parts come and go
    budget = StoreBudget(StoreConfig(kind=StoreKind.EMBEDDED, path=str(tmp_path)), 0,
                         lambda: 0, free_bytes=lambda _p: free[int(now[0]) % 2],
                         clock=lambda: now[0])
    tracker = RequestTracker(gate=budget)
    with structlog.testing.capture_logs() as logs:
        for k in range(20):  # one new request a second
            tracker.add_reqs([SimpleNamespace(rid=f"r{k}", origin_input_ids=[1, 2, 3],
                                              output_ids=[], finished=lambda: False)])
            now[0] += REFRESH_S
    events = [e["event"] for e in logs if e["event"].startswith("dmi.capture_")]
    assert events == ["dmi.capture_paused"]
    assert tracker.captured_requests == 0
    free[:] = [RESUME_FREE_BYTES + 1] * 2  # room again: captures start again
    tracker.add_reqs([SimpleNamespace(rid="later", origin_input_ids=[1], output_ids=[],
                                      finished=lambda: False)])
    assert tracker.captured_requests == 1


def test_a_file_linked_twice_in_the_store_counts_once(tmp_path: Path) -> None:
    part = tmp_path / "store" / "part_1"
    part.mkdir(parents=True)
    (part / "data.bin").write_bytes(b"x" * 1000)
    (tmp_path / "store" / "part_2").mkdir()
    os.link(part / "data.bin", tmp_path / "store" / "part_2" / "data.bin")  # a mutation's
    (tmp_path / "store" / "other.bin").write_bytes(b"y" * 10)
    assert directory_bytes(str(tmp_path / "store")) == 1010
