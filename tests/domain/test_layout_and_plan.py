"""BatchLayout, CommitPlan and the one-commit-per-forward protocol."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dmi_sglang.domain.hooks import RowBasis, Selection, parse_selection
from dmi_sglang.domain.layout import BatchLayout, ForwardKind
from dmi_sglang.domain.plan import CommitPlan, StepProtocol, StepState, make_plan
from dmi_sglang.errors import CommitError

from .strategies import MODEL, SHAPE, decode_layouts, extend_layouts, selections

layouts = st.one_of(decode_layouts(), extend_layouts())


def test_decode_layout_positions() -> None:
    layout = BatchLayout.decode(["a", "b"], [5, 9], padded_batch_size=4)
    assert layout.positions() == [("a", 4), ("b", 8)]
    assert layout.token_rows == 2
    assert layout.padded_token_rows == 4
    assert layout.kind is ForwardKind.DECODE


def test_extend_layout_positions_and_emitting() -> None:
    layout = BatchLayout.extend(["a", "b"], [0, 10], [3, 2], seq_lens=[3, 20])
    assert layout.positions() == [("a", 0), ("a", 1), ("a", 2), ("b", 10), ("b", 11)]
    assert [r.emits_token for r in layout.requests] == [True, False]
    assert [r.row_offset for r in layout.requests] == [0, 3]


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(CommitError, match="differ in length"):
        BatchLayout.decode(["a"], [1, 2])
    with pytest.raises(CommitError, match="smaller than the 2 real requests"):
        BatchLayout.decode(["a", "b"], [1, 2], padded_batch_size=1)
    with pytest.raises(CommitError, match="must be >= 1"):
        BatchLayout.decode(["a"], [0])


def _check_plan(plan: CommitPlan, layout: BatchLayout, sel: Selection) -> None:
    # segments never overlap and respect alignment
    spans = sorted((s.offset, s.offset + s.aligned_bytes(plan.alignment)) for s in plan.segments)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    assert all(s.offset % plan.alignment == 0 for s in plan.segments)
    assert plan.total_bytes == sum(s.aligned_bytes(plan.alignment) for s in plan.segments)
    for seg in plan.segments:
        covered = sum(sl.rows for sl in plan.slices(seg))
        assert covered == seg.kept_rows
        if seg.hook.row_basis is RowBasis.TOKEN:
            # the stripped plan keeps exactly the real rows; rows of all requests sum up
            assert seg.kept_rows == layout.token_rows
            rows = [(sl.request_id, p) for sl in plan.slices(seg)
                    for p in range(sl.start, sl.end)]
            assert rows == layout.positions()
        else:
            assert seg.kept_rows == layout.logit_rows
            assert all(sl.rows == 1 for sl in plan.slices(seg))
        if plan.strip or not plan.padded:
            assert seg.ring_rows == seg.kept_rows
        else:
            assert seg.ring_rows == seg.source_rows >= seg.kept_rows
    captured = {(h.name, layer) for h, layer in sel.captures()}
    assert {(s.hook.name, s.layer_no) for s in plan.segments} <= captured


@given(layouts, selections(), st.booleans())
def test_plan_properties(layout: BatchLayout, sel: Selection, strip: bool) -> None:
    padded = make_plan(layout, sel, SHAPE, padded=True, strip=strip)
    unpadded = make_plan(layout, sel, SHAPE, padded=False)
    _check_plan(padded, layout, sel)
    _check_plan(unpadded, layout, sel)
    assert padded.total_bytes >= unpadded.total_bytes
    assert padded.kept_bytes == unpadded.kept_bytes


@given(decode_layouts(), selections())
def test_decode_gives_one_row_per_request(layout: BatchLayout, sel: Selection) -> None:
    plan = make_plan(layout, sel, SHAPE, padded=True)
    for seg in plan.segments:
        assert seg.kept_rows == layout.raw_batch_size
        assert [sl.request_id for sl in plan.slices(seg)] == list(layout.request_ids)
        assert seg.source_rows == layout.padded_batch_size


def test_final_logits_rows_only_for_emitting_requests() -> None:
    sel = parse_selection("final_logits,token_ids").resolve(MODEL)
    layout = BatchLayout.extend(["a", "b", "c"], [0, 0, 4], [4, 2, 3], seq_lens=[4, 9, 7])
    plan = make_plan(layout, sel, SHAPE, padded=False)
    logits = plan.segment_for("final_logits", -1)
    assert logits is not None
    got = [(s.request_id, s.start, s.end) for s in plan.slices(logits)]
    assert got == [("a", 3, 4), ("c", 6, 7)]
    assert logits.source_index == (0, 2)
    assert logits.source_rows == 3
    tokens = plan.segment_for("token_ids", -1)
    assert tokens is not None
    assert tokens.kept_rows == 9


def test_pieces_cover_every_segment_once() -> None:
    sel = parse_selection("sglang-full").resolve(MODEL)
    layout = BatchLayout.extend(["a"], [0], [100])
    plan = make_plan(layout, sel, SHAPE, padded=False)
    pieces = list(plan.pieces())
    assert [p.segments[0].hook.name for p in pieces] == [s.hook.name for s in plan.segments]
    assert all(p.segments[0].offset == 0 for p in pieces)
    assert sum(p.kept_bytes for p in pieces) == plan.kept_bytes


def test_step_protocol() -> None:
    proto = StepProtocol()
    plan = make_plan(BatchLayout.idle(), parse_selection("resid_pre").resolve(MODEL), SHAPE,
                     padded=False)
    assert proto.begin() == 1
    with pytest.raises(CommitError, match="began while forward 1"):
        proto.begin()
    proto.commit(plan)
    with pytest.raises(CommitError, match="committed twice"):
        proto.commit(plan)
    assert proto.end() is plan
    assert proto.state is StepState.IDLE
    with pytest.raises(CommitError, match="commit outside a forward"):
        proto.commit(plan)
    proto.begin()
    with pytest.raises(CommitError, match="forward 2 ended without a commit"):
        proto.end()
    assert proto.state is StepState.IDLE
    proto.begin()
    proto.abort()
    assert proto.begin() == 4


def test_a_plan_without_some_requests_keeps_the_others_rows_and_ids() -> None:
    sel = parse_selection("resid_pre,final_logits").resolve(MODEL)
    rids = ("a", "b", "c", "d")
    skip = frozenset({"b", "d"})
    first = make_plan(BatchLayout.decode(rids, [5, 6, 7, 8], padded_batch_size=8), sel,
                      SHAPE, padded=True, skip=skip)
    second = make_plan(BatchLayout.decode(rids, [6, 7, 8, 9], padded_batch_size=8), sel,
                       SHAPE, padded=True, skip=skip)
    assert first.layout.request_ids == ("a", "c")
    assert first.layout.starts == (4, 6)
    assert first.batch.raw_batch_size == 4
    assert second.layout.request_ids is first.layout.request_ids  # an unchanged batch
    for seg in first.segments:
        assert seg.source_rows == 8
        assert seg.kept_rows == 2
        assert seg.source_index == (0, 2)
    everyone = make_plan(BatchLayout.decode(rids, [5, 6, 7, 8]), sel, SHAPE, padded=False,
                         skip=frozenset({"z"}))
    assert everyone.batch is everyone.layout
    assert all(seg.source_index is None for seg in everyone.segments)
    nobody = make_plan(BatchLayout.decode(rids, [5, 6, 7, 8]), sel, SHAPE, padded=False,
                       skip=frozenset(rids))
    assert nobody.segments == ()


_RULED = ["", ":last", ":generated", ":last_prompt", ":positions(0-300)", ":positions(5-7)",
          ":every(3)"]


@given(decode_layouts(), selections(), st.sampled_from(_RULED), st.booleans(),
       st.integers(1, 3), st.booleans())
def test_a_decode_plan_made_from_the_previous_one_equals_one_made_afresh(
        layout: BatchLayout, sel: Selection, rule: str, strip: bool, moves: int,
        leave_out: bool) -> None:
    """``previous`` never changes a plan: the next decode steps of the same requests get
    the plan ``make_plan`` makes from scratch (reusing the structure only where positions
    cannot matter), and any other change (new requests, left-out set, padding) is planned
    afresh."""
    sel = parse_selection(f"resid_pre@0{rule},final_logits{rule}").resolve(MODEL) if rule else sel
    skip = frozenset(layout.request_ids[:1]) if leave_out else frozenset()
    plan = make_plan(layout, sel, SHAPE, padded=True, strip=strip, skip=skip)
    for step in range(1, moves + 1):
        ahead = BatchLayout.decode(layout.request_ids, [s + 1 + step for s in layout.starts],
                                   padded_batch_size=layout.padded_batch_size)
        ahead = BatchLayout(ahead.kind, layout.request_ids, ahead.starts, ahead.counts,
                            ahead.emits, ahead.padded_batch_size, ahead.token_rows)
        fresh = make_plan(ahead, sel, SHAPE, padded=True, strip=strip, skip=skip)
        reused = make_plan(ahead, sel, SHAPE, padded=True, strip=strip, skip=skip,
                           previous=plan)
        assert reused == fresh
        assert reused.segments == fresh.segments
        assert reused.batch == fresh.batch
        assert [reused.slices(s) for s in reused.segments] == [
            fresh.slices(s) for s in fresh.segments]
        plan = reused
    other = BatchLayout.decode([*layout.request_ids, "new"], [9] * (layout.raw_batch_size + 1))
    assert make_plan(other, sel, SHAPE, padded=True, previous=plan) == make_plan(
        other, sel, SHAPE, padded=True)


def test_a_steady_decode_batch_reuses_the_structure_unless_positions_matter() -> None:
    rids = ("a", "b")  # positions 10, 20 (row a kept by positions(0-10)), then 11, 21 (none)
    one = BatchLayout.decode(rids, [11, 21], padded_batch_size=4)
    two = BatchLayout.decode(rids, [12, 22], padded_batch_size=4)
    two = BatchLayout(two.kind, rids, two.starts, two.counts, two.emits, 4, 2)
    for text, reused in (("resid_pre,final_logits:last", True), ("resid_pre:positions(0-10)",
                                                                  False)):
        sel = parse_selection(text).resolve(MODEL)
        first = make_plan(one, sel, SHAPE, padded=True)
        assert make_plan(two, sel, SHAPE, padded=True, previous=first).shares_structure(
            first) is reused


@given(decode_layouts(), st.integers(2, 9), st.booleans())
def test_every_k_keeps_the_decode_rows_at_multiples_of_k(layout: BatchLayout, k: int,
                                                          leave_out: bool) -> None:
    """A decode forward's rows under every(K), token and request rows alike: those of
    the captured requests whose position is a multiple of K."""
    sel = parse_selection(f"resid_pre@0:every({k}),final_logits:every({k})").resolve(MODEL)
    skip = frozenset(layout.request_ids[:1]) if leave_out else frozenset()
    plan = make_plan(layout, sel, SHAPE, padded=True, skip=skip)
    want = [i for i, (rid, p) in enumerate(zip(layout.request_ids, layout.starts,
                                               strict=True))
            if p % k == 0 and rid not in skip]
    for seg in plan.segments:
        rows = list(range(layout.raw_batch_size)) if seg.source_index is None else list(
            seg.source_index)
        assert rows == want, seg.hook.name
        assert [(s.start, s.end) for s in plan.slices(seg)] == [
            (layout.starts[i], layout.starts[i] + 1) for i in want]
    assert len(plan.segments) == (2 if want else 0)


def test_one_further_means_every_value_exactly_one_more_in_order() -> None:
    from dmi_sglang.domain.layout import one_further

    assert one_further([5, 8, 2], (4, 7, 1))
    assert one_further([], ())
    assert not one_further([5, 9, 2], [4, 7, 1])  # one of them two further
    assert not one_further([5, 8], [4, 7, 1])  # a request left
    assert not one_further([4, 7, 1], [4, 7, 1])  # not moved
    assert not one_further([5, 8, 3], [4, 7, 1])  # the same sum, not every one moved


def test_a_decode_layout_follows_the_one_before_it_by_run_or_by_positions() -> None:
    """``follows``: the next decode forward of the same requests, each one position
    further; a layout moved on from another follows it by its run number and step,
    any other pair is compared position by position."""
    first = BatchLayout.decode(["a", "b"], [4, 9])
    moved = first.moved_on()
    assert moved.positions() == [("a", 4), ("b", 9)]
    assert moved.follows(first)
    assert moved.moved_on().follows(moved)
    assert not first.follows(moved)
    assert not moved.moved_on().follows(first)
    assert moved.with_padding(8).follows(first.with_padding(8))
    assert moved == BatchLayout.decode(["a", "b"], [5, 10])  # compared by positions
    twice = moved.moved_on().moved_on()
    assert twice.starts == (6, 11)
    assert twice.starts is twice.starts  # computed when first read, then kept
    assert twice.moved_on().positions() == [("a", 7), ("b", 12)]
    fresh = BatchLayout.decode(["a", "b"], [5, 10])  # another run: by positions
    assert fresh.run != first.run
    assert fresh.follows(first)
    assert not fresh.follows(moved)
    assert moved.moved_on_from(first)
    assert moved.with_padding(8).moved_on_from(first)
    assert not fresh.moved_on_from(first)  # it follows, by positions only
    assert not moved.moved_on().moved_on_from(first)
    assert not first.moved_on_from(moved)
    assert not BatchLayout.decode(["a", "c"], [5, 10]).follows(first)  # other requests
    assert not BatchLayout.extend(["a", "b"], [4, 9], [1, 1]).follows(first)  # not decode


@given(extend_layouts(), selections(), st.data())
def test_a_part_of_a_plan_is_its_segments_placed_apart(layout: BatchLayout, sel: Selection,
                                                       data: st.DataObject) -> None:
    plan = make_plan(layout, sel, SHAPE, padded=False)
    segs = plan.segments
    assume(segs)
    start = data.draw(st.integers(0, len(segs) - 1))
    room = data.draw(st.integers(0, plan.total_bytes + 64))
    stop = plan.part_stop(start, room)
    sizes = [s.aligned_bytes(plan.alignment) for s in segs]
    assert start < stop <= len(segs)
    assert sum(sizes[start:stop]) <= max(room, sizes[start])
    assert stop == len(segs) or sum(sizes[start : stop + 1]) > room
    part = plan.part(start, stop)
    assert [(s.hook, s.layer_no, s.kept_rows) for s in part.segments] == [
        (s.hook, s.layer_no, s.kept_rows) for s in segs[start:stop]]
    assert part.total_bytes == sum(sizes[start:stop])
    spans = sorted((s.offset, s.offset + s.aligned_bytes(plan.alignment))
                   for s in part.segments)
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # packed, no overlap
    for s in part.segments:
        assert part.segment_for(s.hook.name, s.layer_no) == s
        assert part.slices(s) == plan.slices(segs[start + part.segments.index(s)])


@given(st.lists(st.integers(0, 3), min_size=2, max_size=6), st.booleans())
def test_a_request_without_rows_moves_no_other_requests_rows(counts: list[int],
                                                            skip_last: bool) -> None:
    """An extend may hold a request of 0 tokens: as many rows as requests is then not
    one row each, and no other request's rows (or logits row) move onto its place."""
    rids = [f"r{i}" for i in range(len(counts))]
    layout = BatchLayout.extend(rids, [5] * len(counts), counts)
    skip = frozenset(rids[-1:]) if skip_last else frozenset()
    sel = parse_selection("resid_pre@0,final_logits").resolve(MODEL)
    plan = make_plan(layout, sel, SHAPE, padded=False, skip=skip)
    for name, layer in (("resid_pre", 0), ("final_logits", -1)):
        seg = plan.segment_for(name, layer)
        if seg is None:
            continue
        if seg.hook.row_basis is RowBasis.REQUEST:  # a request's logits row: its last
            source = [(r, s + n - 1) for r, s, n in
                      zip(layout.request_ids, layout.starts, layout.counts, strict=True)]
        else:
            source = layout.positions()
        index = seg.source_index if seg.source_index is not None else range(seg.kept_rows)
        kept = [source[i] for i in index]
        named = [(sl.request_id, p) for sl in plan.slices(seg) for p in range(sl.start, sl.end)]
        assert kept == named, (name, counts)
        assert not any(rid in skip for rid, _ in kept)


def test_a_request_without_rows_has_no_logits_row() -> None:
    layout = BatchLayout.extend(["a", "b", "c"], [0, 0, 5], [2, 0, 1])
    assert not layout.is_uniform_decode
    plan = make_plan(layout, parse_selection("final_logits").resolve(MODEL), SHAPE,
                     padded=False)
    seg = plan.segment_for("final_logits", -1)
    assert seg is not None
    assert (seg.kept_rows, seg.source_index) == (2, (0, 2))  # a's and c's rows, not b's
