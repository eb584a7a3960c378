"""Position rules: the syntax, their content definitions, and the rows they keep."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmi_sglang.domain.bandwidth import capture_bytes, plan_bandwidth
from dmi_sglang.domain.hooks import CATALOG, ModelHooks, parse_selection
from dmi_sglang.domain.positions import PositionRule, Positions
from dmi_sglang.domain.records import expected_coverage
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.errors import SelectionError

SHAPE = ModelShape(4, 8, 2, 1, 4, 12, 10)
HOOKS = ModelHooks("Toy", frozenset(h.name for h in CATALOG), 4)
RULES = ("all", "last_prompt", "last", "generated", "every(2)", "every(3)", "positions(2-5)",
         "positions(7)")


@pytest.mark.parametrize("text", RULES)
def test_every_rule_reads_back_as_written(text: str) -> None:
    rule = Positions.parse(text)
    assert str(rule) == text
    assert Positions.parse(str(rule)) == rule


@pytest.mark.parametrize(("text", "words"), [
    ("first", "unknown position rule 'first'"),
    ("every(0)", "every(0) in 'x': K must be at least 1"),
    ("every(2-4)", "unknown position rule 'every(2-4)'"),
    ("positions(5-3)", "positions(5-3) in 'x': need A <= B"),
    ("positions()", "accepted: all, last_prompt, last, generated, every(K), positions(A-B)"),
])
def test_bad_rules_are_refused_by_name(text: str, words: str) -> None:
    with pytest.raises(SelectionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Positions.parse(text, "x")


@given(text=st.sampled_from(RULES), prompt=st.integers(1, 40), completion=st.integers(1, 40),
       extra=st.booleans(), request_rows=st.booleans())
def test_rows_counts_the_positions_the_rule_keeps(text: str, prompt: int, completion: int,
                                                  extra: bool, request_rows: bool) -> None:
    hook = next(h for h in CATALOG if h.name == ("final_logits" if request_rows else "resid_pre"))
    full = expected_coverage(hook, prompt_tokens=prompt, completion_tokens=completion,
                             overlap_extra_forward=extra)
    rule = Positions.parse(text)
    kept = [p for p in range(full.start, full.end)
            if rule.keeps(p, prompt=prompt, completion=completion)]
    # a generated capture of token rows also stores the extra forward (never read)
    stored = int(rule.rule is PositionRule.GENERATED and extra and not request_rows)
    assert rule.rows(full.start, full.end, prompt=prompt, completion=completion) == \
        len(kept) + stored
    if rule.rule in (PositionRule.LAST_PROMPT, PositionRule.LAST):
        assert len(kept) == 1
    if rule.rule is PositionRule.GENERATED:
        assert kept == list(range(prompt - 1, prompt + completion - 1))  # never the extra


def test_the_definitions_by_content() -> None:
    # prompt of 5 (positions 0-4), 3 generated tokens (at 5, 6, 7), decided at 4, 5, 6
    keeps = {t: [p for p in range(8) if Positions.parse(t).keeps(p, prompt=5, completion=3)]
             for t in RULES}
    assert keeps["last_prompt"] == [4]
    assert keeps["last"] == [6]
    assert keeps["generated"] == [4, 5, 6]
    assert keeps["every(3)"] == [0, 3, 6]
    assert keeps["positions(2-5)"] == [2, 3, 4, 5]


def test_selection_items_carry_their_rule_per_hook_and_layer() -> None:
    text = "resid_pre@0-1:last,resid_pre@2-3,final_logits:generated,mlp_out@2:every(8)"
    parsed = parse_selection(text)
    assert str(parsed) == text
    assert parsed.selects_positions
    sel = parsed.resolve(HOOKS)
    assert str(sel.positions_of("resid_pre", 0)) == "last"
    assert sel.positions_of("resid_pre", 2).is_all
    assert str(sel.positions_of("final_logits", -1)) == "generated"
    assert str(sel.positions_of("mlp_out", 2)) == "every(8)"
    assert not parse_selection("resid_pre@0-1,final_ln").selects_positions


def test_one_capture_with_two_rules_is_an_error() -> None:
    with pytest.raises(SelectionError, match="resid_pre@1 is selected with two position rules"):
        parse_selection("resid_pre:last,resid_pre@1-2:generated").resolve(HOOKS)
    same = parse_selection("resid_pre:last,resid_pre@1:last").resolve(HOOKS)
    assert str(same.positions_of("resid_pre", 1)) == "last"


def test_the_plan_counts_only_kept_rows() -> None:
    sel = parse_selection("resid_pre:last,final_logits:last_prompt").resolve(HOOKS)
    got = capture_bytes(sel, SHAPE, [(5, 3, True), (2, 9, False)])
    per_request = 4 * SHAPE.row(CATALOG[0]).nbytes + 10 * 4  # 4 layers x 1 row, 1 logits row
    assert got.bytes == 2 * per_request
    assert got.rows == 2 * 5
    plan = plan_bandwidth(sel, SHAPE, prompt_tokens=100, completion_tokens=10)
    assert plan.bytes_per_request == per_request
    assert plan.bytes_per_prompt_token == 0


@pytest.mark.parametrize("text", [
    "resid_pre@0-3:positions(0-127),final_ln:positions(5),final_logits",
    "hf-only:last_prompt", "final_logits:positions(0-9),resid_pre",
    "resid_pre:generated,final_logits:generated", "final_ln:every(4)", "hf-only:every(2)"])
def test_a_capture_takes_every_position_rule(text: str) -> None:
    assert Settings.from_env({"DMX_HOOK_SELECTION": text}).hook_selection == text


def test_the_last_prompt_position_needs_the_prompt_length() -> None:
    rule = Positions.parse("last_prompt")
    assert rule.span(0, 10, prompt=7) == (6, 7)
    lo, hi = rule.span(7, 9, prompt=7)  # decode positions: after the prompt
    assert hi <= lo
    with pytest.raises(ValueError, match="needs the request's prompt length"):
        rule.span(0, 10)
    assert Settings.from_env({"DMX_HOOK_SELECTION": "resid_pre:all"}).hook_selection == \
        "resid_pre"


def test_a_position_range_narrows_a_span_and_other_rules_have_none() -> None:
    rule = Positions.parse("positions(3-6)")
    assert rule.span(0, 10) == (3, 7)
    assert rule.span(5, 20) == (5, 7)
    lo, hi = rule.span(8, 12)
    assert hi <= lo  # nothing of [8, 12) is kept
    assert Positions().span(2, 9) == (2, 9)
    with pytest.raises(ValueError, match="every"):
        Positions.parse("every(4)").span(0, 10)


def test_a_runs_rules_come_from_the_selection_it_stored() -> None:
    from dmi_sglang.domain.records import SELECTION_KEY, RunInfo

    captures = tuple((f"blocks.hook_{n}", layer) for n in ("resid_pre",) for layer in range(4))
    run = RunInfo("r", "m", ((SELECTION_KEY, "hidden-states@2-3:positions(0-9),final_ln"),),
                  (*captures, ("hook_final_ln", -1)), "t")
    ranged = Positions.parse("positions(0-9)")
    assert run.position_rules() == {("blocks.hook_resid_pre", 2): ranged,
                                    ("blocks.hook_resid_pre", 3): ranged}
    plain = RunInfo("r", "m", ((SELECTION_KEY, "hidden-states"),), captures, "t")
    assert plain.position_rules() == {}


def test_generated_keeps_from_the_last_prompt_position_and_reads_to_the_last_decision() -> None:
    rule = Positions.parse("generated")
    assert rule.span(0, 12, prompt=5) == (4, 12)  # capturing: the completion is unknown
    assert rule.span(0, 12, prompt=5, completion=3) == (4, 7)  # reading: 5 + 3 - 1
    # what a capture stores: the extra forward's position 7 of token rows too
    assert rule.rows(0, 8, prompt=5, completion=3) == 4
    assert rule.rows(4, 7, prompt=5, completion=3) == 3  # request rows: [4, 7)


@pytest.mark.parametrize(("text", "kept"), [
    ("resid_pre@0-27:last_prompt,final_logits:generated", True),
    ("hf-only:generated", True),
    ("resid_pre:last_prompt,final_ln", False),  # final_ln keeps every prompt position
    ("resid_pre:positions(100-200)", False),
    ("sglang-full", False),
])
def test_the_radix_cache_stays_on_for_selections_from_the_last_prompt_position(
        text: str, kept: bool) -> None:
    settings = Settings.from_env({"DMX_HOOK_SELECTION": text})
    assert settings.prefix_cache_allowed is kept
    assert Settings.from_env({"DMX_HOOK_SELECTION": text,
                              "DMX_ALLOW_PREFIX_CACHE": "1"}).prefix_cache_allowed


@given(st.integers(1, 20), st.integers(0, 20), st.integers(0, 3), st.integers(0, 45))
def test_last_spans_the_position_that_decided_the_last_token(prompt: int, completion: int,
                                                              start: int, end: int) -> None:
    rule = Positions.parse("last")
    lo, hi = rule.span(start, end, prompt=prompt, completion=completion)
    kept = [p for p in range(start, end)
            if completion >= 1 and rule.keeps(p, prompt=prompt, completion=completion)]
    assert list(range(lo, hi)) == kept
    assert rule.rows(start, end, prompt=prompt, completion=completion) == len(kept)
    with pytest.raises(ValueError, match="needs the request's prompt length"):
        rule.span(start, end)


def test_a_read_plan_holds_one_final_row_per_request_of_each_last_capture() -> None:
    from dmi_sglang.domain.layout import BatchLayout
    from dmi_sglang.domain.plan import emitting_rows, make_read_plan

    sel = parse_selection("resid_pre@1-2:last,final_ln,final_logits:last").resolve(HOOKS)
    plan = make_read_plan([("a", 6), ("b", 2)], sel, SHAPE)
    assert [(s.hook.name, s.layer_no, s.kept_rows) for s in plan.segments] == [
        ("resid_pre", 1, 2), ("resid_pre", 2, 2), ("final_logits", -1, 2)]
    for seg in plan.segments:
        assert [(s.request_id, s.row_offset, s.start, s.end) for s in plan.slices(seg)] == [
            ("a", 0, 6, 7), ("b", 1, 2, 3)]
        assert seg.positions.rule is PositionRule.LAST
    assert plan.total_bytes == 2 * (2 * 8 * 2) + 2 * 10 * 4  # bf16 and fp32 rows, aligned
    with pytest.raises(ValueError, match="needs reads and captures with the last rule"):
        make_read_plan([("a", 1)], parse_selection("final_ln").resolve(HOOKS), SHAPE)
    # another read of as many requests shares the placement, never the requests' rows
    again = make_read_plan([("c", 9), ("d", 4)], sel, SHAPE)
    assert again.shares_structure(plan)
    assert not make_read_plan([("c", 9)], sel, SHAPE).shares_structure(plan)
    assert [(s.request_id, s.start) for s in again.slices(again.segments[0])] == [
        ("c", 9), ("d", 4)]
    assert [(s.request_id, s.start) for s in plan.slices(plan.segments[0])] == [
        ("a", 6), ("b", 2)]
    # which rows of a forward decide a token: a chunk that ends the prompt, every decode row
    lay = BatchLayout.extend(["x", "y", "z"], [0, 0, 4], [3, 2, 1], seq_lens=[3, 4, 5])
    assert emitting_rows(lay) == ((2, 0, "x", 2), (5, 2, "z", 4))
    # a forward plan keeps no row of a last capture: they wait in the device slots
    from dmi_sglang.domain.plan import make_plan

    forward = make_plan(lay, sel, SHAPE, padded=False)
    assert [s.hook.name for s in forward.segments] == ["final_ln"]


def test_last_slots_are_counted_per_request_and_capture() -> None:
    from dmi_sglang.domain.capacity import last_slot_bytes, last_slot_requests

    sel = parse_selection("resid_pre:last,final_logits:last:topk(4),final_ln").resolve(HOOKS)
    requests = last_slot_requests(max_requests=3, max_graph_batch=8)
    assert requests == 16
    per_row = 4 * 8 * 2 + (4 * 4 + 4 * 4)  # 4 bf16 resid_pre layers, topk values and ids
    assert last_slot_bytes(sel, SHAPE, requests=requests) == (2 * 16 + 1) * per_row
    # 4 resid_pre layers land (a group of 4 equal rows); topk values and ids do not
    assert last_slot_bytes(sel, SHAPE, requests=requests, max_graph_batch=8) == (
        (2 * 16 + 1) * per_row + 8 * 4 * 8 * 2)
    assert last_slot_bytes(parse_selection("final_ln").resolve(HOOKS), SHAPE,
                           requests=16) == 0


def test_every_one_is_every_position() -> None:
    assert Positions.parse("every(1)") == Positions.parse("all")
    assert Positions.parse("every(1)").is_all
