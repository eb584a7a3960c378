"""The composition root: the only module that names concrete adapters.

* store URL -> record sink and record reader (:func:`open_sink`, :func:`reader_for`);
* installed SGLang release -> the SGLang adapter (:func:`sglang_adapter`; an unknown
  release is refused with the supported list);
* the capture pipeline (sink + transport + capture session) that the SGLang adapter opens
  in each scheduler through the :class:`~dmi_sglang.tensor_ports.CaptureFactory` it is
  handed at registration (:class:`PipelineFactory`), so no adapter imports another;
* a CPU reference capture (:func:`run_reference_capture`): the transformers reference
  model, the demo checkpoint and the same sink, driven by :mod:`dmi_sglang.app.reference`.

A sibling SGLang adapter is a new ``adapters/sglang_vXXXX`` package plus one line in
:data:`SGLANG_ADAPTERS`; another store backend is a new adapter plus a branch in
:func:`open_sink` and :func:`reader_for`. ``docs/architecture.md`` has the checklist.

Store owner (docs/architecture.md): a capture into the embedded store writes through a
store owner process that the scheduler starts when the capture opens
(:mod:`dmi_sglang.app.store_owner`); it also answers a server's reads. The scheduler's
interpreter keeps only the transport.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import structlog

from dmi_sglang.app.handle import CaptureHandle, NoStoreHandle
from dmi_sglang.app.null_sink import NullSink
from dmi_sglang.app.reference import (
    ReferenceRequest,
    ReferenceResult,
    capture_reference,
    reference_run,
)
from dmi_sglang.app.session import SchedulerMonitor
from dmi_sglang.app.store_budget import StoreBudget
from dmi_sglang.app.store_owner import OwnedSink, Service, open_owned_sink
from dmi_sglang.columns import RecordBatchReader, RecordSink
from dmi_sglang.domain.hooks import ModelHooks, Selection
from dmi_sglang.domain.ports import CaptureReads, CaptureSpec, RunClaims
from dmi_sglang.domain.records import TOPK_KERNEL_KEY, storable_request_id
from dmi_sglang.domain.sampling import RequestSample
from dmi_sglang.domain.settings import Settings, monitoring_requested
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import (
    ConfigurationError,
    RunExistsError,
    StoreError,
    UnsupportedConfigurationError,
    UsageError,
)
from dmi_sglang.tensor_ports import OpenedCapture, SGLangAdapter

__all__ = [
    "DEMO_MODEL_NAME",
    "SGLANG_ADAPTERS",
    "PipelineFactory",
    "check_reference_packages",
    "claim_new_run",
    "handle_for",
    "installed_sglang",
    "log_plan",
    "model_rows",
    "nearest_sglang_adapter",
    "open_sink",
    "reader_for",
    "reference_hooks",
    "register_plugin",
    "release_unused_claim",
    "run_claims",
    "run_reference_capture",
    "sglang_adapter",
    "write_demo_checkpoint",
]

log = structlog.get_logger(__name__)

_CLAIMED_HERE: set[tuple[str, str]] = set()
"""``(store url, run id)`` claims this process won."""

SGLANG_ADAPTERS: Mapping[str, str] = {
    "0.5.19": "dmi_sglang.adapters.sglang_v0519.adapter",
}
"""Installed SGLang release -> the module whose ``ADAPTER`` serves it."""


# -- storage ---------------------------------------------------------------------------
def open_sink(store: StoreConfig) -> RecordSink:
    """The record sink of ``store``: nothing stored for ``none``, else ClickHouse.

    Raises:
        StoreError: the store cannot be opened or its tables have another layout.
    """
    if store.kind is StoreKind.NONE:
        return NullSink()
    from dmi_sglang.adapters.clickhouse import ClickHouseSink

    return ClickHouseSink(store)


def open_capture_sink(settings: Settings, read_address: str = "") -> RecordSink:
    """The sink a scheduler's capture writes: for the embedded store, through a store
    owner process started here (:mod:`dmi_sglang.app.store_owner`; with ``read_address``
    it also answers a server's reads there), the batches crossing its socket or, with
    ``DMX_OWNER_RING_MB``, shared memory; otherwise :func:`open_sink`.

    Raises:
        StoreError: the store cannot be opened (by the owner, or here).
    """
    if settings.store().kind is StoreKind.EMBEDDED:
        from dmi_sglang.adapters.owner import RemoteSink

        def remote(address: str) -> RecordSink:  # with a shared ring of DMX_OWNER_RING_MB
            return RemoteSink(address, shared_bytes=settings.owner_ring_mb << 20)

        # the scheduler's sink is the owner's only writer: one rank (the support rules
        # admit no other)
        return open_owned_sink(settings, read_address, remote, sole_writer=True)
    return open_sink(settings.store())


def owner_services(settings: Settings, writes: str,
                   reads: str) -> tuple[RecordSink, list[Service]]:
    """In a store owner process: the store's sink and the channels that serve it, the
    write channel at ``writes`` first, then (with ``reads``) the read channel.

    Raises:
        StoreError: the store cannot be opened, or a channel cannot be bound.
    """
    from dmi_sglang.adapters.owner import ReadService, SinkService

    store = settings.store()
    sink = open_sink(store)
    services: list[Service] = []
    try:
        services.append(SinkService(sink, writes))
        if reads:
            services.append(ReadService(reader_for(store), reads))
    except BaseException:
        for service in services:
            service.close()
        sink.close()
        raise
    return sink, services


def reader_for(store: StoreConfig) -> RecordBatchReader:
    """The record reader of ``store`` (opens nothing until used).

    Raises:
        StoreError: ``store`` is ``none`` (there is nothing to read).
    """
    if store.kind is StoreKind.NONE:
        msg = "the store is 'none' (no persistence): there is nothing to read"
        raise StoreError(msg)
    from dmi_sglang.adapters.clickhouse import ClickHouseReader

    return ClickHouseReader(store)


def run_claims(store: StoreConfig) -> RunClaims | None:
    """Where run ids are claimed (None for ``none``: nothing is stored, nothing mixes)."""
    if store.kind is StoreKind.NONE:
        return None
    from dmi_sglang.adapters.clickhouse import ClickHouseRunClaims

    return ClickHouseRunClaims(store)


def claim_new_run(settings: Settings) -> None:
    """Claim the run id of ``settings`` in its store before an engine starts.

    Raises:
        RunExistsError: the store holds a run of that id, or another start claimed it;
            the message names the run, its status and the way out.
        StoreError: the store cannot be opened.
    """
    store = settings.store()
    claims = run_claims(store)
    run_id = settings.model_id or ""
    if claims is None:
        return
    outcome = claims.claim(run_id)
    if outcome.won:
        _CLAIMED_HERE.add((store.url, run_id))
        log.info("dmi.run_claimed", run_id=run_id, store=store.url)
        return
    way_out = (f"remove it with `dmi-sglang rm {run_id} --db {store.url}`, or give this "
               "engine another id (dmx_model_id / DMX_MODEL_ID, or none to generate one)")
    if outcome.existing is not None:
        msg = (f"run {run_id!r} already exists in {store.url} (status "
               f"{outcome.existing.status.value}, started {outcome.existing.started_at}); "
               f"a run id names exactly one run and dmi-sglang never adds to an earlier "
               f"run: {way_out}")
    else:
        msg = (f"run id {run_id!r} is claimed in {store.url} by another engine start "
               f"(starting now, or it stopped before recording the run): {way_out}")
    raise RunExistsError(msg)


def release_unused_claim(store: StoreConfig, run_id: str) -> None:
    """Drop the claim this process won for a run id whose engine never recorded the run
    (its start failed). A claim won by another start is never touched."""
    if (store.url, run_id) not in _CLAIMED_HERE:
        return
    try:
        recorded = reader_for(store).run(run_id) is not None
    except StoreError as exc:  # best effort: `dmi-sglang rm` frees it too
        log.warning("dmi.claim_not_released", run_id=run_id, error=str(exc))
        return
    if not recorded and _release_claim(store, run_id):
        _CLAIMED_HERE.discard((store.url, run_id))


def _release_claim(store: StoreConfig, run_id: str) -> bool:
    """Drop the claim of ``run_id``, best effort (`dmi-sglang rm` frees it too); whether
    it was dropped. Used where the claim is known to be this start's: in the main process
    (:func:`release_unused_claim`), or in a scheduler whose capture could not open (the
    main process won the claim before spawning it: a lost claim never gets there)."""
    claims = run_claims(store)
    if claims is None:
        return False
    try:
        claims.release(run_id)
    except StoreError as exc:
        log.warning("dmi.claim_not_released", run_id=run_id, error=str(exc))
        return False
    return True


def handle_for(store: StoreConfig, run_id: str, request_id: str) -> CaptureHandle | NoStoreHandle:
    """The lazy handle of one request: free until an attribute is read."""
    if store.kind is StoreKind.NONE:
        return NoStoreHandle(run_id, request_id)
    return CaptureHandle(run_id, storable_request_id(request_id), lambda: reader_for(store))


# -- capture ---------------------------------------------------------------------------
class PipelineFactory:
    """The :class:`~dmi_sglang.tensor_ports.CaptureFactory` handed to SGLang adapters."""

    def claim_run(self, settings: Settings) -> None:
        """Claim the run id in the main process, before the scheduler starts (see
        :func:`claim_new_run`)."""
        claim_new_run(settings)

    def open(self, spec: CaptureSpec) -> OpenedCapture:
        """Open the store, create the transport, start the run, build the session.

        Raises:
            StoreError: the store cannot be opened.
            CapacityError: the ring cannot hold one capture tensor.
        """
        from dmi_sglang.adapters.transport import engine_transport

        settings = spec.settings
        log_plan(spec.selection, spec.shape, stored=settings.store().kind is not StoreKind.NONE,
                 tok_s=settings.plan_tok_s, sample=settings.request_sample)
        try:
            sink = open_capture_sink(settings, spec.read_address)  # a bad store fails here
        except BaseException:
            _release_claim(settings.store(), spec.run.run_id)
            raise
        transport = None
        started = False
        try:
            transport = engine_transport(
                settings,
                selection=spec.selection,
                shape=spec.shape,
                max_graph_batch=spec.max_graph_batch,
                sink=sink,
                run_id=spec.run.run_id,
                device=spec.device,
                max_prefill_tokens=spec.max_prefill_tokens,
                max_requests=spec.max_requests,
            )
            run = spec.run
            if transport.topk_kernel is not None:  # what auto resolved to, on record
                run = attrs.evolve(run, settings=(*run.settings,
                                                  (TOPK_KERNEL_KEY, transport.topk_kernel)))
            sink.start_run(run)  # only once the transport exists: no orphan run row
            started = True
            from dmi_sglang.adapters.sglang_v0519.batch import capture_param, request_cancelled

            session = SchedulerMonitor(
                run=run,
                selection=spec.selection,
                shape=spec.shape,
                transport=transport,
                sink=sink,
                strip=settings.gpu_padding_strip,
                sample=RequestSample(settings.request_sample),
                asked=capture_param,
                cancelled=request_cancelled,
                gate=StoreBudget(settings.store(), settings.store_max_gb,
                                 lambda: transport.stats().bytes),
            )
        except BaseException:
            releases = ((transport.stop,) if transport is not None else ()) + (sink.close,)
            for release in releases + ((sink.end,) if isinstance(sink, OwnedSink) else ()):
                try:
                    release()
                except Exception as exc:  # the first failure is the one to report
                    log.warning("dmi.pipeline_release_failed", error=repr(exc))
            if not started:
                _release_claim(settings.store(), spec.run.run_id)
            raise
        return OpenedCapture(session, transport.capturer, transport.device_bytes)

    def serving_reads(self, settings: Settings, read_address: str) -> CaptureReads | None:
        """A server's reads of its store (None: the run stores nothing): through the
        store's owner at ``read_address`` for the embedded store, directly for a
        ClickHouse server."""
        store = settings.store()
        if store.kind is StoreKind.NONE:
            return None
        from dmi_sglang.app.export import StoreReads

        if store.kind is StoreKind.EMBEDDED:
            from dmi_sglang.adapters.owner import RemoteReader

            try:
                remote = RemoteReader(read_address)
            except StoreError as exc:  # no usable channel: the endpoints say so (404)
                log.warning("dmi.reads_unavailable", address=read_address, error=str(exc))
                return None
            return StoreReads(lambda: remote)
        return StoreReads(lambda: reader_for(store))


# -- SGLang ----------------------------------------------------------------------------
def sglang_flags_set(extra: Sequence[str], flags: Sequence[str]) -> list[str]:
    """The boolean ``flags`` SGLang's own server parser sets from the server arguments
    ``extra`` (abbreviations and ``--config`` files included); none without SGLang (the
    start refuses that anyway)."""
    from dmi_sglang.adapters.sglang_v0519.launch_args import flags_set

    try:
        return flags_set(extra, flags)
    except ImportError:  # SGLang itself
        return []


def installed_sglang() -> str | None:
    """The installed SGLang release (local version label dropped), or None."""
    try:
        return importlib.metadata.version("sglang").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def sglang_adapter(version: str | None = None) -> SGLangAdapter:
    """The adapter for ``version`` (default: the installed SGLang).

    Raises:
        UnsupportedConfigurationError: SGLang is missing, or no adapter serves its release.
    """
    version = installed_sglang() if version is None else version
    module = SGLANG_ADAPTERS.get(version or "")
    if module is None:
        found = f"sglang {version} is installed" if version else "sglang is not installed"
        msg = (f"{found}; dmi-sglang supports sglang=={' or =='.join(SGLANG_ADAPTERS)} "
               "(pip install 'dmi-sglang[sglang]')")
        raise UnsupportedConfigurationError((msg,))
    adapter: SGLangAdapter = importlib.import_module(module).ADAPTER
    return adapter


def nearest_sglang_adapter() -> SGLangAdapter:
    """The installed SGLang's adapter, or else the newest one.

    For what must still work on an SGLang without an adapter: the newest adapter's hooks
    record the version problem and its main-process check refuses the engine, so a
    monitored engine on an unknown SGLang fails loudly instead of serving unmonitored;
    ``DMIEngine`` extends that SGLang's Engine class and refuses at construction.
    """
    try:
        return sglang_adapter()
    except UnsupportedConfigurationError:
        return sglang_adapter(list(SGLANG_ADAPTERS)[-1])


PLAN_REQUEST = (256, 128)
"""The request (prompt, generated tokens) the startup plan is logged for (as ``dmi-sglang
plan``'s defaults)."""


def log_plan(selection: Selection, shape: ModelShape, *, stored: bool,
             tok_s: int | None, sample: float = 1.0) -> None:
    """Log the bandwidth plan of this capture (``dmi.plan``; of the ``sample`` of requests
    it captures); with ``DMX_PLAN_TOK_S`` set, warn when a stage cannot follow that many
    generated tokens per second."""
    from dmi_sglang.domain.bandwidth import plan_bandwidth

    plan = plan_bandwidth(selection, shape, prompt_tokens=PLAN_REQUEST[0],
                          completion_tokens=PLAN_REQUEST[1], tok_s=tok_s, stored=stored,
                          sample=sample)
    limits = {s.stage: round(s.max_tok_s) for s in plan.stages if s.max_tok_s is not None}
    log.info("dmi.plan", request=f"{PLAN_REQUEST[0]}+{PLAN_REQUEST[1]}",
             bytes_per_request=plan.bytes_per_request,
             bytes_per_prompt_token=round(plan.bytes_per_prompt_token),
             bytes_per_generated_token=round(plan.bytes_per_generated_token),
             max_tok_s=limits, limiting=plan.limiting.stage)
    if plan.bound is not None and plan.bound < 1.0:
        log.warning("dmi.plan_cannot_keep_up", tok_s=tok_s, needed_gbps=round(
            (plan.needed_bps or 0) / 1e9, 3), stage=plan.limiting.stage,
            keeps_up_with=round(plan.bound, 3),
            hint="select fewer hooks, layers or positions (dmi-sglang plan), or capture "
            "without storing")


def model_rows(config: Mapping[str, Any]) -> tuple[ModelHooks, ModelShape]:
    """The hooks a model offers and its row shapes, from its ``config.json`` (no SGLang
    and no GPU needed: for planning), in the dtype SGLang serves it in (``auto``;
    bfloat16 when the file names none).

    Raises:
        UnsupportedConfigurationError: the architecture has no hooked model.
        UsageError: the file lacks a size the row shapes need.
    """
    from dmi_sglang.adapters.sglang_v0519.facts import model_hooks, model_shape, served_dtype

    hf = SimpleNamespace(**config)
    try:
        hooks = model_hooks(hf)
        shape = model_shape(hf, served_dtype(dict(config)) or "bfloat16")
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as exc:
        msg = f"config.json lacks a usable model size ({exc})"
        raise UsageError(msg) from None
    sizes = {"num_hidden_layers": shape.num_layers, "hidden_size": shape.hidden,
             "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
             "head_dim": shape.head_dim, "intermediate_size": shape.intermediate,
             "vocab_size": shape.vocab}
    bad = [f"{name}={value}" for name, value in sizes.items()
           if value < (0 if name == "intermediate_size" else 1)]  # 0: no MLP
    if bad:
        msg = f"config.json lacks a usable model size ({', '.join(bad)}: out of range)"
        raise UsageError(msg)
    return hooks, shape


def register_plugin() -> None:
    """The ``sglang.srt.plugins`` entry point's work: hand the capture factory to the
    adapter of the installed SGLang, which installs its hooks when monitoring is requested.

    Cheap, idempotent, never raises (SGLang would swallow it). On an SGLang release
    without an adapter, the newest adapter registers and refuses the engine at startup
    when monitoring is requested (see :func:`nearest_sglang_adapter`).
    """
    try:
        sglang_adapter()
    except UnsupportedConfigurationError as exc:
        try:
            requested = monitoring_requested()
        except ConfigurationError:
            requested = True
        if requested:
            log.error("dmi.plugin.unsupported_sglang", error=str(exc))
    nearest_sglang_adapter().register(PipelineFactory())


# -- demo checkpoint -------------------------------------------------------------------
def write_demo_checkpoint(path: Path, *, layers: int) -> Path:
    """Write the small random-weight Qwen3 checkpoint (transformers and tokenizers)."""
    from dmi_sglang.adapters.demo_model import write_demo_checkpoint as write

    return write(path, layers=layers)


# -- CPU reference capture -------------------------------------------------------------
DEMO_MODEL_NAME = "qwen3-demo"
"""The directory name of the demo checkpoint a reference capture generates (and so the
start of its run ids)."""


def check_reference_packages() -> None:
    """Import what a reference capture needs (torch, transformers, tokenizers).

    Raises:
        ModuleNotFoundError: one is missing (the ``[demo]`` extra).
    """
    from dmi_sglang.adapters.transformers_ref import check_packages

    check_packages()


def reference_hooks(model_dir: Path | None, *, layers: int) -> ModelHooks:
    """The hooks and layers a reference capture of ``model_dir`` offers, from its
    ``config.json`` alone (None: the demo checkpoint of ``layers`` layers).

    Raises:
        ConfigurationError: no readable ``config.json``, or not a ``Qwen3ForCausalLM``
            checkpoint.
    """
    from dmi_sglang.adapters.transformers_ref import model_hooks

    return model_hooks(_reference_config(model_dir, layers))


def reference_limits(model_dir: Path | None, *,
                     layers: int) -> tuple[ModelHooks, ModelShape, int | None]:
    """The hooks (:func:`reference_hooks`), row shapes and context length (None: its
    ``config.json`` says none) of a reference capture of ``model_dir`` (None: the demo
    checkpoint of ``layers`` layers), from one read of the config, so a selection or a
    length it cannot take is refused before any model is made or loaded.

    Raises:
        ConfigurationError: as :func:`reference_hooks`, or sizes missing from the config.
    """
    from dmi_sglang.adapters.transformers_ref import model_hooks, model_shape

    config = _reference_config(model_dir, layers)
    hooks = model_hooks(config)
    try:
        shape = model_shape(config)
    except (KeyError, TypeError, ValueError) as exc:
        msg = f"its config.json gives no usable size {exc}"
        raise ConfigurationError(msg) from None
    positions = config.get("max_position_embeddings")
    return hooks, shape, int(positions) if positions else None


def _reference_config(model_dir: Path | None, layers: int) -> dict[str, Any]:
    from dmi_sglang.adapters.demo_model import demo_config
    from dmi_sglang.adapters.transformers_ref import read_config

    return dict(read_config(model_dir)) if model_dir is not None else demo_config(layers)


def run_reference_capture(
    settings: Settings,
    prompts: Sequence[str],
    *,
    model_dir: Path | None,
    layers: int,
    max_new_tokens: int,
) -> ReferenceResult:
    """A CPU reference capture into the store of ``settings``, committed.

    Claims the run id, loads ``model_dir`` with transformers (None: a fresh demo
    checkpoint of ``layers`` layers in a temporary directory, removed afterwards), opens
    the store's sink and runs :func:`~dmi_sglang.app.reference.capture_reference`.
    Request ids are ``req-0``, ``req-1``, ... in prompt order.

    Raises:
        RunExistsError: the run id names a run already.
        UsageError: the store is ``none``, or a prompt has no tokens.
        StoreError: the store cannot be opened or written.
        ModuleNotFoundError: torch, transformers or tokenizers is missing.
    """
    from dmi_sglang.adapters.transformers_ref import TransformersReference

    store = settings.store()
    if store.kind is StoreKind.NONE:
        msg = "the store is 'none': a reference capture would store nothing; pass --db"
        raise UsageError(msg)
    check_reference_packages()
    claim_new_run(settings)
    run_id = settings.model_id or ""
    with tempfile.TemporaryDirectory(prefix="dmi-reference-") as tmp:
        try:
            note = None
            if model_dir is None:
                model_dir = write_demo_checkpoint(Path(tmp) / DEMO_MODEL_NAME, layers=layers)
                note = (f"random-weight demo checkpoint, {layers} layers, seed 0 "
                        f"(dmi-sglang demo-model DIR --layers {layers})")
            model = TransformersReference.load(model_dir)
            requests = [ReferenceRequest(f"req-{i}", tuple(model.encode(p)))
                        for i, p in enumerate(prompts)]
            empty = [i for i, r in enumerate(requests) if not r.prompt_ids]
            if empty:
                msg = f"prompt {empty[0] + 1} ({prompts[empty[0]]!r}) has no tokens"
                raise UsageError(msg)
            _, _, context = reference_limits(model_dir, layers=layers)
            longest = max(len(r.prompt_ids) for r in requests)
            if context is not None and longest + max_new_tokens > context:
                msg = (f"--max-new-tokens {max_new_tokens} with a prompt of {longest} "
                       f"tokens exceeds the model's context of {context} (SGLang refuses "
                       f"such a request); accepted: at most {context - longest}")
                raise UsageError(msg)
            selection = settings.selection.resolve(model.hooks)
            run = reference_run(settings, model, selection, model_note=note,
                                model_path=None if note is None else DEMO_MODEL_NAME)
            sink = open_sink(store)
        except BaseException:
            release_unused_claim(store, run_id)
            raise
        try:
            return capture_reference(model, sink, run, selection, requests,
                                     max_new_tokens=max_new_tokens)
        finally:
            sink.close()
