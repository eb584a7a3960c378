"""The ``sglang.srt.plugins`` entry point ``dmi`` (``dmi_sglang.app.plugin:register``).

SGLang 0.5.19 discovers it in every process that loads plugins (the Engine's main process
and each scheduler) and calls :func:`register`. The composition root picks the adapter of
the installed SGLang and hands it the capture factory; importing this module stays cheap
(no SGLang, torch or ClickHouse).
"""

from __future__ import annotations

from dmi_sglang.app.composition import register_plugin

__all__ = ["register"]


def register() -> None:
    """Register dmi-sglang with the SGLang process that calls it (see :mod:`.composition`)."""
    register_plugin()
