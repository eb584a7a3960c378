"""The drain's device-to-host copies in bounded pieces (``DMX_DRAIN_COPY_PIECE_MB``)."""

from __future__ import annotations

from typing import Any

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from dmi_sglang.adapters.transport import _device, kernel_copy
from dmi_sglang.adapters.transport._device import DeviceOps, _pieces
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.errors import UnsupportedConfigurationError

from .conftest import INTERPRETED, run_interpreted_tests


def _filled(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.int64).to(dtype).reshape(shape)


@pytest.mark.parametrize(("shape", "dtype", "piece", "expected"), [
    ((10, 3), torch.int16, 13, 5),   # 6-byte rows: two a piece
    ((2, 8), torch.int32, 10, 8),    # 32-byte rows larger than a piece: 2 elements a piece
    ((100,), torch.uint8, 0, 1),     # 0: whole
    ((100,), torch.uint8, 100, 1),   # fits
    ((100,), torch.uint8, 99, 2),
])
def test_a_copy_goes_in_pieces_of_at_most_the_setting(shape, dtype, piece, expected) -> None:
    ops = DeviceOps("cpu", copy_piece_bytes=piece)
    src = _filled(shape, dtype)
    dst = torch.zeros_like(src)
    ops.to_host(dst, src)
    assert torch.equal(dst, src)
    assert ops.copy_pieces == expected


def test_a_broadcasting_copy_goes_whole() -> None:
    ops = DeviceOps("cpu", copy_piece_bytes=4)
    dst = torch.zeros(8, 16, dtype=torch.uint8)
    ops.to_host(dst, torch.arange(16, dtype=torch.uint8))
    assert ops.copy_pieces == 1
    assert torch.equal(dst[7], torch.arange(16, dtype=torch.uint8))


def test_negative_limits_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^copy_piece_bytes -1: expected >= 0"):
        DeviceOps("cpu", copy_piece_bytes=-1)
    with pytest.raises(ValueError, match=r"^copies_ahead -2: expected >= 0"):
        DeviceOps("cpu", copies_ahead=-2)


@pytest.fixture
def pending(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU pieces count as not yet done when the drain looks (as on a busy copy engine)."""
    monkeypatch.setattr(_device._Done, "query", lambda self: False)


@pytest.mark.usefixtures("pending")
@pytest.mark.parametrize(("ahead", "waits"), [(0, 0), (1, 6), (2, 5), (7, 0), (9, 0)])
def test_at_most_the_limit_of_pieces_is_queued_ahead(ahead: int, waits: int) -> None:
    ops = DeviceOps("cpu", copy_piece_bytes=16, copies_ahead=ahead)
    src = _filled((100,), torch.uint8)
    dst = torch.zeros_like(src)
    ops.to_host(dst, src)  # 7 pieces: the oldest waited for once `ahead` are queued
    assert torch.equal(dst, src)
    assert (ops.copy_pieces, ops.ahead_waits) == (7, waits)
    ops.to_host(dst[:16], src[:16])  # the limit holds across copies
    assert ops.ahead_waits == waits + (1 if ahead and ahead <= 7 else 0)


def test_a_piece_already_done_is_not_waited_for() -> None:
    ops = DeviceOps("cpu", copy_piece_bytes=16, copies_ahead=1)
    ops.to_host(torch.zeros(100, dtype=torch.uint8), _filled((100,), torch.uint8))
    assert (ops.copy_pieces, ops.ahead_waits) == (7, 0)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       itemsize=st.sampled_from([1, 2, 4, 8]), piece=st.integers(0, 300))
def test_pieces_cover_the_copy_once_and_stay_within_the_limit(shape, itemsize, piece) -> None:
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    src = _filled(tuple(shape), dtype)
    src[src == 0] = 1  # no zero byte copied: a zero in dst is one not yet covered
    dst = torch.zeros_like(src)
    parts = list(_pieces(dst, src, piece))
    for d, s in parts:
        assert d.shape == s.shape
        assert d.numel() * itemsize <= max(piece, itemsize) or not piece
        assert not bool(d.ne(0).any())  # no byte is covered twice
        d.copy_(s)
    assert torch.equal(dst, src)  # every byte covered
    assert sum(d.numel() for d, _ in parts) == src.numel()


def _captured_counters(make_driver, decode_steps: int, **options: object) -> dict[str, float]:
    """Two requests prefilled and decoded ``decode_steps`` times through a transport with
    ``options``; every captured byte verified delivered; the drain's counters."""
    d, sink = make_driver("resid_pre,final_logits", max_prefill_tokens=16, **options)
    d.forward(BatchLayout.extend(["a", "b"], [0, 0], [7, 5]))
    for n in range(decode_steps):
        d.forward(BatchLayout.decode(["a", "b"], [8 + n, 6 + n]))
    d.t.stop()
    d.verify(sink.records)
    return d.t.drain_counters()


@pytest.mark.usefixtures("pending")
def test_every_captured_byte_arrives_through_pieces(make_driver) -> None:
    # staging spans, direct items and window flushes all go in pieces of 64 bytes, at
    # most two of them queued
    counts = []
    for piece in (0, 64):
        counters = _captured_counters(make_driver, 6, copy_piece_bytes=piece,
                                      copies_ahead=2 if piece else 0)
        counts.append(counters["d2h_pieces"])
        assert counters["d2h_ahead_waits"] == (counters["d2h_pieces"] - 2 if piece else 0)
    assert 0 < counts[0] < counts[1]




@pytest.mark.skipif(not INTERPRETED, reason="run by the next test, in a process of its own "
                                             "with Triton's interpreter chosen")
@pytest.mark.usefixtures("pending")
@pytest.mark.parametrize("piece", [0, 64])
def test_interpreted_every_captured_byte_arrives_through_kernel_copies(make_driver, piece) -> None:
    counters = _captured_counters(make_driver, 4, copy_piece_bytes=piece,
                                  copies_ahead=2 if piece else 0, copy_kernel_programs=3)
    assert counters["d2h_kernel_copies"] == counters["d2h_pieces"] > 0
    assert counters["d2h_kernel_declined"] == 0


@pytest.mark.skipif(not INTERPRETED, reason="run by the next test, in a process of its own "
                                             "with Triton's interpreter chosen")
def test_interpreted_the_kernel_warms_up_and_checks_itself() -> None:
    kernel_copy.warm_up(torch.device("cpu"), 5)  # compiled, copied, checked: no error


def test_kernel_copies_under_the_triton_interpreter() -> None:
    """The transport with ``DMX_DRAIN_COPY_KERNEL`` on CPU: every device-to-host copy made
    by the copy kernel (Triton's interpreter, chosen before Triton is imported, so in a
    pytest process of its own), every captured byte delivered."""
    run_interpreted_tests(__file__, timeout_s=600)


class _GapCopies(TorchFunctionMode):
    """Counts the copies made into one tensor (the gap's sink), whether by ``copy_`` or
    as a destination of ``torch._foreach_copy_``."""

    def __init__(self, sink: torch.Tensor) -> None:
        super().__init__()
        self.sink = sink
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and args[0] is self.sink:
            self.count += 1
        elif func is torch._foreach_copy_:
            self.count += sum(d is self.sink for d in args[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ahead", [0, 2])
def test_a_gap_kernel_follows_every_piece_of_the_copy_engine(ahead: int) -> None:
    ops = DeviceOps("cpu", copy_piece_bytes=16, copy_gaps=True, copies_ahead=ahead)
    assert ops._gap is not None
    sink, source = ops._gap
    assert not source.is_contiguous()  # a strided copy: a kernel on a GPU, never the engine
    src = _filled((100,), torch.uint8)
    dst = torch.zeros_like(src)
    with _GapCopies(sink) as gaps:
        ops.to_host(dst, src)
        ops.to_host_all([(dst[:10], src[:10])])
    assert torch.equal(dst, src)
    assert ops.copy_pieces == ops.gaps == gaps.count == 8  # each gap a real operation
    assert sink.tolist() == [1, 1]
    assert DeviceOps("cpu", copy_piece_bytes=16).gaps == 0


def test_one_call_queues_every_piece_of_every_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without copies_ahead and the copy kernel, the pieces of all pairs and the gaps
    between them go to the device in one ``torch._foreach_copy_`` call, in order."""
    calls: list[list[int]] = []
    real = torch._foreach_copy_

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], **kw: bool) -> None:
        calls.append([d.numel() for d in dsts])
        real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    ops = DeviceOps("cpu", copy_piece_bytes=16, copy_gaps=True)
    a, b = _filled((40,), torch.uint8), _filled((8,), torch.uint8)
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    ops.to_host_all([(da, a), (db, b)])
    assert calls == [[16, 2, 16, 2, 8, 2, 8, 2]]  # piece, gap, ... of a, then of b
    assert torch.equal(da, a)
    assert torch.equal(db, b)
    ops.to_host_all([])  # nothing to copy: no call
    assert len(calls) == 1


@pytest.mark.usefixtures("pending")
def test_every_captured_byte_arrives_with_gaps_between_pieces(make_driver) -> None:
    counters = _captured_counters(make_driver, 6, copy_piece_bytes=64, copies_ahead=2,
                                  copy_gaps=True)
    assert counters["d2h_gaps"] == counters["d2h_pieces"] > 2


def test_kernel_copies_are_refused_below_zero() -> None:
    with pytest.raises(ValueError, match=r"^copy_kernel_programs -1: expected >= 0 "
                                         r"\(0: the copy engine\)$"):
        DeviceOps("cpu", copy_kernel_programs=-1)


def test_a_copy_the_kernel_cannot_make_goes_to_the_copy_engine_and_is_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    monkeypatch.setattr(_device, "warm_up", lambda device, programs: None)
    monkeypatch.setattr(_device, "kernel_copy",
                        lambda dst, src, programs: (made.append(programs), dst.copy_(src)))
    ops = DeviceOps("cpu", copy_kernel_programs=4)
    src = _filled((8, 16), torch.uint8)
    dst = torch.zeros_like(src)
    with structlog.testing.capture_logs() as logs:
        ops.to_host(dst, src[0])                # broadcast: the copy engine
        assert torch.equal(dst[7], src[0])
        ops.to_host(dst[:, :8], src[:, :8])     # strided: the copy engine
        assert torch.equal(dst[:, :8], src[:, :8])
        ops.to_host(dst, src)                   # contiguous, one shape: the kernel
        assert torch.equal(dst, src)
    assert made == [4]
    assert (ops.copy_pieces, ops.kernel_copies, ops.kernel_declined) == (3, 1, 2)
    declined = [e for e in logs if e["event"] == "dmi.copy_kernel_declined"]
    assert len(declined) == 1  # said once, with why
    assert (declined[0]["same_shape"], declined[0]["nbytes"]) == (False, 16)


def test_kernel_copies_are_refused_at_start_without_a_working_kernel() -> None:
    # no GPU and no interpreter here: the transport refuses the setting when it is made
    if INTERPRETED:
        pytest.skip("the interpreter makes the kernel work on CPU")
    with pytest.raises(UnsupportedConfigurationError, match="DMX_DRAIN_COPY_KERNEL=2"):
        DeviceOps("cpu", copy_kernel_programs=2)


def test_the_copy_kernel_compiles_for_the_h200() -> None:
    """The kernel as the GPU's compiler sees it (Triton's interpreter checks less: a
    kernel it runs may not compile), for every word type, with pointers of unknown and of
    16-byte alignment: a 64-bit loop (a 32-bit one would wrap past 2**31 elements), and
    16-byte loads and stores over the whole blocks of aligned pointers."""
    triton = pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("compiles the real kernel: not under the interpreter")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    for word, size in (("i64", 8), ("i32", 4), ("i16", 2), ("u8", 1)):
        for attrs in (None, aligned):
            source = ASTSource(fn=kernel_copy._compiled(), attrs=attrs,
                               constexprs={"block": kernel_copy.BLOCK_BYTES // size},
                               signature={"src": f"*{word}", "dst": f"*{word}", "n": "i32",
                                          "block": "constexpr"})
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], word
            loops = [ln for ln in compiled.asm["ttir"].splitlines() if "scf.for" in ln]
            assert loops, word
            assert all(ln.rstrip(" {").endswith(": i64") for ln in loops), loops
            vector = [op for op in ("ld.global.v", "st.global.v") if op in compiled.asm["ptx"]]
            assert vector == (["ld.global.v", "st.global.v"] if attrs else []), (word, attrs)


@pytest.mark.parametrize(("broken", "words"), [
    ("import", "ImportError: No module named 'triton'"),
    ("bytes", "RuntimeError: the bytes copied as torch.int64 differ from the source"),
])
def test_a_copy_kernel_that_does_not_work_is_refused_at_start(
        monkeypatch: pytest.MonkeyPatch, broken: str, words: str) -> None:
    def no_triton() -> None:
        raise ImportError("No module named 'triton'")

    if broken == "import":
        monkeypatch.setattr(kernel_copy, "_compiled", no_triton)
    else:  # a kernel that runs and brings nothing
        monkeypatch.setattr(kernel_copy, "kernel_copy", lambda dst, src, programs: None)
    with pytest.raises(UnsupportedConfigurationError) as info:
        kernel_copy.warm_up(torch.device("cpu"), 6)
    assert "DMX_DRAIN_COPY_KERNEL=6" in str(info.value)
    assert words in str(info.value)
    assert "DMX_DRAIN_COPY_KERNEL=0" in str(info.value)  # what to do instead
