"""Property: for any schedule of steps, every row arrives exactly once, in order, exact."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.testing import MemorySink

BUCKETS = (1, 2, 4, 8)

prefill = st.tuples(st.just("prefill"), st.integers(1, 40), st.integers(1, 40))
decode = st.tuples(st.just("decode"), st.integers(1, 6), st.booleans())
finish = st.tuples(st.just("finish"), st.integers(0, 7), st.just(False))
schedules = st.lists(st.one_of(prefill, decode, finish), min_size=1, max_size=12)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    schedule=schedules,
    ring=st.sampled_from([1024, 2048, 8192, 1 << 16]),
    strip=st.booleans(),
    coalesce=st.booleans(),
    slow=st.booleans(),
    window_bytes=st.sampled_from([200, 1 << 20]),
)
def test_any_schedule_delivers_every_row_once_in_order(
    make_driver, schedule, ring, strip, coalesce, slow, window_bytes
):
    sink = MemorySink(delay_s=0.001 if slow else 0.0)
    d, _ = make_driver(
        "resid_pre,token_ids,final_logits", payload_bytes=ring, sink=sink, strip=strip,
        max_graph_batch=8, max_prefill_tokens=40, coalesce_decode=coalesce,
        coalesce_max_bytes=window_bytes,
    )
    for bucket in reversed(BUCKETS):
        d.graph_capture(bucket)
    active: dict[str, int] = {}  # request -> tokens so far
    n_new = 0
    for op, a, b in schedule:
        if op == "prefill":
            rid, length, chunk = f"q{n_new}", a, b
            n_new += 1
            for start in range(0, length, chunk):
                count = min(chunk, length - start)
                d.forward(BatchLayout.extend([rid], [start], [count], seq_lens=[length]))
            active[rid] = length
        elif op == "decode":
            for _ in range(a):
                rids = list(active)[:8]
                if not rids:
                    break
                seq_lens = [active[r] + 1 for r in rids]
                if b:
                    bucket = next(x for x in BUCKETS if x >= len(rids))
                    layout = BatchLayout.decode(rids, seq_lens, padded_batch_size=bucket)
                    d.forward(layout, padded=True, strip=strip)
                else:
                    d.forward(BatchLayout.decode(rids, seq_lens))
                for r in rids:
                    active[r] += 1
        elif active:
            del active[list(active)[a % len(active)]]
    stats = d.t.stop()
    d.verify(sink.records)
    assert stats.rows == sum(r.rows for r in sink.records)
    assert stats.ring_high_water <= ring
