"""The capture points' side of the transport: the only object the hooked model sees."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch

from dmi_sglang.adapters.transport._arena import CaptureKey, check_dtype
from dmi_sglang.adapters.transport._options import TOPK_CHUNK
from dmi_sglang.adapters.transport.topk import Select, chunked_topk
from dmi_sglang.adapters.transport.topk_flashinfer import flashinfer_topk
from dmi_sglang.adapters.transport.topk_kernel import fused_topk
from dmi_sglang.errors import CaptureError

__all__ = ["Capturer", "Payloads"]

LOGITS: CaptureKey = ("final_logits", -1)
TOPK_VALUES: CaptureKey = ("logits_topk_values", -1)
TOPK_IDS: CaptureKey = ("logits_topk_ids", -1)
SELECTIONS: dict[str, Select] = {"none": chunked_topk, "triton": fused_topk,
                                 "flashinfer": flashinfer_topk}
"""The top-k selection each ``DMX_TOPK_KERNEL`` value runs."""


class Payloads:
    """What the capture points do to rows before they are stored (the selection's
    payload modifiers, :mod:`dmi_sglang.domain.payloads`), on the device.

    Args:
        casts: captures stored in another float dtype than computed: ``(computed,
            stored)`` dtypes.
        topk: ``K`` of ``final_logits:topk(K)``, 0 for none.
        logits_dtype: the dtype ``final_logits`` rows are computed in.
        device: where the fp16 overflow counter lives.
        topk_chunk: columns per chunk of the top-k selection
            (:func:`~dmi_sglang.adapters.transport.topk.chunked_topk`); 0: whole rows.
        topk_kernel: which selection runs (``DMX_TOPK_KERNEL``, ``auto`` resolved: ``none``,
            ``triton`` or ``flashinfer``; a kernel checked to fit and work by whoever makes the
            payloads), kept as :attr:`select`.
    """

    __slots__ = ("casts", "kernel", "logits_dtype", "overflows", "select", "topk", "topk_chunk")

    def __init__(self, casts: Mapping[CaptureKey, tuple[torch.dtype, torch.dtype]],
                 topk: int, logits_dtype: torch.dtype, device: torch.device, *,
                 topk_chunk: int = TOPK_CHUNK, topk_kernel: str = "none") -> None:
        self.casts = dict(casts)
        self.topk = topk
        self.topk_chunk = topk_chunk
        self.kernel = topk_kernel
        """The ``DMX_TOPK_KERNEL`` value :attr:`select` runs (``auto`` resolved)."""
        self.select: Select = SELECTIONS[topk_kernel]
        """The top-k selection ``topk_kernel`` names (:data:`SELECTIONS`)."""
        self.logits_dtype = logits_dtype
        counts = any(stored is torch.float16 for _, stored in self.casts.values())
        self.overflows = torch.zeros((), dtype=torch.int64, device=device) if counts else None
        """Values cast to fp16 that became infinite (beyond +-65504), counted on the
        device over every row a capture point cast (a replay's padding rows
        included); None when nothing is cast to fp16."""

    def cast(self, key: CaptureKey, tensor: torch.Tensor,
             dtypes: tuple[torch.dtype, torch.dtype]) -> torch.Tensor:
        """``tensor`` (computed in ``dtypes[0]``) in ``dtypes[1]``; values fp16 cannot
        hold are counted.

        Raises:
            CaptureError: the tensor is not in the dtype the capture is computed in.
        """
        computed, dtype = dtypes
        check_dtype(key, tensor, computed)
        out = tensor.to(dtype)
        if self.overflows is not None and dtype is torch.float16 and out is not tensor:
            self.overflows.add_((out.isinf() & ~tensor.isinf()).sum())
        return out

    def overflow_count(self) -> int:
        """Values cast to fp16 that overflowed so far (synchronises with the device)."""
        return 0 if self.overflows is None else int(self.overflows.item())


class Capturer:
    """What a hooked model calls at each capture point.

    Which path a call takes is decided by the transport, not by the caller:

    * while a CUDA graph is being captured (``torch.cuda.is_current_stream_capturing()``):
      a copy into the capture's place in the arena is recorded into the graph (the
      transport's ``_arena`` module: which slot a replay writes, and how); every replay
      refreshes it, and the rows go on to the ring or the decode window later;
    * eagerly with a committed unpadded plan: the kept rows go straight into the step's
      ring region (request-row hooks are index-selected);
    * eagerly with a committed padded plan: the rows go to the arena, as a replay would;
    * eagerly with no committed step (SGLang's warm-up and dummy forwards): nothing.

    A capture with a payload modifier (a storage dtype, ``final_logits:topk(K)``) is
    transformed on the device first, and only when ``live`` says its rows are used
    (under graph capture the transform is recorded into the graph).

    Capture points that :meth:`wants` declines are never installed; calling them anyway
    does nothing.
    """

    __slots__ = ("_join", "_keys", "_live", "_payloads", "_sink", "seconds")

    def __init__(
        self,
        keys: Iterable[CaptureKey],
        sink: Callable[[CaptureKey, torch.Tensor], None],
        *,
        payloads: Payloads | None = None,
        live: Callable[[CaptureKey], bool] | None = None,
        join: Callable[[], None] | None = None,
    ) -> None:
        keys = frozenset(keys)
        self._payloads = payloads
        if payloads is not None and payloads.topk and (TOPK_VALUES in keys or TOPK_IDS in keys):
            keys |= {LOGITS}
        self._keys = keys
        self._sink = sink
        self._live = live if live is not None else _always
        self._join = join if join is not None else _nothing
        self.seconds = 0.0
        """Time spent in :meth:`capture` so far (its transforms and copies included)."""

    def wants(self, hook_name: str, layer_no: int) -> bool:
        """True when ``(hook_name, layer_no)`` is selected (``layer_no = -1``: global)."""
        return (hook_name, layer_no) in self._keys

    def capture(self, hook_name: str, layer_no: int, tensor: torch.Tensor) -> None:
        """Capture ``tensor`` (rows first) at ``(hook_name, layer_no)``: its rows are
        copied (a copy queued on the current stream) before this returns, so the model
        may change the tensor in place right after (the capture points rely on it: they
        hand over RoPE's q and k and the sampler's logits uncloned). Casts and top-k
        run now as well. The exception: while a decode graph is recorded by a capturer
        that :attr:`joins`, a residual-stream tensor's copy is queued on a second
        stream, and the model must leave the tensor unchanged until its :meth:`join`.

        Raises:
            CaptureError: the transport stopped or failed, the tensor does not match
                the planned dtype, row width or row count, or the copy itself failed.
        """
        key = (hook_name, layer_no)
        t0 = time.perf_counter()
        try:
            payloads = self._payloads
            if payloads is None:
                self._sink(key, tensor)
                return
            dtypes = payloads.casts.get(key)
            if dtypes is None:
                self._sink(key, tensor)
            elif self._live(key):
                self._sink(key, payloads.cast(key, tensor, dtypes))
            if payloads.topk and key == LOGITS:
                self._topk(tensor, payloads)
        except CaptureError:
            raise
        except Exception as exc:  # e.g. out of device memory: the capture's failure
            msg = f"capture of {hook_name}@{layer_no} failed: {exc!r}"
            raise CaptureError(msg) from exc
        finally:
            self.seconds += time.perf_counter() - t0

    @property
    def joins(self) -> bool:
        """True when a decode graph records residual-stream copies on a second stream
        (``DMX_GRAPH_SIDE_STREAM``): the model must call :meth:`join`."""
        return self._join is not _nothing

    def join(self) -> None:
        """The model is about to change a residual-stream tensor it handed to
        :meth:`capture` in place, or its forward returns: the copies of such tensors
        that a decode graph records on a second stream are waited for from here on.

        Raises:
            CaptureError: the wait could not be queued.
        """
        try:
            self._join()
        except Exception as exc:
            msg = f"capture join failed: {exc!r}"
            raise CaptureError(msg) from exc

    def _topk(self, logits: torch.Tensor, payloads: Payloads) -> None:
        values_live, ids_live = self._live(TOPK_VALUES), self._live(TOPK_IDS)
        if not (values_live or ids_live):
            return
        check_dtype(LOGITS, logits, payloads.logits_dtype)
        values, ids = payloads.select(logits, payloads.topk, payloads.topk_chunk)
        if values_live:
            dtypes = payloads.casts.get(TOPK_VALUES)
            self._sink(TOPK_VALUES, values if dtypes is None
                       else payloads.cast(TOPK_VALUES, values, dtypes))
        if ids_live:
            self._sink(TOPK_IDS, ids.to(torch.int32))


def _always(_key: CaptureKey) -> bool:
    return True


def _nothing() -> None:
    return None
