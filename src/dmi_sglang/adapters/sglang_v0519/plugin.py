"""``register(factory)``: the adapter's work for the ``sglang.srt.plugins`` entry point ``dmi``.

The composition root (``dmi_sglang.app.composition``) calls it with the capture factory.
SGLang 0.5.19 calls the entry point once per process (the main process that builds the Engine, and
every scheduler, before the model loads), logs and swallows anything it raises, and
then applies the registered hooks (``sglang/srt/plugins/__init__.py``). Hence:

* it is cheap (no SGLang model code, no torch import) and idempotent;
* in the main process of SGLang's HTTP server it also wraps the server's start
  (``server.py``: the ``/dmi`` endpoints and the stop at exit);
* it never raises: problems found here (an SGLang other than 0.5.19, a bad
  ``DMX_SGLANG_ENABLE``) are recorded in ``_state.STATE`` and raised later, by the
  main-process check and by the scheduler's ``load_model`` hook, when capture was requested;
* with monitoring not requested (``DMX_SGLANG_ENABLE=0``, or ``auto`` without any other
  ``DMX_*`` variable) it installs nothing: the engine is the unmonitored baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from dmi_sglang.adapters.sglang_v0519 import _state
from dmi_sglang.adapters.sglang_v0519.version import SGLANG_VERSION, installed
from dmi_sglang.domain.settings import monitoring_requested
from dmi_sglang.errors import ConfigurationError
from dmi_sglang.tensor_ports import CaptureFactory

__all__ = ["MAIN_PROCESS_HOOKS", "after_check_server_args", "register"]

log = structlog.get_logger(__name__)


def after_check_server_args(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``ServerArgs.check_server_args``: the main-process support check.

    Raises:
        UnsupportedConfigurationError: every reason at once; it propagates out of
            ``Engine(...)`` before anything is spawned.
    """
    from dmi_sglang.adapters.sglang_v0519.facts import main_process_check

    del result, args, kwargs  # check_server_args returns None and takes no arguments
    main_process_check(server_args)


MAIN_PROCESS_HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("sglang.srt.server_args.ServerArgs.check_server_args", "AFTER", after_check_server_args),
)
"""``(target, HookType name, hook)`` that :func:`register` installs."""


def register(factory: CaptureFactory) -> None:
    """Register dmi-sglang's hooks with SGLang. Cheap, idempotent, never raises.

    Args:
        factory: opens the capture pipeline in a scheduler (from the composition root).
    """
    state = _state.STATE
    state.factory = factory
    try:
        _register(state)
    except Exception as exc:  # SGLang would swallow it anyway; keep it for later
        state.problems.append(f"dmi-sglang register() failed: {exc!r}")
        log.error("dmi.plugin.register_failed", error=repr(exc))


def _register(state: _state.PluginState) -> None:
    if state.registered:
        return
    state.registered = True
    try:
        state.monitoring = monitoring_requested()
    except ConfigurationError as exc:
        # Install the main-process hook anyway: it re-reads the variable and raises there.
        state.problems.append(str(exc))
        state.monitoring = True
    if not state.monitoring:
        log.debug("dmi.plugin.inactive", why="monitoring not requested (DMX_SGLANG_ENABLE)")
        return
    sglang_version = _version("sglang")
    if sglang_version != SGLANG_VERSION:
        state.problems.append(f"sglang {sglang_version} is installed; this adapter supports "
                              f"exactly sglang=={SGLANG_VERSION}")
    state.torch_version = _version("torch")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import HOOKS, SCHEDULER_RPCS
    from dmi_sglang.adapters.sglang_v0519.server import SERVER_HOOKS, serving_process

    server = SERVER_HOOKS if serving_process() else ()
    for target, kind, hook in (*MAIN_PROCESS_HOOKS, *HOOKS, *server):
        HookRegistry.register(target, hook, HookType[kind])
        state.hooks.append(target)
    from sglang.srt.managers.scheduler import Scheduler

    for name, method in SCHEDULER_RPCS.items():  # HookRegistry cannot add methods
        setattr(Scheduler, name, method)
    log.debug("dmi.plugin.registered", hooks=state.hooks, problems=state.problems)


def _version(dist: str) -> str | None:
    return installed(dist)
