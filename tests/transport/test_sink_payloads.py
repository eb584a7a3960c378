"""Zero-copy payloads: memoryview slices of pooled slabs, through the ClickHouse sink."""

from __future__ import annotations

import gc

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.adapters.transport._pool import PayloadPool
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.records import RunInfo
from dmi_sglang.domain.store_config import StoreConfig, StoreKind

from .conftest import raw_bytes, rows_tensor  # type: ignore[import-not-found]


def test_slabs_return_to_the_pool_when_their_payloads_are_gone():
    pool = PayloadPool(slab_bytes=1000, max_free_slabs=4)
    for _ in range(3):
        views = []
        for _ in range(5):  # 5 x 400 bytes: three slabs
            chunk = pool.alloc(400)
            chunk.array[:] = 7
            views.append(chunk.view[chunk.offset : chunk.offset + 400])
        assert all(bytes(v) == b"\x07" * 400 for v in views)
        assert all(v.readonly for v in views)
        del views, chunk
        pool.release()
        gc.collect()
    assert pool.allocated == 3
    assert pool.reused == 6
    big = pool.alloc(5000)  # larger than a slab: its own memory
    assert big.array.nbytes == 5000
    assert pool.oversized == 1


def test_payloads_are_read_only_slices_that_survive_the_pool(make_driver):
    d, sink = make_driver("resid_pre,final_logits", flush_timeout_s=0.01)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [4, 2]))
    for n in range(6):
        d.forward(BatchLayout.decode(["a", "b"], [5 + n, 3 + n]))
    d.t.stop()
    d.verify(sink.records)
    assert all(isinstance(r.payload, memoryview) and r.payload.readonly for r in sink.records)


def test_clickhouse_sink_stores_memoryview_payloads(make_driver, tmp_path):
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=str(tmp_path / "store"),
                         flush_timeout_us=20_000)
    store = ClickHouseSink(config)
    try:
        store.start_run(RunInfo("run-1", "toy", (), (), "2026-11-29T10:00:00Z"))
        d, _ = make_driver("resid_pre,final_logits", sink=store, flush_timeout_s=0.01)
        d.forward(BatchLayout.extend(["a"], [0], [5]))
        for n in range(4):
            d.forward(BatchLayout.decode(["a"], [6 + n]))
        d.t.stop()
    finally:
        store.close()
    got = ClickHouseReader(config).records("run-1", "a")
    assert got
    d.verify(got)
    for r in got:
        assert isinstance(r.payload, bytes)
    hook = {h.act_name: h for h, _ in d.selection.captures()}
    r = next(r for r in got if r.act_name == "blocks.hook_resid_pre" and r.layer_no == 2
             and r.rows > 1)
    want = rows_tensor(hook[r.act_name], 2, [("a", p) for p in range(r.start_token_idx,
                                                                      r.end_token_idx)])
    assert r.payload == raw_bytes(want)
