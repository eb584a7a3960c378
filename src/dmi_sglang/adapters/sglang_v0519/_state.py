"""What ``register()`` did in this process, and the problems it found for later.

Shared by the plugin (which fills it) and the ``load_model`` hook (which reads it); it
imports neither, so the adapter's modules form no import loop.
"""

from __future__ import annotations

import attrs

from dmi_sglang.adapters.sglang_v0519.version import SGLANG_VERSION, TORCH_PREFIX
from dmi_sglang.errors import UnsupportedConfigurationError
from dmi_sglang.tensor_ports import CaptureFactory

__all__ = [
    "READS_ADDRESS",
    "SERVER_MARK",
    "STATE",
    "PluginState",
    "pending_problems",
    "raise_pending_problems",
    "registration_problems",
]


@attrs.define
class PluginState:
    """What ``register()`` did in this process (mutable, one per process)."""

    registered: bool = False
    monitoring: bool = False
    hooks: list[str] = attrs.Factory(list)
    """Targets registered with SGLang's HookRegistry."""
    problems: list[str] = attrs.Factory(list)
    """Found at registration; raised by :func:`raise_pending_problems`."""
    torch_version: str | None = None
    factory: CaptureFactory | None = None
    """Opens the capture pipeline in a scheduler (injected by the composition root)."""


STATE = PluginState()
"""This process's plugin state."""

SERVER_MARK = "DMI_SGLANG_SERVER"
"""Set to ``1`` by the HTTP server's main process for the schedulers it starts: there a
capture failure ends the capture, not the serving (``runtime_hooks.around_forward``)."""
READS_ADDRESS = "DMI_SGLANG_READS"
"""Set by the HTTP server's main process for the schedulers it starts: the IPC address
where the store's owner (the store owner process the scheduler starts) answers the
server's reads of the embedded store."""


def pending_problems(*, check_torch: bool) -> list[str]:
    """Problems recorded at registration; the torch version only when ``check_torch``."""
    problems = list(STATE.problems)
    torch_version = STATE.torch_version
    if check_torch and torch_version and not torch_version.startswith(TORCH_PREFIX):
        problems.append(f"torch {torch_version} is installed; sglang {SGLANG_VERSION} "
                        f"needs torch {TORCH_PREFIX}x")
    return problems


def registration_problems() -> list[str]:
    """:func:`pending_problems`, checking torch where it matters (CUDA is available).

    For the scheduler's ``load_model`` hook, which imports torch anyway.
    """
    import torch

    return pending_problems(check_torch=torch.cuda.is_available())


def raise_pending_problems(*, check_torch: bool) -> None:
    """Raise what registration found (for the ``load_model`` hook, capture requested).

    Raises:
        UnsupportedConfigurationError: with every recorded problem.
    """
    problems = pending_problems(check_torch=check_torch)
    if problems:
        raise UnsupportedConfigurationError(tuple(problems))
