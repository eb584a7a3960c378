"""The SGLang release this adapter is written against, and what that release needs.

Notes: every SGLang symbol this package touches is pinned by ``pins.py`` (classes,
forward signatures and file hashes); the boundary it relies on is described in
``docs/v0519-port.md``. A later SGLang release gets a sibling package
(``adapters/sglang_v05xx``) and one line in the composition root, not edits here.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["SGLANG_VERSION", "TORCH_PREFIX", "installed"]

SGLANG_VERSION = "0.5.19"
"""The only SGLang release this adapter is qualified on."""
TORCH_PREFIX = "2.13."
"""torch releases SGLang 0.5.19 is built against (checked on GPU machines only)."""


def installed(distribution: str) -> str | None:
    """The installed release of ``distribution`` without its local label (``+cu130``),
    or None when it is not installed. Every version check of this adapter reads it."""
    try:
        return importlib.metadata.version(distribution).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None
