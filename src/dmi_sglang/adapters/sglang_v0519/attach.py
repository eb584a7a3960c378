"""Attaching monitoring to a ModelRunner: before and after its weights load.

:func:`prepare` runs inside the ``ModelRunner.load_model`` hook BEFORE the original: it
checks the support matrix and the upstream basis, opens the store (a clear error before
any capture begins) and creates the transport (ring, arena and pinned staging are
allocated before SGLang sizes its KV cache). :func:`attach` runs AFTER the weights
loaded and before CUDA graphs are captured: it installs the capture points.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import attrs
import structlog

from dmi_sglang.adapters.sglang_v0519.monitor import SchedulerMonitor
from dmi_sglang.domain.hooks import Selection
from dmi_sglang.domain.ports import RecordSink
from dmi_sglang.domain.records import RunInfo
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.domain.support import check_support
from dmi_sglang.errors import CaptureError, UnsupportedConfigurationError

__all__ = ["Prepared", "attach", "prepare"]

log = structlog.get_logger(__name__)


@attrs.frozen
class Prepared:
    """What :func:`prepare` built, handed to :func:`attach`."""

    settings: Settings
    selection: Selection
    shape: ModelShape
    sink: RecordSink
    transport: Any
    run: RunInfo


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
    from dmi_sglang.adapters.sglang_v0519.plugin import registration_problems
    from dmi_sglang.adapters.sglang_v0519.qwen3 import register_hooked_models

    problems = list(registration_problems())
    problems += verify_upstream_basis()
    server_args = runner.server_args
    hf_config = runner.model_config.hf_config
    settings = Settings.from_env().resolve(model_path=str(server_args.model_path))
    facts = engine_facts(server_args, hf_config=hf_config)
    report = check_support(facts, allow_prefix_cache=settings.allow_prefix_cache)
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

    from dmi_sglang.adapters.clickhouse import open_sink
    from dmi_sglang.adapters.transport import create_transport

    run_id = settings.model_id or ""
    run = RunInfo(
        run_id=run_id,
        model_path=str(server_args.model_path),
        settings=tuple(sorted(settings.to_env(include_secrets=False).items())),
        captures=tuple((h.act_name, layer) for h, layer in selection.captures()),
        started_at=datetime.now(UTC).isoformat(),
    )
    sink = open_sink(settings.store())  # a store that cannot open fails here
    try:
        sink.start_run(run)
        transport = create_transport(
            payload_mb=settings.ring_payload_mb,
            pinned_mb=settings.ring_pinned_mb,
            task_entries=settings.ring_task_entries,
            padding_strip=settings.gpu_padding_strip,
            flush_timeout_us=settings.drain_flush_timeout_us,
            copy_threads=settings.drain_copy_threads,
            selection=selection,
            shape=shape,
            max_graph_batch=max(max_bs, 1) if graphs else 1,
            sink=sink,
            run_id=run_id,
            device=f"cuda:{runner.gpu_id}" if str(runner.device).startswith("cuda")
            else str(runner.device),
            max_prefill_tokens=chunk,
            max_requests=max_requests or max(max_bs, 1),
        )
    except BaseException:
        sink.close()
        raise
    log.info("dmi.prepared", run_id=run_id, hooks=list(selection.names),
             captures=len(selection.captures()), decode_graphs=graphs, max_graph_batch=max_bs,
             chunked_prefill=chunk, device_bytes=transport.device_bytes,
             store=settings.store().url)
    return Prepared(settings, selection, shape, sink, transport, run)


def attach(runner: Any, prepared: Prepared) -> SchedulerMonitor:
    """Install the capture points on the loaded model; the monitor that drives them."""
    from dmi_sglang.adapters.sglang_v0519.qwen3 import install_capture_points

    installed = install_capture_points(runner.model, prepared.transport.capturer)
    if not installed:
        msg = "no capture point was installed (empty selection?)"
        raise CaptureError(msg)
    log.info("dmi.attached", run_id=prepared.run.run_id, capture_points=len(installed))
    return SchedulerMonitor(
        run=prepared.run,
        selection=prepared.selection,
        shape=prepared.shape,
        transport=prepared.transport,
        sink=prepared.sink,
        strip=prepared.settings.gpu_padding_strip,
    )
