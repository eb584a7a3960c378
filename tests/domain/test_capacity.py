"""Ring accounting, preflight and the startup refusal."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dmi_sglang.domain.capacity import (
    MIB,
    RING_MB_MAX,
    Decision,
    RingAllocator,
    RingCapacity,
    RingUsage,
    arena_bytes,
    check_ring_fits,
    chunks_held,
    largest_capture_bytes,
    prefill_ring_bytes,
    preflight,
    ring_advice,
)
from dmi_sglang.domain.hooks import Selection, parse_selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import DEFAULT_ALIGNMENT, make_plan
from dmi_sglang.errors import CapacityError

from .strategies import MODEL, SHAPE, decode_layouts, extend_layouts, selections

capacities = st.builds(
    RingCapacity,
    payload_bytes=st.integers(1, 200_000),
    pinned_bytes=st.integers(1, 200_000),
    task_entries=st.integers(1, 400),
)


def _usage(capacity: RingCapacity, fraction: float, entries: float) -> RingUsage:
    return RingUsage(
        int(capacity.effective_bytes * fraction), int(capacity.task_entries * entries)
    )


@given(decode_layouts(), selections(), capacities, st.floats(0, 1), st.floats(0, 1),
       st.booleans())
def test_preflight_of_graph_steps(layout: BatchLayout, sel: Selection, cap: RingCapacity,
                                  frac: float, ent: float, strip: bool) -> None:
    padded = make_plan(layout, sel, SHAPE, padded=True, strip=strip)
    eager = make_plan(layout, sel, SHAPE, padded=False)
    usage = _usage(cap, frac, ent)
    result = preflight(padded, usage, cap, eager_plan=eager)
    if result.decision is Decision.FITS:
        # never admits a step beyond free capacity
        assert padded.total_bytes <= usage.free_bytes
        assert padded.entries <= usage.free_entries
    else:
        assert not usage.admits(padded)
    if result.decision is Decision.RUN_EAGER:
        # only when the padded step does not fit: the unpadded one fits now, or the
        # padded one could not fit even an empty ring
        assert usage.admits(eager) or not cap.empty().admits(padded)
    if result.decision is Decision.WAIT_FOR_DRAIN:
        assert cap.empty().admits(padded)
    assert result.decision is not Decision.PIECEWISE


@given(extend_layouts(), selections(), capacities, st.floats(0, 1), st.floats(0, 1))
def test_preflight_of_eager_steps(layout: BatchLayout, sel: Selection, cap: RingCapacity,
                                  frac: float, ent: float) -> None:
    plan = make_plan(layout, sel, SHAPE, padded=False)
    usage = _usage(cap, frac, ent)
    result = preflight(plan, usage, cap)
    assert result.decision in (Decision.FITS, Decision.PIECEWISE)
    assert (result.decision is Decision.FITS) == usage.admits(plan)
    assert result.reason


def test_run_eager_when_only_the_unpadded_step_fits() -> None:
    sel = parse_selection("resid_pre").resolve(MODEL)
    layout = BatchLayout.decode(["a"], [3], padded_batch_size=64)
    padded = make_plan(layout, sel, SHAPE, padded=True, strip=False)
    eager = make_plan(layout, sel, SHAPE, padded=False)
    cap = RingCapacity(1 << 20, 1 << 20, 100)
    usage = RingUsage(eager.total_bytes, 100)
    result = preflight(padded, usage, cap, eager_plan=eager)
    assert result.decision is Decision.RUN_EAGER
    assert "unpadded step" in result.reason
    waiting = preflight(padded, RingUsage(eager.total_bytes - 1, 100), cap, eager_plan=eager)
    assert waiting.decision is Decision.WAIT_FOR_DRAIN


@given(selections(), st.integers(1, 9000), st.integers(1, 300), st.integers(1, 10_000_000))
def test_startup_refusal_only_when_one_tensor_exceeds_the_ring(
    sel: Selection, token_rows: int, request_rows: int, ring: int
) -> None:
    cap = RingCapacity(ring, ring, 10)
    size, hook = largest_capture_bytes(
        sel, SHAPE, max_token_rows=token_rows, max_request_rows=request_rows
    )
    assert hook in sel.names
    if size > ring:
        with pytest.raises(CapacityError, match=f"{size} bytes"):
            check_ring_fits(cap, sel, SHAPE, max_token_rows=token_rows,
                            max_request_rows=request_rows)
    else:
        check_ring_fits(cap, sel, SHAPE, max_token_rows=token_rows,
                        max_request_rows=request_rows)


def test_long_prompt_with_default_ring_is_not_refused() -> None:
    """A 1 GiB ring takes Qwen3-8B sglang-full with 8192-token prefill chunks."""
    from dmi_sglang.domain.hooks import ModelHooks
    from dmi_sglang.domain.shapes import ModelShape

    shape = ModelShape(36, 4096, 32, 8, 128, 12288, 151936)
    model = ModelHooks("Qwen3ForCausalLM", MODEL.hooks, 36)
    sel = parse_selection("sglang-full").resolve(model)
    cap = RingCapacity.from_mb(1024, 1024, 65536)
    check_ring_fits(cap, sel, shape, max_token_rows=8192, max_request_rows=256)
    with pytest.raises(CapacityError, match=r"DMX_RING_PAYLOAD_MB=16 .*'mlp_post'"):
        check_ring_fits(RingCapacity.from_mb(16, 1024, 65536), sel, shape,
                        max_token_rows=8192, max_request_rows=256)


def test_arena_counts_every_capture_at_the_largest_batch() -> None:
    sel = parse_selection("resid_pre").resolve(MODEL)
    assert arena_bytes(sel, SHAPE, max_graph_batch=8) == 3 * 8 * 24 * 2


@given(st.integers(16, 4096), st.lists(st.tuples(st.booleans(), st.integers(0, 1500)),
                                       max_size=80))
def test_ring_allocator_never_overlaps(capacity: int, ops: list[tuple[bool, int]]) -> None:
    ring = RingAllocator(capacity, 16)
    live: list[tuple[int, int]] = []
    for is_reserve, size in ops:
        if is_reserve or not live:
            before = ring.usage()
            offset = ring.reserve(size)
            if offset is None:
                assert size > before.free_bytes or before.free_entries == 0
                continue
            assert size <= before.free_bytes
            assert offset >= 0
            assert offset + size <= capacity
            for o, n in live:
                assert offset + size <= o or o + n <= offset or size == 0 or n == 0
            live.append((offset, size))
        else:
            ring.release()
            live.pop(0)
        assert ring.used_bytes <= capacity
        assert ring.used_bytes >= sum(n for _, n in live)
        assert ring.used_entries == len(live)
    while live:
        ring.release()
        live.pop(0)
    assert ring.usage() == RingUsage(capacity, 16)


@given(st.integers(64, 4096), st.lists(st.integers(1, 64), min_size=1, max_size=200))
def test_ring_allocator_fifo_always_progresses(capacity: int, sizes: list[int]) -> None:
    """Releasing the oldest region eventually admits any region no larger than the ring."""
    assume(max(sizes) <= capacity)
    ring = RingAllocator(capacity, 8)
    for size in sizes:
        while ring.reserve(size) is None:
            ring.release()
    assert ring.high_water <= capacity


def test_ring_allocator_errors() -> None:
    with pytest.raises(CapacityError):
        RingAllocator(0, 1)
    ring = RingAllocator(10, 1)
    with pytest.raises(CapacityError, match="release without"):
        ring.release()
    assert ring.reserve(11) is None
    assert ring.reserve(4) == 0
    assert ring.reserve(1) is None  # out of entries


def test_a_prefill_chunk_takes_every_position_of_every_layer() -> None:
    sel = parse_selection("resid_pre").resolve(MODEL)
    row, align = SHAPE.hidden * 2, DEFAULT_ALIGNMENT  # bf16 rows, each capture aligned
    for tokens in (1, 7, 300):
        want = SHAPE.num_layers * -(-tokens * row // align) * align
        assert prefill_ring_bytes(sel, SHAPE, tokens) == want
    # the ``last`` rule keeps its rows in slots of its own: nothing in the ring
    assert prefill_ring_bytes(parse_selection("resid_pre:last").resolve(MODEL), SHAPE,
                              300) == 0


@given(selections(), st.integers(1, 400), st.integers(1, 400))
def test_a_longer_prefill_never_takes_less_ring(sel: Selection, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert prefill_ring_bytes(sel, SHAPE, lo) <= prefill_ring_bytes(sel, SHAPE, hi)


@given(capacities, st.integers(0, 10 << 30))
def test_the_ring_advice_holds_two_chunks_in_whole_gib(cap: RingCapacity, chunk: int) -> None:
    advised = ring_advice(cap, chunk)
    if chunk <= cap.effective_bytes:
        assert advised is None
        return
    assert advised is not None
    assert advised % 1024 == 0
    assert 2 * chunk <= advised * MIB < 2 * chunk + 1024 * MIB


def test_the_ring_advice_stays_within_what_the_settings_accept() -> None:
    ring = RingCapacity.from_mb(1024, 1024, 64)
    assert ring_advice(ring, 84 * 10**9) == RING_MB_MAX  # 168 GB for two: the most
    largest = RingCapacity.from_mb(RING_MB_MAX, RING_MB_MAX, 64)
    assert ring_advice(largest, 200 * 10**9) is None  # nothing larger to advise


@given(st.integers(1, 64), st.integers(0, 200), st.integers(0, 64), st.integers(0, 200))
def test_no_chunk_of_one_request_takes_more_than_prefill_ring_bytes(
        tokens: int, first: int, width: int, prefix: int) -> None:
    """The advice's chunk bound holds for a positions(A-B) rule whatever the chunk's
    start (a bound planned from position 0 alone said 0 bytes for positions(5000-9000))."""
    sel = parse_selection(
        f"resid_pre:positions({first}-{first + width}),final_logits").resolve(MODEL)
    chunk = make_plan(BatchLayout.extend(["r"], [prefix], [tokens]), sel, SHAPE,
                      padded=False, prompts=lambda _rid: prefix + tokens)
    assert chunk.total_bytes <= prefill_ring_bytes(sel, SHAPE, tokens)


def test_a_last_rule_selection_is_not_refused_for_rows_it_never_puts_in_the_ring() -> None:
    """``last`` rows wait in slots of their own (its reads are sized apart); ``last_prompt``
    keeps one row per request a forward: a 16 MiB ring takes either at 16,384 prefill
    tokens (both were refused, with advice to take 32 MiB)."""
    from .test_bandwidth import HOOKS, QWEN3_06B

    ring = RingCapacity.from_mb(16, 16, 65536)
    for text in ("resid_pre:last", "resid_pre:last_prompt"):
        sel = parse_selection(text).resolve(HOOKS)
        check_ring_fits(ring, sel, QWEN3_06B, max_token_rows=16384, max_request_rows=256)
    with pytest.raises(CapacityError):
        check_ring_fits(ring, parse_selection("resid_pre").resolve(HOOKS), QWEN3_06B,
                        max_token_rows=16384, max_request_rows=256)


def test_the_ring_advice_never_names_a_ring_smaller_than_one_chunk() -> None:
    ring = RingCapacity.from_mb(1024, 1024, 64)
    assert ring_advice(ring, 200 * 10**9) is None  # beyond RING_MB_MAX: a smaller chunk
    advised = ring_advice(ring, 100 * 10**9)  # one chunk fits the largest ring, two do not
    assert advised == RING_MB_MAX
    assert chunks_held(advised, 100 * 10**9) == "one chunk"
    assert chunks_held(4096, 10**9) == "two chunks"


@pytest.mark.parametrize(("text", "prefix", "tokens"), [
    ("final_logits:last_prompt", 0, 8),
    ("final_logits:every(2)", 1, 2),
    ("final_logits:positions(10)", 7, 4),
])
def test_no_chunk_of_one_request_takes_more_than_prefill_ring_bytes_request_rows(
        text: str, prefix: int, tokens: int) -> None:
    """A prompt's last chunk keeps its request row under these rules; the chunk planned
    with a one-token prompt never kept it, so the chunk's size read 0."""
    sel = parse_selection(text).resolve(MODEL)
    chunk = make_plan(BatchLayout.extend(["r"], [prefix], [tokens]), sel, SHAPE,
                      padded=False, prompts=lambda _rid: prefix + tokens)
    assert chunk.total_bytes > 0
    assert chunk.total_bytes <= prefill_ring_bytes(sel, SHAPE, tokens)


def test_a_huge_prefill_chunk_under_a_position_rule_is_sized_at_once() -> None:
    """It was planned row by row: ten billion positions took about 100 GB of memory."""
    sel = parse_selection("resid_pre:every(2)").resolve(MODEL)
    per_row = SHAPE.capture_row(sel, *sel.captures()[0]).nbytes
    total = prefill_ring_bytes(sel, SHAPE, 10**10)
    assert total == len(sel.captures()) * (5 * 10**9 * per_row)
