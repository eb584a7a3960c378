"""The built-in capture transport (PyTorch): capture points -> GPU ring -> records.

Importing this package imports torch (it is an adapter) but never SGLang.

* :class:`TorchCaptureTransport`: the :class:`~dmi_sglang.domain.ports.CaptureTransport`
  the SGLang adapter drives per forward (preflight, commit, seal, stop, stats).
* :class:`Capturer`: what the hooked model calls (``wants``, ``capture``).
* :class:`TransportOptions`: tuning from plain settings.
* :func:`engine_transport`: an engine's transport from its settings (every ``DMX_*``
  transport setting); :func:`create_transport`: the same from plain values.
* :class:`DeviceOps`: the drain's device primitives (its stream, fences, and its
  device-to-host copy path as the ``DMX_DRAIN_COPY_*`` settings shape it), public for
  benchmarks that measure that path itself (``python -m harness copies``).
"""

from __future__ import annotations

from dmi_sglang.adapters.transport._capturer import Capturer
from dmi_sglang.adapters.transport._device import DeviceOps
from dmi_sglang.adapters.transport._factory import create_transport, engine_transport
from dmi_sglang.adapters.transport._options import TransportOptions
from dmi_sglang.adapters.transport._transport import TorchCaptureTransport

__all__ = ["Capturer", "DeviceOps", "TorchCaptureTransport", "TransportOptions",
           "create_transport", "engine_transport"]
