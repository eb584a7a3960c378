"""How a group's kept rows are cut into chunks (:func:`spans`) and a segment's request
slices into the parts a chunk holds (:func:`clip`)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from dmi_sglang.adapters.transport._records import clip, spans
from dmi_sglang.domain.plan import RecordSlice


@st.composite
def _segments(draw: st.DrawFn) -> tuple[list[RecordSlice], int, int, int, int]:
    """Tiling request slices of a segment, its row bytes, segment count and a slab."""
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    slices, at = [], 0
    for i, n in enumerate(lengths):
        start = draw(st.integers(0, 100))
        slices.append(RecordSlice(f"r{i}", at, n, start, start + n))
        at += n
    row_bytes = draw(st.integers(1, 64))
    count = draw(st.integers(1, 4))
    slab = draw(st.integers(1, 4 * at * row_bytes))
    return slices, at, row_bytes, count, slab


@given(_segments())
def test_spans_cover_every_row_once_within_a_slab(case):
    _, kept, rb, count, slab = case
    group = SimpleNamespace(kept_rows=kept, row_nbytes=rb, count=count)
    covered = []
    for sp in spans(group, slab):
        rows = sp.r1 - sp.r0
        assert rows > 0
        assert (sp.s1 - sp.s0) * rows * rb <= slab or rows == 1  # a row wider than a slab
        assert sp.s1 - sp.s0 == 1 or (sp.r0, sp.r1) == (0, kept)  # whole segments only
        covered += [(s, r) for s in range(sp.s0, sp.s1) for r in range(sp.r0, sp.r1)]
    assert covered == [(s, r) for s in range(count) for r in range(kept)]


@given(_segments())
def test_clipped_parts_keep_each_slice_s_positions_in_order(case):
    slices, kept, rb, count, slab = case
    group = SimpleNamespace(kept_rows=kept, row_nbytes=rb, count=count)
    positions: dict[str, list[int]] = {}
    for sp in spans(group, slab):
        if sp.s0 != 0:
            continue
        at = 0
        for part in clip(slices, sp.r0, sp.r1):
            assert part.row_offset == at  # parts tile the chunk's rows
            assert part.end - part.start == part.rows
            positions.setdefault(part.request_id, []).extend(range(part.start, part.end))
            at += part.rows
        assert at == sp.r1 - sp.r0
    assert positions == {sl.request_id: list(range(sl.start, sl.end)) for sl in slices}
