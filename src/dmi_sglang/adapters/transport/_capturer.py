"""The capture points' side of the transport: the only object the hooked model sees."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dmi_sglang.adapters.transport._arena import CaptureKey

__all__ = ["Capturer"]


class Capturer:
    """What a hooked model calls at each capture point.

    Which path a call takes is decided by the transport, not by the caller:

    * while a CUDA graph is being captured (``torch.cuda.is_current_stream_capturing()``):
      a copy into the capture's fixed arena slot is recorded into the graph; every replay
      refreshes the slot, and ``seal()`` moves the real rows to the ring;
    * eagerly with a committed unpadded plan: the kept rows go straight into the step's
      ring region (request-row hooks are index-selected);
    * eagerly with a committed padded plan: the rows go to the arena, as a replay would;
    * eagerly with no committed step (SGLang's warm-up and dummy forwards): nothing.

    Capture points that :meth:`wants` declines are never installed; calling them anyway
    does nothing.
    """

    __slots__ = ("_keys", "_sink")

    def __init__(
        self, keys: Iterable[CaptureKey], sink: Callable[[CaptureKey, torch.Tensor], None]
    ) -> None:
        self._keys = frozenset(keys)
        self._sink = sink

    def wants(self, hook_name: str, layer_no: int) -> bool:
        """True when ``(hook_name, layer_no)`` is selected (``layer_no = -1``: global)."""
        return (hook_name, layer_no) in self._keys

    def capture(self, hook_name: str, layer_no: int, tensor: torch.Tensor) -> None:
        """Capture ``tensor`` (rows first) at ``(hook_name, layer_no)``.

        Raises:
            CaptureError: the transport stopped or failed, or the tensor does not match
                the planned dtype, row width or row count.
        """
        self._sink((hook_name, layer_no), tensor)
