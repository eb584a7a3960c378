"""The bandwidth plan's byte counts equal what a capture of random layouts stores."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmi_sglang.domain.bandwidth import capture_bytes, plan_bandwidth
from dmi_sglang.domain.layout import BatchLayout

from .conftest import SHAPE, select

SELECTIONS = ("resid_pre", "resid_pre,final_logits", "token_ids,final_logits,mlp_out@1",
              "sglang-full", "resid_pre:fp16,final_logits:topk(3)",
              "sglang-full:bf16,final_logits:topk(7):fp16")


@st.composite
def requests(draw: st.DrawFn) -> list[tuple[str, int, int, list[int]]]:
    """Requests ``(rid, prompt, completion, prefill chunk sizes)``."""
    out = []
    for i in range(draw(st.integers(1, 3))):
        prompt = draw(st.integers(1, 12))
        chunks: list[int] = []
        while sum(chunks) < prompt:
            chunks.append(draw(st.integers(1, prompt - sum(chunks))))
        out.append((f"r{i}", prompt, draw(st.integers(1, 5)), chunks))
    return out


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests(), text=st.sampled_from(SELECTIONS), coalesce=st.booleans())
def test_stored_bytes_equal_the_plans(make_driver, reqs, text, coalesce) -> None:
    d, sink = make_driver(text, payload_bytes=1 << 20, max_graph_batch=4,
                          coalesce_decode=coalesce)
    for rid, prompt, _, chunks in reqs:  # prefill chunk by chunk, then decode
        done = 0
        for n in chunks:
            last = done + n == prompt
            d.forward(BatchLayout.extend([rid], [done], [n], seq_lens=[done + n + (not last)]))
            done += n
    live = {rid: (prompt, completion, prompt + 1) for rid, prompt, completion, _ in reqs}
    while live:  # every request decodes until its extra forward (seq_len = p + c)
        rids = list(live)
        d.forward(BatchLayout.decode(rids, [live[r][2] for r in rids]))
        for rid in rids:
            prompt, completion, seq = live[rid]
            if seq == prompt + completion:
                d.t.finish_request(rid, prompt + completion - 1)
                del live[rid]
            else:
                live[rid] = (prompt, completion, seq + 1)
    d.t.stop()
    captures = select(text)
    stored = sum(len(r.payload) for r in sink.records)
    want = capture_bytes(captures, SHAPE, [(p, c, True) for _, p, c, _ in reqs])
    assert stored == want.bytes
    assert sum(r.rows for r in sink.records) == want.rows
    for _, prompt, completion, _ in reqs:
        plan = plan_bandwidth(captures, SHAPE, prompt_tokens=prompt,
                              completion_tokens=completion)
        assert plan.bytes_per_request == capture_bytes(
            captures, SHAPE, [(prompt, completion, True)]).bytes
