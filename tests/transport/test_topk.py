"""``chunked_topk`` finds what ``torch.topk`` finds: the same values, largest first, and
indices that name them, whatever the chunking, ties, infinities and NaN."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.transport.topk import chunked_topk, wait_until

SPECIALS = (float("inf"), float("-inf"), float("nan"))

Select = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


def _tied_logits(draw: st.DrawFn, rows: int, width: int) -> torch.Tensor:
    """``[rows, width]`` logits of few distinct values (many ties, within and across
    chunks), infinities and NaN among them, in one of three dtypes."""
    pool = draw(st.lists(st.sampled_from((*range(-3, 4), *SPECIALS)), min_size=1,
                         max_size=8))
    cells = draw(st.lists(st.sampled_from(pool), min_size=rows * width,
                          max_size=rows * width))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16)))
    return torch.tensor(cells, dtype=torch.float32).view(rows, width).to(dtype)


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    rows = draw(st.integers(1, 4))
    width = draw(st.integers(1, 120))
    logits = _tied_logits(draw, rows, width)
    return logits, draw(st.integers(1, width)), draw(st.integers(0, 40))


@st.composite
def chunked_cases(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    """Rows of more than ``2k`` whole chunks, so the chunk maxima prune (the other cases
    mostly take ``torch.topk`` whole)."""
    k, chunk = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    width = (2 * k + draw(st.integers(1, 6))) * chunk + draw(st.integers(0, chunk - 1))
    return _tied_logits(draw, draw(st.integers(1, 3)), width), k, chunk


def _same_as_torch(logits: torch.Tensor, k: int, chunk: int,
                   select: Select = chunked_topk) -> None:
    values, ids = select(logits, k, chunk)
    expected, _ = torch.topk(logits, k, dim=-1)
    assert values.dtype == logits.dtype
    assert ids.dtype == torch.int64
    assert values.shape == ids.shape == (logits.shape[0], k)
    torch.testing.assert_close(values, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(torch.gather(logits, 1, ids), values, rtol=0, atol=0,
                               equal_nan=True)
    for row in ids.tolist():  # each position named once
        assert len(set(row)) == k


@settings(max_examples=300, deadline=None)
@given(cases())
def test_chunked_topk_equals_torch_topk(case: tuple[torch.Tensor, int, int]) -> None:
    _same_as_torch(*case)


@settings(max_examples=300, deadline=None)
@given(chunked_cases())
def test_the_chunks_with_the_largest_maxima_hold_the_top_k(
        case: tuple[torch.Tensor, int, int]) -> None:
    _same_as_torch(*case)


@pytest.mark.parametrize(("width", "k", "chunk"), [
    (151936, 64, 128),    # Qwen3's vocabulary in 1,187 whole chunks
    (151936, 64, 100),    # 1,519 chunks and a tail of 36 columns
    (1000, 8, 15),        # 66 chunks and a tail of 10
    (1000, 64, 16),       # 62 chunks, no more than k: torch.topk directly
    (1000, 64, 8),        # 125 chunks, but k of them are half the row: torch.topk
])
def test_chunked_topk_on_wide_rows(width: int, k: int, chunk: int) -> None:
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(width + chunk))
    logits[1, -5:] = 50.0  # the largest values in the last columns (the tail)
    logits[2, 200:200 + k] = 40.0 + torch.arange(float(k))  # in a few neighbouring chunks
    logits[3, ::chunk] = 30.0  # every chunk's maximum ties
    _same_as_torch(logits, k, chunk)


@pytest.mark.parametrize(("width", "k", "chunk", "chunked"), [
    (151936, 64, 128, True), (151936, 64, 1187, True), (151936, 64, 1188, False),
    (151936, 64, 2337, False), (1000, 8, 15, True), (1000, 64, 16, False),
    (1000, 64, 8, False), (10, 3, 1, True), (10, 3, 2, False), (10, 3, 0, False),
])
def test_which_rows_the_chunk_maxima_search(monkeypatch: pytest.MonkeyPatch, width: int,
                                            k: int, chunk: int, chunked: bool) -> None:
    """More than ``k`` whole chunks, and ``k`` chunks under half the row: the maxima
    (``amax``) are taken; otherwise ``torch.topk`` runs over the whole row."""
    maxima = []
    amax = torch.Tensor.amax
    monkeypatch.setattr(torch.Tensor, "amax",
                        lambda self, *a, **kw: maxima.append(1) or amax(self, *a, **kw))
    chunked_topk(torch.randn(2, width), k, chunk)
    assert bool(maxima) is chunked


def test_a_strided_row_view_is_chunked_in_place() -> None:
    """Logits sliced out of a wider buffer (SGLang trims padded vocabularies so): the
    chunks are views of the rows' first columns, not of the buffer's."""
    wide = torch.randn(4, 1030, generator=torch.Generator().manual_seed(0))
    wide[:, 1000:] = 99.0  # beyond the row: never a candidate
    _same_as_torch(wide[:, :1000], 16, 30)


@pytest.mark.parametrize(("shape", "k", "chunk", "says"), [
    ((10,), 3, 4, "logits of shape (10,); expected [rows, columns]"),
    ((2, 10), 0, 4, "k=0; expected 1 to the 10 columns"),
    ((2, 10), 11, 4, "k=11; expected 1 to the 10 columns"),
    ((2, 10), 3, -1, "chunk=-1; expected 0 (no chunks) or a positive width"),
])
def test_bad_arguments_are_refused(shape: tuple[int, ...], k: int, chunk: int,
                                   says: str) -> None:
    with pytest.raises(ValueError, match=r"^chunked_topk: ") as err:
        chunked_topk(torch.zeros(shape), k, chunk)
    assert str(err.value) == f"chunked_topk: {says}"


def test_the_chunk_width_defaults_to_the_measured_one_everywhere() -> None:
    """``DMX_TOPK_CHUNK``'s default, the transport's options and ``create_transport``
    agree (a direct user of the transport gets what an engine gets)."""
    import inspect

    from dmi_sglang.adapters.transport import TransportOptions, create_transport
    from dmi_sglang.adapters.transport._options import TOPK_CHUNK
    from dmi_sglang.domain.settings import Settings

    assert TOPK_CHUNK == 128
    assert Settings.from_env({}).topk_chunk == TOPK_CHUNK
    assert TransportOptions().topk_chunk == TOPK_CHUNK
    assert TransportOptions.from_settings().topk_chunk == TOPK_CHUNK
    assert inspect.signature(create_transport).parameters["topk_chunk"].default == TOPK_CHUNK


def test_a_wait_for_the_device_ends_when_done_or_at_its_timeout() -> None:
    """``wait_until``: True as soon as ``done`` says so (no sleep after), False once the
    timeout passed without it (it never waits past the timeout by more than a poll)."""
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    answers = iter([False, False, True])
    assert wait_until(lambda: next(answers), 10.0, poll_s=0.5, clock=lambda: now[0],
                      sleep=sleep)
    assert slept == [0.5, 0.5]
    slept.clear()
    assert not wait_until(lambda: False, 2.0, poll_s=0.5, clock=lambda: now[0], sleep=sleep)
    assert slept == [0.5] * 4
    with pytest.raises(ValueError, match="poll_s=0; expected seconds above 0"):
        wait_until(lambda: True, 1.0, poll_s=0)
