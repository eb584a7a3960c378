"""Errors and warnings raised by dmi-sglang.

Every error names the offending value and what is accepted. Adapters translate their
libraries' exceptions into these types at the boundary (``raise ... from exc``).
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "CaptureError",
    "CommitError",
    "ConfigurationError",
    "DMIError",
    "DMIWarning",
    "IncompleteCaptureError",
    "NotInStoreError",
    "RunExistsError",
    "SelectionError",
    "StoreError",
    "UnsupportedConfigurationError",
    "UsageError",
]


class DMIError(Exception):
    """Base class of every error dmi-sglang raises on purpose."""


class ConfigurationError(DMIError, ValueError):
    """A setting (``DMX_*`` variable or ``dmx_*`` keyword) has an invalid value."""


class RunExistsError(ConfigurationError):
    """A new run was asked for under an id the store already holds."""


class SelectionError(ConfigurationError):
    """A hook selection names an unknown hook or preset, or a bad layer range."""


class UnsupportedConfigurationError(DMIError):
    """The SGLang configuration is outside the support matrix.

    ``reasons`` lists every problem found, not only the first.
    """

    def __init__(self, reasons: tuple[str, ...]) -> None:
        self.reasons = reasons
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(f"dmi-sglang cannot monitor this configuration:\n{lines}")


class CapacityError(DMIError):
    """The capture ring is too small for the configuration (refused at startup)."""


class CommitError(DMIError, RuntimeError):
    """The one-commit-per-forward protocol was broken (a bug, never user input)."""


class CaptureError(DMIError, RuntimeError):
    """Capturing failed; the capture is incomplete and this failure is sticky."""


class StoreError(DMIError):
    """The capture store cannot be reached, opened, written or read."""


class IncompleteCaptureError(DMIError, LookupError):
    """A request's capture is not complete (not committed, or rows are missing)."""


class NotInStoreError(DMIError, LookupError):
    """The store holds no such run, or nothing of such a request."""


class UsageError(DMIError, ValueError):
    """A command-line argument that cannot be used (reported as one line)."""


class DMIWarning(UserWarning):
    """Warnings dmi-sglang emits (the test suite turns them into errors)."""
