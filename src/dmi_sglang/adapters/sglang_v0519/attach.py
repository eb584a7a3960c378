"""Attaching monitoring to a ModelRunner: before and after its weights load.

:func:`prepare` runs inside the ``ModelRunner.load_model`` hook BEFORE the original: it
checks the support matrix and the upstream basis, then asks the capture factory the
composition root injected at registration to open the pipeline: the store (a clear
error before any capture begins) and the transport (ring, arena and pinned staging are
allocated before SGLang sizes its KV cache). :func:`attach` runs AFTER the weights
loaded and before CUDA graphs are captured: it installs the capture points and returns
the capture session the runtime hooks drive.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

import attrs
import structlog

from dmi_sglang.adapters.sglang_v0519 import _state
from dmi_sglang.domain.ports import CaptureSession, CaptureSpec
from dmi_sglang.domain.records import RunInfo
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.support import check_support
from dmi_sglang.errors import CaptureError, UnsupportedConfigurationError
from dmi_sglang.tensor_ports import OpenedCapture

__all__ = ["Prepared", "attach", "prepare"]

log = structlog.get_logger(__name__)


@attrs.frozen
class Prepared:
    """What :func:`prepare` built, handed to :func:`attach`."""

    spec: CaptureSpec
    opened: OpenedCapture


def _resolved(name: str, server_args: Any) -> Any:
    from sglang.srt.arg_groups.overrides import resolution_result

    return resolution_result(server_args, name)


def _decode_graph() -> tuple[bool, int]:
    """(decode graphs on, largest decode graph batch) from the resolved config."""
    from sglang.srt.runtime_context import get_exec

    decode = get_exec().graph.cuda_graph_config.decode
    enabled = str(decode.backend) not in ("disabled", "Backend.DISABLED")
    buckets = tuple(sorted(int(b) for b in decode.bs or ()))
    # The runner captures a subset of these (clamped to the request pool), never more.
    max_bs = buckets[-1] if buckets else int(decode.max_bs or 0)
    return enabled, max_bs


def prepare(runner: Any) -> Prepared:
    """Checks, store and transport, before any capture allocation or weight load.

    Raises:
        UnsupportedConfigurationError: every reason the configuration is refused.
        CapacityError: the ring cannot hold one capture tensor.
        StoreError: the store cannot be opened.
    """
    from dmi_sglang.adapters.sglang_v0519.facts import engine_facts, model_hooks, model_shape
    from dmi_sglang.adapters.sglang_v0519.pins import verify_upstream_basis
    from dmi_sglang.adapters.sglang_v0519.qwen3 import register_hooked_models

    problems = list(_state.registration_problems())
    problems += verify_upstream_basis()
    server_args = runner.server_args
    hf_config = runner.model_config.hf_config
    settings = Settings.from_env().resolve(model_path=str(server_args.model_path))
    facts = engine_facts(server_args, hf_config=hf_config)
    report = check_support(facts, allow_prefix_cache=settings.prefix_cache_allowed)
    problems += report.rejections
    if problems:
        raise UnsupportedConfigurationError(tuple(problems))
    for forced in report.forced:  # resolution should have applied them already
        msg = f"{forced.name} is still on in the scheduler: {forced.line}"
        raise UnsupportedConfigurationError((msg,))

    register_hooked_models()  # before the original load_model looks the class up
    shape = model_shape(hf_config, runner.model_config.dtype)
    selection = settings.selection.resolve(model_hooks(hf_config))
    if selection.omitted:
        log.info("dmi.hooks_omitted", hooks=list(selection.omitted),
                 why="the model has no such hook")
    graphs, max_bs = _decode_graph()
    chunk = int(_resolved("chunked_prefill_size", server_args) or 0)
    max_requests = int(_resolved("max_running_requests", server_args) or 0)
    if chunk <= 0:
        chunk = int(runner.model_config.context_len)

    factory = _state.STATE.factory
    if factory is None:
        msg = ("no capture factory was registered in this process (the plugin entry point "
               "dmi_sglang.app.plugin:register did not run)")
        raise CaptureError(msg)
    run_id = settings.model_id or ""
    run = RunInfo(
        run_id=run_id,
        model_path=str(server_args.model_path),
        settings=tuple(sorted(settings.to_env(include_secrets=False).items())),
        captures=tuple((h.act_name, layer) for h, layer in selection.captures()),
        started_at=datetime.now(UTC).isoformat(),
    )
    spec = CaptureSpec(
        settings=settings,
        run=run,
        selection=selection,
        shape=shape,
        max_graph_batch=max(max_bs, 1) if graphs else 1,
        device=f"cuda:{runner.gpu_id}" if str(runner.device).startswith("cuda")
        else str(runner.device),
        max_prefill_tokens=chunk,
        max_requests=max_requests or max(max_bs, 1),
        read_address=_read_address(runner),
    )
    opened = factory.open(spec)  # a store that cannot open, or a ring too small, fails here
    log.info("dmi.prepared", run_id=run_id, hooks=list(selection.names),
             captures=len(selection.captures()), decode_graphs=graphs, max_graph_batch=max_bs,
             chunked_prefill=chunk, device_bytes=opened.device_bytes,
             store=settings.store().url)
    return Prepared(spec, opened)


def attach(runner: Any, prepared: Prepared) -> CaptureSession:
    """Install the capture points on the loaded model; the session that drives them."""
    from dmi_sglang.adapters.sglang_v0519.qwen3 import install_capture_points

    installed = install_capture_points(runner.model, prepared.opened.capturer)
    if not installed:
        msg = "no capture point was installed (empty selection?)"
        raise CaptureError(msg)
    log.info("dmi.attached", run_id=prepared.spec.run.run_id, capture_points=len(installed))
    return prepared.opened.session


def _read_address(runner: Any) -> str:
    """Where the store owner this scheduler starts answers its server's store reads: the
    address the server's main process chose, in a server's first tensor-parallel rank
    only (empty: none)."""
    if os.environ.get(_state.SERVER_MARK) != "1" or int(getattr(runner, "tp_rank", 0) or 0) != 0:
        return ""
    return os.environ.get(_state.READS_ADDRESS, "")
