"""The ``sglang.srt.plugins`` entry point ``dmi`` (``dmi_sglang.app.plugin:register``).

SGLang 0.5.19 discovers it in every process that loads plugins (the Engine's main process
and each scheduler) and calls :func:`register`. The wiring lives in the adapter for the
installed SGLang; this module only names the entry point, so importing it stays cheap.
"""

from __future__ import annotations

from dmi_sglang.adapters.sglang_v0519.plugin import register

__all__ = ["register"]
