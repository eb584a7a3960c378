"""The ports that speak torch tensors (outside the domain, which never imports torch).

* :class:`Capturer`: what a hooked model's capture points call.
* :class:`OpenedCapture` / :class:`CaptureFactory`: what the composition root hands an
  SGLang adapter so that, in a scheduler, it can open the capture pipeline (store, transport
  and capture session) without naming any other adapter.
* :class:`SGLangAdapter`: what a version package (``adapters/sglang_vXXXX``) provides to
  the composition root.

torch is imported for type checking only: importing this module stays free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from dmi_sglang.domain.ports import CaptureReads, CaptureSession, CaptureSpec, EngineTap
from dmi_sglang.domain.settings import Settings

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CaptureFactory", "Capturer", "OpenedCapture", "SGLangAdapter"]


@runtime_checkable
class Capturer(Protocol):
    """**Port**: the only object a hooked model sees at its capture points."""

    def wants(self, hook_name: str, layer_no: int) -> bool:
        """True when ``(hook_name, layer_no)`` is selected (``layer_no = -1``: global)."""
        ...

    def capture(self, hook_name: str, layer_no: int, tensor: torch.Tensor) -> None:
        """Capture ``tensor`` (rows first) at ``(hook_name, layer_no)``: its values as of
        the call. The model may overwrite it in place once the call returns, so the
        capturer copies it first (a copy queued on the current stream suffices), except
        for the residual stream (:data:`~dmi_sglang.domain.hooks.RESIDUAL_STREAM`) of a
        capturer that :attr:`joins`: the model keeps that tensor unchanged until it calls
        :meth:`join` (the capturer keeps a reference to it until then, so its memory is
        not reused before)."""
        ...

    @property
    def joins(self) -> bool:
        """True when the capturer may copy residual-stream tensors as late as the next
        :meth:`join` (the model then calls it); False: every copy is made before
        :meth:`capture` returns and :meth:`join` need not be called."""
        ...

    def join(self) -> None:
        """Called by the model before it changes in place a residual-stream tensor it
        handed to :meth:`capture`, and when its forward returns: the capturer's copies
        of such tensors must precede the model's later work from here on."""
        ...


@attrs.frozen
class OpenedCapture:
    """An open capture pipeline: the session the runtime hooks drive, the capturer the
    capture points call, and the device memory it holds."""

    session: CaptureSession
    capturer: Capturer
    device_bytes: int


@runtime_checkable
class CaptureFactory(Protocol):
    """**Port**: claims a run id (main process) and opens the capture pipeline of the
    run in one scheduler process."""

    def claim_run(self, settings: Settings) -> None:
        """Claim the resolved run id in its store before any scheduler starts.

        Raises:
            RunExistsError: the store holds that run, or another start claimed it.
        """
        ...

    def open(self, spec: CaptureSpec) -> OpenedCapture:
        """Open the store, start the run and create the transport (and, with
        ``spec.read_address``, answer a server's reads of the embedded store there).

        Raises:
            StoreError: the store cannot be opened.
            CapacityError: the ring cannot hold one capture tensor.
        """
        ...

    def serving_reads(self, settings: Settings, read_address: str) -> CaptureReads | None:
        """A server main process's reads of the run's store (None: nothing stored);
        the embedded store is read through its owner at ``read_address``."""
        ...


@runtime_checkable
class SGLangAdapter(Protocol):
    """**Port**: what one SGLang version's adapter package provides.

    ``sglang_version`` is the exact release it is qualified on; the composition root
    picks the adapter whose version is installed.
    """

    @property
    def sglang_version(self) -> str:
        """The SGLang release the adapter is written against (``"0.5.19"``)."""
        ...

    def register(self, factory: CaptureFactory) -> None:
        """The plugin entry point's work in every SGLang process: install the hooks
        (when monitoring is requested). Cheap, idempotent, never raises."""
        ...

    def engine_base(self) -> type[Any]:
        """SGLang's offline ``Engine`` class, which ``DMIEngine`` extends."""
        ...

    def engine_tap(self, engine: Any) -> EngineTap:
        """The monitoring RPCs of a started engine."""
        ...
