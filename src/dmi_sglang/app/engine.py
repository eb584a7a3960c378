"""``DMIEngine``: a drop-in for ``sglang.Engine`` that captures what the model computes.

::

    from dmi_sglang import DMIEngine

    engine = DMIEngine(model_path=..., dmx_hook_selection="resid_pre,final_ln")
    try:
        out = engine.generate(prompt=["..."], sampling_params={"max_new_tokens": 8})
        engine.dmi_stop_monitoring()              # the authoritative flush
        print(out[0]["dmi_internal"].hidden_states)
    finally:
        engine.shutdown()

Every ``ServerArgs`` keyword passes through unchanged; ``dmx_*`` keywords are the
settings of ``docs/settings.md``. They are validated and resolved before anything starts,
carried to the spawned scheduler as ``DMX_*`` variables, and the parent environment is
restored afterwards (also on failure).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import structlog

from dmi_sglang.app import composition
from dmi_sglang.app.handle import CaptureHandle, NoStoreHandle
from dmi_sglang.domain.ports import EngineTap
from dmi_sglang.domain.sampling import with_capture_param
from dmi_sglang.domain.settings import PREFIX, Enable, Settings, ignored_variables
from dmi_sglang.domain.support import request_input_problem
from dmi_sglang.errors import (
    CaptureError,
    ConfigurationError,
    DMIWarning,
    RunExistsError,
    UsageError,
)

__all__ = ["DMIEngine"]

log = structlog.get_logger(__name__)

_ADAPTER = composition.nearest_sglang_adapter()  # refused at construction when unsupported
_Engine: Any = _ADAPTER.engine_base()
_STARTING = threading.Lock()
_MULTIMODAL = ("image_data", "audio_data", "video_data")
_GENERATE_LEADING = ("prompt", "sampling_params", "input_ids", *_MULTIMODAL)
"""The first parameters of SGLang 0.5.19's ``Engine.generate``, in order: those that
:meth:`DMIEngine.generate` checks, whether passed by position or by name."""


@contextmanager
def _scheduler_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (and drop other ``DMX_*``), restore afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    for key in saved:
        del os.environ[key]
    os.environ.update(values)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(PREFIX)]:
            del os.environ[key]
        os.environ.update(saved)


def _check_selection(model_path: object, selection: str) -> None:
    """Refuse a selection a local model (a directory with ``config.json``) cannot have,
    before SGLang starts (a model id to download is left to the scheduler's check).

    Raises:
        ConfigurationError: a layer the model lacks, ``topk(K)`` beyond its vocabulary.
    """
    from pathlib import Path

    from dmi_sglang.app.cli_plan import check_selection

    model = Path(str(model_path))
    if not (model / "config.json").is_file():
        return
    try:
        check_selection(model, selection)
    except UsageError as exc:
        raise ConfigurationError(str(exc)) from None


def _check_capture_count(capture: object, prompt: object, input_ids: object) -> None:
    """Refuse one ``dmi_capture`` value per prompt that does not match the prompts
    (SGLang would fail on too few with a bare IndexError and drop too many).

    Raises:
        ValueError: a list for one prompt, or another count than the prompts.
    """
    if isinstance(capture, (bool, str, bytes)) or not isinstance(capture, Sequence):
        return
    given = prompt if prompt is not None else input_ids
    if isinstance(given, str) or (isinstance(given, list) and given
                                  and isinstance(given[0], int)):
        msg = f"dmi_capture has {len(capture)} values for one prompt: give True or False"
        raise ValueError(msg)
    if isinstance(given, list) and len(given) != len(capture):
        msg = f"dmi_capture has {len(capture)} values for {len(given)} prompts"
        raise ValueError(msg)


class DMIEngine(_Engine):  # type: ignore[misc]
    """``sglang.Engine`` with dmi-sglang monitoring attached in its scheduler.

    Args:
        **kwargs: every ``sglang.Engine`` / ``ServerArgs`` keyword, plus the ``dmx_*``
            settings (``dmx_model_id``, ``dmx_hook_selection``, ``dmx_db_url``, ...).

    Raises:
        ConfigurationError: an invalid ``dmx_*`` value, or a hook selection a local
            model (its ``config.json``) cannot have (before anything starts).
        UnsupportedConfigurationError: the installed SGLang has no adapter (likewise).
        RunExistsError: the store already holds a run of ``dmx_model_id`` (a run id
            names exactly one run; remove it with ``dmi-sglang rm`` or pick another).
        CaptureError: monitoring did not attach in the scheduler.
        RuntimeError: another DMIEngine is starting in this process.
    """

    def __init__(self, **kwargs: Any) -> None:
        dmx = {k: kwargs.pop(k) for k in list(kwargs) if k.lower().startswith("dmx_")}
        if "model_path" not in kwargs:
            msg = "DMIEngine needs model_path"
            raise ConfigurationError(msg)
        composition.sglang_adapter()  # an SGLang without an adapter: refused before anything
        settings = Settings.from_kwargs(dmx).resolve(model_path=str(kwargs["model_path"]))
        given = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
        given.update({k.upper(): str(v) for k, v in dmx.items()})  # keywords win
        from_keyword = {k.upper() for k in dmx}
        for variable, why in ignored_variables(given):
            log.warning("setting ignored",
                        variable=variable.lower() if variable in from_keyword else variable,
                        why=why)
        if settings.enable is Enable.OFF:
            msg = ("dmx_sglang_enable=0 (or DMX_SGLANG_ENABLE=0) asks for no monitoring, "
                   "which a DMIEngine always does; accepted: 1 or auto, or sglang.Engine "
                   "for an unmonitored baseline")
            raise ConfigurationError(msg)
        _check_selection(kwargs["model_path"], settings.hook_selection)
        _require_cuda()
        self.dmi_settings = settings
        self.dmi_run_id: str = settings.model_id or ""
        self._dmi_stopped = False
        self._dmi_shut_down = False
        self._dmi_started = False
        self._dmi_stop_error: CaptureError | None = None
        self._dmi_tap: EngineTap = _ADAPTER.engine_tap(self)
        if not _STARTING.acquire(blocking=False):
            msg = ("another DMIEngine is starting in this process; construct engines one "
                   "after another (settings travel to the scheduler through the process "
                   "environment)")
            raise RuntimeError(msg)
        try:
            env = {**settings.to_env(), PREFIX + "SGLANG_ENABLE": "1"}
            with _scheduler_environment(env):
                super().__init__(**kwargs)
        except RunExistsError:
            raise  # the id belongs to another run: leave its claim alone
        except BaseException:
            composition.release_unused_claim(settings.store(), self.dmi_run_id)
            raise
        finally:
            _STARTING.release()
        try:
            self._dmi_tap.assert_active(self.dmi_run_id)
        except CaptureError as exc:
            super().shutdown()
            composition.release_unused_claim(settings.store(), self.dmi_run_id)
            msg = f"dmi-sglang monitoring did not attach in the scheduler: {exc}"
            raise CaptureError(msg) from exc
        self._dmi_started = True
        log.info("dmi.engine_ready", run_id=self.dmi_run_id, store=settings.store().url)

    def generate(self, *args: Any, dmi_capture: bool | list[bool] | None = None,
                 **kwargs: Any) -> Any:
        """``sglang.Engine.generate``; each output dict gains a lazy ``dmi_internal``.

        ``dmi_capture`` (True / False, or one per prompt) captures the request or leaves
        it out whatever ``DMX_REQUEST_SAMPLE`` says; it travels as the sampling
        parameters' ``custom_params["dmi_capture"]``, which callers of SGLang's own APIs
        can set themselves. A request left out has no capture (its handle says why).

        Raises:
            CaptureError: after :meth:`dmi_stop_monitoring` (monitoring is terminal).
            ValueError: ``stream=True`` (a streamed capture has no single handle),
                multimodal inputs (no token ids to capture; refused before sending), or
                an invalid ``dmi_capture`` (a list of another length than the prompts).
        """
        positional, given = self._checked(args, kwargs, dmi_capture)
        out = super().generate(*positional, **given)
        return self._with_handles(out)

    async def async_generate(self, *args: Any, dmi_capture: bool | list[bool] | None = None,
                             **kwargs: Any) -> Any:
        """``sglang.Engine.async_generate``, as :meth:`generate` (the same checks and
        ``dmi_capture``; each output dict gains a lazy ``dmi_internal``).

        Raises:
            CaptureError / ValueError: as :meth:`generate`.
        """
        positional, given = self._checked(args, kwargs, dmi_capture)
        return self._with_handles(await super().async_generate(*positional, **given))

    def _checked(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 dmi_capture: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments to send, checked (see :meth:`generate`), whether given by
        position or by name; ``dmi_capture`` travels in the sampling parameters."""
        if self._dmi_stopped or self._dmi_stop_error is not None or self._dmi_shut_down:
            msg = ("monitoring was stopped (dmi_stop_monitoring, or shutdown): this engine "
                   "captures no more; build a new DMIEngine to capture again")
            raise CaptureError(msg)
        leading = _GENERATE_LEADING[: len(args)]
        twice = sorted(set(leading) & set(kwargs))
        if twice:
            msg = f"generate() got multiple values for argument {twice[0]!r}"
            raise TypeError(msg)
        given = {**dict(zip(leading, args, strict=False)), **kwargs}  # by name, however passed
        if given.get("stream"):
            msg = ("DMIEngine.generate(stream=True) is not supported (a streamed capture "
                   "has no single handle); use stream=False")
            raise ValueError(msg)
        multimodal = [k for k in _MULTIMODAL if given.get(k) is not None]
        problem = request_input_problem(has_token_ids=not multimodal, has_input_embeds=False)
        if problem is not None:
            msg = f"DMIEngine.generate({', '.join(multimodal)}=...) is refused: {problem}"
            raise ValueError(msg)
        if dmi_capture is not None:
            _check_capture_count(dmi_capture, given.get("prompt"), given.get("input_ids"))
            given["sampling_params"] = with_capture_param(given.get("sampling_params"),
                                                          dmi_capture)
        positional = (*(given.pop(name) for name in leading), *args[len(leading):])
        return positional, given

    def _with_handles(self, out: Any) -> Any:
        """``out`` (an output dict or a list of them), each with its ``dmi_internal``."""
        for item in out if isinstance(out, list) else [out]:
            item["dmi_internal"] = self.dmi_handle(item["meta_info"]["id"])
        return out

    def dmi_handle(self, request_id: str) -> CaptureHandle | NoStoreHandle:
        """The lazy capture handle of one request of this engine's run."""
        return composition.handle_for(self.dmi_settings.store(), self.dmi_run_id, request_id)

    def dmi_stop_monitoring(self) -> None:
        """Flush every capture to the store and write the manifest. Terminal.

        SGLang SIGKILLs its workers on ``shutdown()``, so this is the only durable
        point. A failure stays failed: later calls raise it again.

        Raises:
            CaptureError: the flush failed; the captures are incomplete.
        """
        if self._dmi_stop_error is not None:
            raise self._dmi_stop_error
        if self._dmi_stopped:
            return
        if self._dmi_shut_down:
            self._dmi_stop_error = CaptureError(
                f"dmi_stop_monitoring() after shutdown(): the engine's scheduler is gone, "
                f"the captures of run {self.dmi_run_id!r} are incomplete")
            raise self._dmi_stop_error
        try:
            self._dmi_tap.stop_monitoring()
        except CaptureError as exc:
            self._dmi_stop_error = CaptureError(f"dmi_stop_monitoring failed: {exc}")
            raise self._dmi_stop_error from exc
        self._dmi_stopped = True
        log.info("dmi.monitoring_stopped", run_id=self.dmi_run_id)

    def shutdown(self) -> None:
        """``sglang.Engine.shutdown``; warns when a started engine's captures were never
        flushed."""
        if getattr(self, "_dmi_started", False) and not self._dmi_stopped and \
                self._dmi_stop_error is None and not getattr(self, "_dmi_warned", False):
            self._dmi_warned = True
            warnings.warn(
                f"DMIEngine.shutdown() without dmi_stop_monitoring(): the captures of run "
                f"{self.dmi_run_id!r} are incomplete and will read back as not available",
                DMIWarning,
                stacklevel=2,
            )
        self._dmi_shut_down = True
        super().shutdown()


def _require_cuda() -> None:
    """Refuse a machine without a CUDA device in one line, before SGLang starts."""
    import torch

    if not torch.cuda.is_available():
        msg = ("DMIEngine needs an NVIDIA GPU with CUDA: torch.cuda.is_available() is False "
               "on this machine. Captures already stored read back without a GPU "
               "(dmi-sglang ls / show / export, dmi_sglang.open_store)")
        raise ConfigurationError(msg)
