"""``DMX_TOPK_KERNEL=flashinfer``: the start-up check every top-k kernel passes
(``selection_differs``), the transport's refusal where FlashInfer does not work or its
check does not finish, and ``auto``, which takes FlashInfer's where that check passes and
``torch.topk`` otherwise. The selection itself runs on the GPU (``test_transport_gpu.py``)."""

from __future__ import annotations

import importlib.util
import sys
import types

import attrs
import pytest
import structlog.testing
import torch

from dmi_sglang.adapters.transport import topk_flashinfer, topk_kernel
from dmi_sglang.adapters.transport._transport import _auto_topk_kernel
from dmi_sglang.adapters.transport.topk import (
    CheckTimeoutError,
    chunked_topk,
    selection_differs,
)
from dmi_sglang.adapters.transport.topk_flashinfer import flashinfer_topk, warm_up
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import DType
from dmi_sglang.errors import UnsupportedConfigurationError

from .conftest import SHAPE, assert_topk3_of, two_requests

CPU = torch.device("cpu")
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


@pytest.mark.parametrize("chunk", [0, 16])
def test_the_check_passes_torch_topk_and_chunked_topk(chunk: int) -> None:
    assert selection_differs(chunked_topk, CPU, 1000, 8, chunk=chunk) is None
    assert selection_differs(chunked_topk, CPU, 1000, 8, chunk=chunk,
                             dtype=torch.bfloat16) is None


def _ascending(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, k, dim=-1)
    return values.flip(-1), ids.flip(-1)


def _misnamed(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, k, dim=-1)
    return values, (ids + 1) % logits.shape[1]


def _nan_dropped(logits: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(logits.nan_to_num(nan=float("-inf")), k, dim=-1)


@pytest.mark.parametrize(("select", "says"), [
    (_ascending, "its selection differs from torch.topk's"),
    (_nan_dropped, "its selection differs from torch.topk's"),
    (_misnamed, "its columns do not hold the values it returned"),
])
def test_the_check_names_a_selection_that_differs(select, says: str) -> None:
    assert selection_differs(select, CPU, 1000, 8) == f"{says} (over 3 rows)"
    assert selection_differs(select, CPU, 1000, 8, batches=(12,)) == f"{says} (over 12 rows)"


def test_flashinfer_topk_refuses_a_shape_before_it_imports_flashinfer() -> None:
    with pytest.raises(ValueError, match=r"k=11 over logits of shape \(2, 10\)"):
        flashinfer_topk(torch.zeros(2, 10), 11)
    with pytest.raises(ValueError, match=r"shape \(10,\)"):
        flashinfer_topk(torch.zeros(10), 1)


@pytest.mark.skipif(HAS_FLASHINFER, reason="FlashInfer is installed here")
def test_without_flashinfer_the_warm_up_says_why() -> None:
    failed = warm_up(CPU, 1000, 8)
    assert failed is not None
    assert failed.startswith("ModuleNotFoundError")
    assert "flashinfer" in failed


@pytest.mark.skipif(HAS_FLASHINFER, reason="FlashInfer is installed here")
def test_the_transport_refuses_flashinfer_where_it_does_not_work(make_driver) -> None:
    with pytest.raises(UnsupportedConfigurationError) as err:
        make_driver("final_logits:topk(3)", topk_chunk=1, topk_kernel="flashinfer")
    text = str(err.value)
    assert "DMX_TOPK_KERNEL=flashinfer (topk(3) over 10 logits)" in text
    assert "does not work on cpu (ModuleNotFoundError" in text
    assert "DMX_TOPK_KERNEL=none" in text  # what to do instead


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
def test_the_setting_stores_what_flashinfer_top_k_selects(
        make_driver, monkeypatch: pytest.MonkeyPatch, padded: bool) -> None:
    """``DMX_TOPK_KERNEL=flashinfer`` with a stand-in ``flashinfer`` module (its
    ``top_k`` is ``torch.topk``, unsorted unless asked): the transport checks it at
    start-up over 3 rows and over the largest graph batch, calls it sorted, and stores
    ``torch.topk`` of the logits a full capture stores."""
    calls: list[tuple[int, int, bool]] = []

    def top_k(logits: torch.Tensor, k: int, sorted: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((logits.shape[0], k, sorted))
        values, ids = torch.topk(logits, k, dim=-1, sorted=sorted)
        return values, ids

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(top_k=top_k))
    full, full_sink = make_driver("final_logits")
    with structlog.testing.capture_logs() as logs:
        some, some_sink = make_driver("final_logits:topk(3)", topk_kernel="flashinfer",
                                      max_graph_batch=6)
    assert calls == [(3, 3, True), (6, 3, True)]  # the start-up check
    _assert_check_logged(logs, kernel="flashinfer", setting="flashinfer")
    for d in (full, some):
        two_requests(d, padded=padded)
        d.t.stop()
    some.verify(some_sink.records)
    assert_topk3_of(full_sink.records, some_sink.records)
    assert len(calls) > 2
    assert all(wanted_sorted for _, _, wanted_sorted in calls)


def _stand_in_flashinfer(monkeypatch: pytest.MonkeyPatch, *, off_by_one: bool = False,
                         ) -> list[int]:
    """A ``flashinfer`` module whose ``top_k`` is ``torch.topk`` (sorted when asked), or
    names the column after each selected one; the rows of each call, in order."""
    calls: list[int] = []

    def top_k(logits: torch.Tensor, k: int, sorted: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(logits.shape[0])
        values, ids = torch.topk(logits, k, dim=-1, sorted=sorted)
        return values, (ids + 1) % logits.shape[1] if off_by_one else ids

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(top_k=top_k))
    return calls


def _assert_check_logged(logs: list[dict[str, object]], *, kernel: str, setting: str,
                         ) -> None:
    """The check's start is logged before it runs, and its end with the kernel taken
    and the seconds it took (a slow start shows where it waited)."""
    events = [e["event"] for e in logs]
    start = events.index("dmi.topk_kernel_check")
    chosen = [e for e in logs if e["event"] == "dmi.topk_kernel"]
    assert len(chosen) == 1
    assert events.index("dmi.topk_kernel") > start
    assert chosen[0]["kernel"] == kernel
    assert chosen[0]["setting"] == setting
    assert isinstance(chosen[0]["check_seconds"], float)
    assert chosen[0]["check_seconds"] >= 0


def _kernel_used(logs: list[dict[str, object]]) -> object:
    ready = [e for e in logs if e["event"] == "capture transport ready"]
    assert len(ready) == 1
    return ready[0]["topk_kernel"]


def test_torch_topk_is_the_engines_default_and_auto_is_taken_by_name() -> None:
    assert Settings.from_env({}).topk_kernel == "none"
    assert Settings.from_env({"DMX_TOPK_KERNEL": "auto"}).topk_kernel == "auto"


def test_auto_selects_with_flashinfer_where_its_check_passes(
        make_driver, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stand_in_flashinfer(monkeypatch)
    full, full_sink = make_driver("final_logits")
    with structlog.testing.capture_logs() as logs:
        some, some_sink = make_driver("final_logits:topk(3)", topk_kernel="auto",
                                      max_graph_batch=6)
    assert calls == [3, 6]  # the start-up check
    assert _kernel_used(logs) == "flashinfer"
    _assert_check_logged(logs, kernel="flashinfer", setting="auto")
    for d in (full, some):
        two_requests(d, padded=True)
        d.t.stop()
    some.verify(some_sink.records)
    assert_topk3_of(full_sink.records, some_sink.records)
    assert len(calls) > 2  # the capture selected with it


@pytest.mark.parametrize("flashinfer", ["missing", "selects wrongly"])
def test_auto_selects_with_torch_topk_where_flashinfer_fails_its_check_and_says_why(
        make_driver, monkeypatch: pytest.MonkeyPatch, flashinfer: str) -> None:
    if flashinfer == "missing":
        monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
        why = "ModuleNotFoundError"
    else:
        _stand_in_flashinfer(monkeypatch, off_by_one=True)
        why = "its columns do not hold the values it returned"
    full, full_sink = make_driver("final_logits")
    with structlog.testing.capture_logs() as logs:
        some, some_sink = make_driver("final_logits:topk(3)", topk_kernel="auto")
    assert _kernel_used(logs) == "none"
    _assert_check_logged(logs, kernel="none", setting="auto")
    fallback = [e for e in logs if e["event"] == "dmi.topk_kernel"]
    assert why in str(fallback[0]["reason"])
    for d in (full, some):
        two_requests(d, padded=True)
        d.t.stop()
    some.verify(some_sink.records)
    assert_topk3_of(full_sink.records, some_sink.records)


def test_auto_checks_nothing_without_a_top_k(make_driver,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stand_in_flashinfer(monkeypatch)
    with structlog.testing.capture_logs() as logs:
        make_driver("final_logits", topk_kernel="auto")
    assert calls == []
    assert _kernel_used(logs) is None


def test_auto_leaves_bfloat16_logits_to_torch_topk_without_trying_flashinfer(
        make_driver, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stand_in_flashinfer(monkeypatch)
    shape = attrs.evolve(SHAPE, logits_dtype=DType.BFLOAT16)
    with structlog.testing.capture_logs() as logs:
        make_driver("final_logits:topk(3)", topk_kernel="auto", shape=shape)
    assert calls == []  # over bfloat16 rows it differed from torch.topk: not checked
    assert _kernel_used(logs) == "none"
    chosen = [e for e in logs if e["event"] == "dmi.topk_kernel"]
    assert len(chosen) == 1
    assert "bfloat16" in str(chosen[0]["reason"])


def test_a_check_that_does_not_finish_is_not_taken_for_a_selection_that_differs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel stuck on the device is not a kernel that "does not work, use another":
    the device is not usable after it, so the warm-ups let the timeout through, while
    any other failure of the check is still returned as why."""
    for module, warm in ((topk_flashinfer, lambda: warm_up(CPU, 1000, 8)),
                         (topk_kernel, lambda: topk_kernel.warm_up(CPU, 1000, 8, 16))):
        def stuck(*args: object, **kwargs: object) -> str | None:
            raise CheckTimeoutError("its selection did not finish")

        def broken(*args: object, **kwargs: object) -> str | None:
            raise RuntimeError("compiler said no")

        monkeypatch.setattr(module, "selection_differs", stuck)
        with pytest.raises(CheckTimeoutError):
            warm()
        monkeypatch.setattr(module, "selection_differs", broken)
        assert warm() == "RuntimeError: compiler said no"


@pytest.mark.parametrize(("setting", "what"), [("auto", "FlashInfer's top-k"),
                                               ("flashinfer", "FlashInfer's top-k"),
                                               ("triton", "the Triton top-k kernel")])
def test_a_start_up_check_that_does_not_finish_refuses_the_engine(
        make_driver, monkeypatch: pytest.MonkeyPatch, setting: str, what: str) -> None:
    """A top-k kernel's check stuck on the device -> the transport refuses to start,
    naming the setting, the kernel and DMX_TOPK_KERNEL=none (auto does not fall back to
    torch.topk on a device a stuck kernel holds)."""
    def stuck(*args: object, **kwargs: object) -> str | None:
        raise CheckTimeoutError("its selection over 3 rows did not finish within 60 s")

    monkeypatch.setattr(topk_flashinfer, "warm_up", stuck)
    monkeypatch.setattr(topk_kernel, "warm_up", stuck)
    with pytest.raises(UnsupportedConfigurationError) as err:
        make_driver("final_logits:topk(3)", topk_kernel=setting, topk_chunk=1)
    text = str(err.value)
    assert f"DMX_TOPK_KERNEL={setting}: {what} failed its start-up check" in text
    assert "did not finish within 60 s" in text
    assert "DMX_TOPK_KERNEL=none" in text


def test_auto_does_not_wait_for_a_gpu_its_check_left_stuck(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, auto waits for the device after a check that failed (a kernel's fault
    shows there) but not after one that did not finish: that wait would never end."""
    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    gpu = torch.device("cuda", 0)  # never touched: the check is a stand-in

    def differs(*args: object, **kwargs: object) -> str | None:
        return "its selection differs from torch.topk's"

    monkeypatch.setattr(topk_flashinfer, "warm_up", differs)
    assert _auto_topk_kernel(gpu, 10, 3, dtype=torch.float32, batches=(3,)) == "none"
    assert synced == [gpu]

    def stuck(*args: object, **kwargs: object) -> str | None:
        raise CheckTimeoutError("its selection did not finish")

    synced.clear()
    monkeypatch.setattr(topk_flashinfer, "warm_up", stuck)
    with pytest.raises(UnsupportedConfigurationError, match="DMX_TOPK_KERNEL=auto"):
        _auto_topk_kernel(gpu, 10, 3, dtype=torch.float32, batches=(3,))
    assert synced == []
