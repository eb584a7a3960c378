"""The transport's program cache key: plans with one key have one structure."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.transport._program import plan_key
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import make_plan

from .conftest import SHAPE, select

SELECTIONS = (
    "resid_pre:positions(0-100),resid_mid,final_ln:positions(0-100)",
    "resid_pre,final_ln:positions(3-9),final_logits",
    "resid_pre:positions(2-5),mlp_out,final_logits:positions(0-6)",
    "token_ids,resid_pre:last_prompt,final_logits:last_prompt",
    "resid_pre,final_logits,final_logits:last_prompt:topk(2)",
)
RIDS = ("a", "b", "c", "d")


@st.composite
def steps(draw: st.DrawFn) -> tuple[BatchLayout, bool, frozenset[str]]:
    n = draw(st.integers(1, 4))
    rids = RIDS[:n]
    skip = frozenset(draw(st.sets(st.sampled_from(rids), max_size=n)))
    if draw(st.booleans()):
        seq = [draw(st.integers(1, 150)) for _ in rids]
        return BatchLayout.decode(rids, seq, padded_batch_size=4), True, skip
    prefix = [draw(st.integers(0, 120)) for _ in rids]
    extend = [draw(st.integers(0, 4)) for _ in rids]
    ends = [p + e + draw(st.integers(0, 1)) for p, e in zip(prefix, extend, strict=True)]
    return BatchLayout.extend(rids, prefix, extend, seq_lens=ends), False, skip


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SELECTIONS), st.lists(steps(), min_size=2, max_size=30))
def test_plans_with_one_key_have_the_same_segments(text: str, many: list) -> None:
    selection = select(text)
    prompts = {"a": 3, "b": 5, "c": 1, "d": 8}.get
    by_key: dict[object, set[tuple]] = defaultdict(set)
    for layout, padded, skip in many:
        plan = make_plan(layout, selection, SHAPE, padded=padded, skip=skip, prompts=prompts)
        by_key[plan_key(plan)].add(tuple(
            (s.hook.name, s.layer_no, s.source_rows, s.kept_rows, s.ring_rows, s.source_index,
             s.offset) for s in plan.segments))
    for key, structures in by_key.items():
        assert len(structures) == 1, key


def test_a_hook_without_a_rule_between_ruled_ones_keeps_its_own_rows_count() -> None:
    # Found in review: the rule keeps rows (0, 2) of both batches, so the first and the
    # last segment agree, while resid_mid keeps 3 rows in one and 4 in the other.
    selection = select("resid_pre:positions(0-100),resid_mid,final_ln:positions(0-100)")
    three = make_plan(BatchLayout.decode(["a", "b", "c"], [6, 201, 7], padded_batch_size=4),
                      selection, SHAPE, padded=True)
    four = make_plan(BatchLayout.decode(["a", "b", "c", "d"], [6, 201, 7, 301],
                                        padded_batch_size=4), selection, SHAPE, padded=True)
    assert [s.kept_rows for s in three.segments][:2] == [2, 3]
    assert [s.kept_rows for s in four.segments][:2] == [2, 4]
    assert plan_key(three) != plan_key(four)


def test_a_long_prefill_with_a_row_selection_is_planned_and_moved_without_a_cache(
        make_driver) -> None:
    d, sink = make_driver("resid_pre,final_logits", payload_bytes=1 << 20)
    d.skip = frozenset({"b"})
    layout = BatchLayout.extend(["a", "b"], [0, 0], [2500, 2500])
    plan = d.plan(layout)
    assert not plan.cacheable  # 2500 token rows kept by index: too big a cache key
    assert d.plan(BatchLayout.decode(["a", "b"], [2501, 2501])).cacheable
    d.forward(layout)
    d.forward(BatchLayout.decode(["a", "b"], [2501, 2501]))
    d.t.stop()
    d.verify(sink.records)
    assert {r.request_id for r in sink.records} == {"a"}


def _retracted_and_chunked() -> tuple[BatchLayout, BatchLayout]:
    """Same token rows, another number of emitting requests: ``x`` prefilled to its
    prompt beside ``y`` re-prefilled after a retraction (both emit), or beside ``z``'s
    intermediate chunk (emits nothing)."""
    return (BatchLayout.extend(["x", "y"], [0, 0], [3, 4], seq_lens=[3, 4]),
            BatchLayout.extend(["x", "z"], [0, 0], [3, 4], seq_lens=[3, 9]))


RULE_AROUND_LOGITS = "resid_pre,final_logits,final_logits:last_prompt:topk(2)"
"""final_logits (no rule) between token rows and a ruled request-row capture: neither
the first nor the last segment."""


def test_logits_rows_between_other_segments_are_part_of_the_key() -> None:
    # Found in review: the key missed the rows of a request-row segment without a rule
    # that is neither first nor last, so these two plans shared one program
    selection = select(RULE_AROUND_LOGITS)
    prompts = {"x": 3, "y": 2, "z": 4}.get
    both, one = (make_plan(layout, selection, SHAPE, padded=False, prompts=prompts)
                 for layout in _retracted_and_chunked())
    assert (both.segment_for("final_logits", -1).kept_rows,
            one.segment_for("final_logits", -1).kept_rows) == (2, 1)
    assert plan_key(both) != plan_key(one)


def test_both_requests_logits_rows_are_stored_after_a_plan_with_one(make_driver) -> None:
    d, sink = make_driver(RULE_AROUND_LOGITS)
    d.prompts = {"x": 3, "y": 2, "z": 4}
    both, one = _retracted_and_chunked()
    d.forward(one)  # its program is cached first
    d.forward(both)
    for rid in ("x", "y", "z"):
        d.t.finish_request(rid, None)
    d.t.stop()
    d.verify(sink.records)
