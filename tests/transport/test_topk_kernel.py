"""``fused_topk`` (``DMX_TOPK_KERNEL``) finds what ``torch.topk`` finds, under Triton's
interpreter on CPU, and compiles for the H100/H200; where it does not fit or work the
transport refuses the setting when it is made."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.transport import topk_kernel
from dmi_sglang.adapters.transport.topk_kernel import fits, fused_topk
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.errors import UnsupportedConfigurationError

from .conftest import INTERPRETED, assert_topk3_of, run_interpreted_tests, two_requests
from .test_topk import _same_as_torch, _tied_logits

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="run by test_the_kernel_under_the_triton_interpreter, in a "
                             "process of its own with Triton's interpreter chosen")


@st.composite
def kernel_cases(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    """Rows the kernel takes: a power-of-two chunk, at least K (k rounded up to a power
    of two) whole chunks and more than 2k, a tail of any width."""
    k = draw(st.integers(1, 9))
    chunk = 1 << draw(st.integers(0, 3))
    rounded = max(2, 1 << (k - 1).bit_length())
    groups = max(2 * k + 1, rounded) + draw(st.integers(0, 5))
    width = groups * chunk + draw(st.integers(0, chunk - 1))
    return _tied_logits(draw, draw(st.integers(1, 3)), width), k, chunk


@interpreted
@settings(max_examples=60, deadline=None)
@given(kernel_cases())
def test_interpreted_the_kernel_finds_torch_topk_values(
        case: tuple[torch.Tensor, int, int]) -> None:
    logits, k, chunk = case
    assert fits(logits.shape[1], k, chunk)
    _same_as_torch(logits, k, chunk, select=fused_topk)


@interpreted
@pytest.mark.parametrize(("width", "k", "chunk"), [
    (151936, 64, 128),  # Qwen3's vocabulary in 1,187 whole chunks: topk(64)'s default
    (1000, 8, 16),      # 62 chunks and a tail of 8
    (1000, 5, 32),      # 31 chunks, K rounded up to 8, a tail of 8
])
def test_interpreted_the_kernel_on_wide_rows(width: int, k: int, chunk: int) -> None:
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(width + chunk))
    logits[1, -5:] = 50.0  # the largest values in the last columns (the tail)
    logits[2, 200:200 + k] = 40.0 + torch.arange(float(k))  # in a few neighbouring chunks
    logits[3, ::chunk] = 30.0  # every chunk's maximum ties
    _same_as_torch(logits, k, chunk, select=fused_topk)


@interpreted
def test_interpreted_a_strided_row_view_is_read_in_place() -> None:
    wide = torch.randn(3, 1030, generator=torch.Generator().manual_seed(1))
    wide[:, 1000:] = 99.0  # beyond the row: never a candidate
    _same_as_torch(wide[:, :1000], 8, 16, select=fused_topk)
    _same_as_torch(wide[:0, :1000], 8, 16, select=fused_topk)  # no rows: nothing launched


@interpreted
def test_interpreted_the_kernel_warms_up_and_checks_itself() -> None:
    assert topk_kernel.warm_up(torch.device("cpu"), 1000, 8, 16) is None
    assert topk_kernel.warm_up(torch.device("cpu"), 1000, 8, 16, dtype=torch.bfloat16,
                               batches=(3, 12)) is None


@interpreted
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_interpreted_a_capture_with_the_kernel_stores_torch_topk_of_its_logits(
        make_driver, padded: bool) -> None:
    """The transport with ``DMX_TOPK_KERNEL`` (each of the 10 logits a chunk): the rows
    stored are ``torch.topk`` of the logits a full capture stores."""
    full, full_sink = make_driver("final_logits")
    some, some_sink = make_driver("final_logits:topk(3)", topk_chunk=1, topk_kernel="triton")
    for d in (full, some):
        two_requests(d, padded=padded)
        d.t.stop()
    some.verify(some_sink.records)
    assert_topk3_of(full_sink.records, some_sink.records)


def test_the_kernel_under_the_triton_interpreter() -> None:
    """The tests above, in a pytest process of its own with Triton's interpreter chosen
    before Triton is imported."""
    run_interpreted_tests(__file__, timeout_s=900)


def test_the_kernel_compiles_for_the_h100_and_h200() -> None:
    """The kernel as the GPU's compiler sees it (the interpreter checks less) for
    ``topk(64)`` over Qwen3's float32 logits at the default chunk width, with the warps
    :func:`fused_topk` launches it with."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("compiles the real kernel: not under the interpreter")
    assert topk_kernel.launch_constants(151936, 64, 128) == {
        "chunk": 128, "rounded": 64, "slots": 2048, "num_warps": 16}
    for dtype in (torch.float32, torch.bfloat16):
        compiled = topk_kernel.compile_for(151936, 64, 128, dtype)
        assert compiled.asm["cubin"], dtype
        assert compiled.metadata.num_warps == 16


@pytest.mark.parametrize(("width", "k", "chunk", "fit"), [
    (151936, 64, 128, True),    # topk(64)'s default: 64 x 128 candidates, 1,187 maxima
    (151936, 64, 256, False),   # 64 x 256 candidates: more than one program holds
    (151936, 50, 128, True),    # K rounded up to 64
    (151936, 64, 100, False),   # not a power of two
    (151936, 64, 0, False),     # no chunks
    (151936, 64, 16, False),    # 9,496 maxima: more than one program holds
    (1000, 64, 8, False),       # k chunks are half the row: torch.topk's case
    (10, 3, 1, True),           # 10 chunks of one column, K = 4
    (10, 6, 1, False),          # k chunks of one column are more than half the row
    (10, 11, 1, False),         # k beyond the row
])
def test_which_shapes_the_kernel_takes(width: int, k: int, chunk: int, fit: bool) -> None:
    assert fits(width, k, chunk) is fit


@pytest.mark.parametrize(("logits", "k", "chunk", "says"), [
    (torch.zeros(10), 3, 1, "logits of shape (10,) and strides (1,); expected [rows, "
                            "columns] with contiguous rows"),
    (torch.zeros(10, 4).t(), 3, 1, "logits of shape (4, 10) and strides (1, 4); expected "
                                   "[rows, columns] with contiguous rows"),
    (torch.zeros(2, 10), 3, 3, "k=3, chunk=3 over 10 columns; expected a power-of-two "
                               "chunk width, more than k whole chunks a row and at least K "
                               "(k rounded up to a power of two, at least 2), k chunks at "
                               "most half the row, at most 8192 candidate columns (K chunks) "
                               "and at most 8192 chunk maxima (rounded up to a power of two)"),
])
def test_bad_arguments_are_refused(logits: torch.Tensor, k: int, chunk: int,
                                   says: str) -> None:
    with pytest.raises(ValueError, match=r"^fused_topk: ") as err:
        fused_topk(logits, k, chunk)
    assert str(err.value) == f"fused_topk: {says}"


@pytest.mark.parametrize(("chunk", "says"), [
    (3, "the kernel needs a power-of-two chunk width"),
    (1, "the top-k kernel does not work on cpu"),  # no GPU, no interpreter
])
def test_the_transport_refuses_the_kernel_where_it_does_not_fit_or_work(
        make_driver, chunk: int, says: str) -> None:
    if INTERPRETED and chunk == 1:
        pytest.skip("the interpreter makes the kernel work on CPU")
    with pytest.raises(UnsupportedConfigurationError) as err:
        make_driver("final_logits:topk(3)", topk_chunk=chunk, topk_kernel="triton")
    text = str(err.value)
    assert f"DMX_TOPK_KERNEL=triton (topk(3) over 10 logits, DMX_TOPK_CHUNK={chunk})" in text
    assert says in text
    assert "DMX_TOPK_KERNEL=none" in text  # what to do instead


@pytest.mark.parametrize("kernel", ["triton", "flashinfer"])
def test_the_setting_does_nothing_without_a_top_k(make_driver, kernel: str) -> None:
    """Neither kernel is checked (nor imported) where no capture selects a top-k: with
    ``chunk`` 3 the Triton kernel does not fit, and FlashInfer need not be installed."""
    d, sink = make_driver("final_logits", topk_chunk=3, topk_kernel=kernel)
    d.forward(BatchLayout.extend(["a"], [0], [2]))
    d.t.stop()
    d.verify(sink.records)
