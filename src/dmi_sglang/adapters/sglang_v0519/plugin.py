"""``register()``: the target of the ``sglang.srt.plugins`` entry point ``dmi``.

SGLang 0.5.19 calls it once per process (the main process that builds the Engine, and
every scheduler, before the model loads), logs and swallows anything it raises, and
then applies the registered hooks (``sglang/srt/plugins/__init__.py``). Hence:

* it is cheap (no SGLang model code, no torch import) and idempotent;
* it never raises: problems found here (an SGLang other than 0.5.19, a bad
  ``DMX_SGLANG_ENABLE``) are recorded in :data:`STATE` and raised later, by the main-process
  check and by the scheduler's ``load_model`` hook through :func:`raise_pending_problems`,
  when capture was requested;
* with monitoring not requested (``DMX_SGLANG_ENABLE=0``, or ``auto`` without any other
  ``DMX_*`` variable) it installs nothing: the engine is the unmonitored baseline.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

import attrs
import structlog

from dmi_sglang.domain.settings import monitoring_requested
from dmi_sglang.domain.support import SUPPORTED_SGLANG, SUPPORTED_TORCH_PREFIX
from dmi_sglang.errors import ConfigurationError, UnsupportedConfigurationError

__all__ = [
    "MAIN_PROCESS_HOOKS",
    "STATE",
    "PluginState",
    "after_check_server_args",
    "pending_problems",
    "raise_pending_problems",
    "register",
    "registration_problems",
]

log = structlog.get_logger(__name__)


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


STATE = PluginState()
"""This process's plugin state."""


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

def register() -> None:
    """Register dmi-sglang's hooks with SGLang. Cheap, idempotent, never raises."""
    try:
        _register(STATE)
    except Exception as exc:  # SGLang would swallow it anyway; keep it for later
        STATE.problems.append(f"dmi-sglang register() failed: {exc!r}")
        log.error("dmi.plugin.register_failed", error=repr(exc))


def pending_problems(*, check_torch: bool) -> list[str]:
    """Problems recorded at registration; the torch version only when ``check_torch``."""
    problems = list(STATE.problems)
    torch_version = STATE.torch_version
    if check_torch and torch_version and not torch_version.startswith(SUPPORTED_TORCH_PREFIX):
        problems.append(f"torch {torch_version} is installed; sglang {SUPPORTED_SGLANG} "
                        f"needs torch {SUPPORTED_TORCH_PREFIX}x")
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


def _register(state: PluginState) -> None:
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
    if sglang_version != SUPPORTED_SGLANG:
        state.problems.append(f"sglang {sglang_version} is installed; dmi-sglang supports "
                              f"exactly sglang=={SUPPORTED_SGLANG}")
    state.torch_version = _version("torch")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import HOOKS, SCHEDULER_RPCS

    for target, kind, hook in (*MAIN_PROCESS_HOOKS, *HOOKS):
        HookRegistry.register(target, hook, HookType[kind])
        state.hooks.append(target)
    from sglang.srt.managers.scheduler import Scheduler

    for name, method in SCHEDULER_RPCS.items():  # HookRegistry cannot add methods
        setattr(Scheduler, name, method)
    log.debug("dmi.plugin.registered", hooks=state.hooks, problems=state.problems)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None
