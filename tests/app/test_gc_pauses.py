"""Garbage-collection pauses of the scheduler process, timed while a capture runs."""

from __future__ import annotations

import gc

from dmi_sglang.app.gc_pauses import GcPauses


def test_collections_are_timed_between_start_and_stop() -> None:
    pauses = GcPauses()
    gc.collect()  # before start: not counted
    assert pauses.counters()["gc_collections"] == 0
    pauses.start()
    pauses.start()  # idempotent: one callback
    try:
        gc.collect(0)
        gc.collect()  # a full collection
    finally:
        pauses.stop()
    counted = pauses.counters()
    assert pauses.collections[0] >= 1
    assert counted["gc_full_collections"] >= 1
    assert counted["gc_collections"] == sum(pauses.collections) >= 2
    assert 0 < counted["gc_longest_seconds"] <= counted["gc_seconds"]
    assert counted["gc_full_seconds"] <= counted["gc_seconds"]
    gc.collect()  # after stop: not counted
    assert pauses.counters() == counted
    assert pauses._callback not in gc.callbacks
