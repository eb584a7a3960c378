"""How a group's kept rows are cut into chunks (:func:`spans`) and a segment's request
slices into the parts a chunk holds (:func:`clip`)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmi_sglang.adapters.transport._pool import PayloadPool
from dmi_sglang.adapters.transport._records import clip, spans
from dmi_sglang.domain.plan import RecordSlice
from dmi_sglang.errors import CaptureError


@st.composite
def _segments(draw: st.DrawFn) -> tuple[list[RecordSlice], int]:
    """A segment's request slices, in row order: per request a run of consecutive
    positions or (a strided rule) one-row slices; rows outside every slice between
    them. Returns the slices and the segment's kept rows."""
    slices, at = [], 0
    for i in range(draw(st.integers(1, 6))):
        at += draw(st.integers(0, 3))  # rows no slice keeps
        start = draw(st.integers(0, 100))
        n = draw(st.integers(1, 40))
        if draw(st.booleans()):
            slices.append(RecordSlice(f"r{i}", at, n, start, start + n))
            at += n
        else:
            stride = draw(st.integers(2, 8))
            for k in range(min(n, 8)):
                p = start + k * stride
                slices.append(RecordSlice(f"r{i}", at, 1, p, p + 1))
                at += 1
    return slices, at + draw(st.integers(0, 3))


def _cut(kept: int, rb: int, count: int, slab: int) -> tuple[list, PayloadPool]:
    """The spans of a group, each chunk allocated from a real pool as the drain does
    (and kept, as the batches over them are until the sink took them)."""
    pool = PayloadPool(slab_bytes=slab)
    group = SimpleNamespace(kept_rows=kept, row_nbytes=rb, count=count)
    out, chunks = [], []
    for sp in spans(group, pool):
        chunks.append(pool.alloc((sp.s1 - sp.s0) * (sp.r1 - sp.r0) * rb))
        out.append(sp)
    return out, pool


@given(kept=st.integers(0, 200), rb=st.integers(1, 64), count=st.integers(1, 4),
       slab=st.integers(1, 4096))
def test_spans_cover_every_row_once_within_a_slab(kept, rb, count, slab):
    cut, _ = _cut(kept, rb, count, slab)
    covered = []
    for sp in cut:
        rows, nseg = sp.r1 - sp.r0, sp.s1 - sp.s0
        assert nseg == 1 or (sp.r0, sp.r1) == (0, kept)  # whole segments, or rows of one
        assert nseg * rows * rb <= slab or (nseg == 1 and rows == 1 and rb > slab) or (
            kept == 0)
        covered += [(s, r) for s in range(sp.s0, sp.s1) for r in range(sp.r0, sp.r1)]
    assert covered == [(s, r) for s in range(count) for r in range(kept)]


def test_runs_of_wide_segments_pack_the_slabs():
    """Each run fills what the slab being filled has left: 28 segments of 1.5 slabs
    take 42 slabs (runs of whole slabs only: 56)."""
    rb, slab = 96, 512 * 1024
    kept = slab * 3 // 2 // rb
    _, pool = _cut(kept, rb, 28, slab)
    assert pool.allocated <= math.ceil(28 * kept * rb / slab) + 1
    assert pool.oversized == 0


@given(_segments(), st.integers(1, 64), st.integers(1, 4096))
def test_clipped_parts_keep_each_row_s_request_and_position(segment, rb, slab):
    slices, kept = segment
    want = {sl.row_offset + k: (sl.request_id, sl.start + k)
            for sl in slices for k in range(sl.rows)}
    got = {}
    for sp in _cut(kept, rb, 1, slab)[0]:
        at = -1
        for part in clip(slices, sp.r0, sp.r1):
            assert part.row_offset > at  # in row order, inside the chunk
            assert part.row_offset + part.rows <= sp.r1 - sp.r0
            at = part.row_offset + part.rows - 1
            for k in range(part.rows):
                got[sp.r0 + part.row_offset + k] = (part.request_id, part.start + k)
    assert got == want


def test_a_slice_whose_rows_are_not_its_positions_is_refused():
    with pytest.raises(CaptureError, match="3 rows over positions"):
        clip([RecordSlice("a", 0, 3, 0, 9)], 0, 2)


@pytest.mark.parametrize("direct_bytes", [0, 1, 100 << 20, 205 << 20, (205 << 20) + 1,
                                          300 << 20, 410 << 20, 700 << 20, 1 << 30, 7 << 30])
def test_the_direct_pool_slab_is_a_power_of_two_whose_reserve_stays_within_its_share(
        direct_bytes: int) -> None:
    """Torch rounds page-locked blocks up to a power of two (a slab of any other size
    would pin up to twice what it holds); the pool reserves 1.25 x the largest direct
    item and at least eight slabs, so slabs above the default keep eight within that."""
    from dmi_sglang.adapters.transport._drain import (
        DIRECT_MIN_SLABS,
        DIRECT_SLAB_MAX,
        direct_slab_bytes,
    )

    slab = direct_slab_bytes(direct_bytes)
    assert PayloadPool.SLAB_BYTES <= slab <= DIRECT_SLAB_MAX
    assert slab & (slab - 1) == 0
    share = direct_bytes * 5 // 4
    if slab > PayloadPool.SLAB_BYTES:
        assert DIRECT_MIN_SLABS * slab <= share
    if slab < DIRECT_SLAB_MAX:
        assert DIRECT_MIN_SLABS * 2 * slab > share  # the largest such power of two
