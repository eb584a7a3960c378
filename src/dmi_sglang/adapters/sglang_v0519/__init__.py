"""The SGLang 0.5.19 adapter: everything that knows SGLang 0.5.19 symbols.

Importing this package is free: SGLang and torch are imported by the submodules that need
them, inside functions, so the plugin entry point stays cheap in every SGLang process.

Submodules:

* ``adapter``: :data:`~.adapter.ADAPTER`, what the composition root uses (register the
  plugin with a capture factory, SGLang's Engine class, the engine's monitoring RPCs).
* ``version``: the SGLang release this package is written against and its torch.
* ``plugin`` / ``runtime_hooks`` / ``attach``: the hooks and what they install.
* ``engine``: the monitoring RPCs of a started engine (the EngineTap port).
* ``facts``: resolved ServerArgs -> :class:`~dmi_sglang.domain.support.EngineFacts`;
  Qwen3 shapes and hooks; the main-process support check.
* ``qwen3``: capture points wrapped around an upstream ``Qwen3ForCausalLM`` instance;
  the hooked model class and its registration in SGLang's ``ModelRegistry``.
* ``batch``: ``ForwardBatch`` -> :class:`~dmi_sglang.domain.layout.BatchLayout`.
* ``pins``: the upstream basis (file hashes, classes, signatures) checked at startup.

A future SGLang version gets a sibling package, not edits here.
"""

from __future__ import annotations

__all__: list[str] = []
