"""The upstream basis: what of SGLang 0.5.19 this adapter was written against.

The capture points wrap upstream module instances and rely on how SGLang calls them (the
fused norms' second output, the arguments handed to RoPE and RadixAttention, ...), and the
runtime hooks rely on class methods and their argument order. This module pins both: the
sha256 of the source files whose call structure the wrap points depend on, and the
classes, call signatures and ForwardBatch/ServerArgs fields used. :func:`verify_upstream_basis`
runs at startup; any difference means this adapter's assumptions must be re-checked
against the new code (docs/hooked-qwen3.md lists them), not that it is known to be wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "PINNED_FIELDS",
    "PINNED_FILES",
    "PINNED_SIGNATURES",
    "PINNED_VERSION",
    "verify_upstream_basis",
]

PINNED_VERSION = "0.5.19"

PINNED_FILES: Mapping[str, str] = {
    "srt/models/qwen3.py": "39c7c9c6b0107f12ac76cd2b6b54a0694c8540c1bb9588a380e05fcd3ee93e6b",
    "srt/models/qwen2.py": "41741eb780a3f75bc3ae4f43cc09d538b15752b1d5da34b5a96d8bca36970fdc",
    "srt/layers/communicator.py":
        "fca5d8a6d52d5681c8f6faa78ae4c6157cde96d4be06a55c59555b3f6ae88caf",
    "srt/layers/layernorm.py":
        "392508942d4a9233af38d7c2984f5db49bde0ebc3d9449f11a3507238f981b15",
    "srt/models/utils.py": "7a05f7b446086ea6427b562b895355c1dd5b0b2b2563467d8daf11bcbfa979d1",
    "srt/layers/rotary_embedding/base.py":
        "8b36007cadd94dae863bcfc4fb61dd83565f8e08788b1d6de15af65848f21bab",
}
"""sha256 of source files, relative to the ``sglang`` package directory."""

_Q3 = "sglang.srt.models.qwen3"
_Q2 = "sglang.srt.models.qwen2"
_MR = "sglang.srt.model_executor.model_runner"
_RUN = "sglang.srt.model_executor.runner"
_FB = ("forward_batch",)
_SELF = ("self",)

PINNED_SIGNATURES: Mapping[str, tuple[str, ...] | None] = {
    # The model the capture points wrap (argument positions are read by the wrappers).
    f"{_Q3}:Qwen3ForCausalLM.forward": (
        *_SELF, "input_ids", "positions", *_FB, "input_embeds", "get_embedding",
        "pp_proxy_tensors"),
    f"{_Q2}:Qwen2Model.forward": (
        *_SELF, "input_ids", "positions", *_FB, "input_embeds", "pp_proxy_tensors"),
    f"{_Q3}:Qwen3DecoderLayer.forward": (
        *_SELF, "positions", "hidden_states", *_FB, "residual", "post_residual_addition"),
    f"{_Q3}:Qwen3Attention.forward": (*_SELF, "positions", "hidden_states", *_FB),
    f"{_Q3}:Qwen3Attention.forward_prepare_native": (*_SELF, "positions", "hidden_states"),
    f"{_Q2}:Qwen2MLP.forward": (*_SELF, "x", *_FB),
    "sglang.srt.layers.layernorm:RMSNorm.forward_cuda": (
        *_SELF, "x", "residual", "post_residual_addition", "quant_linear"),
    "sglang.srt.layers.layernorm:RMSNorm.forward_native": (
        *_SELF, "x", "residual", "post_residual_addition", "quant_linear"),
    "sglang.srt.layers.rotary_embedding.base:RotaryEmbedding.forward_cuda": (
        *_SELF, "positions", "query", "key", "offsets", "fused_set_kv_buffer_arg"),
    "sglang.srt.layers.radix_attention:RadixAttention.forward": (
        *_SELF, "q", "k", "v", *_FB, "save_kv_cache", "key_value_num_tokens", "**kwargs"),
    "sglang.srt.layers.linear:RowParallelLinear.forward": (
        *_SELF, "input_", "skip_all_reduce", "forward_batch", "output_tensor"),
    "sglang.srt.layers.logits_processor:LogitsProcessor.forward": (
        *_SELF, "input_ids", "hidden_states", "lm_head", "logits_metadata",
        "aux_hidden_states", "hidden_states_before_norm"),
    # The runtime hook targets.
    f"{_MR}:ModelRunner.load_model": _SELF,
    f"{_MR}:ModelRunner.forward": (
        *_SELF, *_FB, "skip_attn_backend_init", "pp_proxy_tensors", "reinit_attn_backend",
        "split_forward_count"),
    f"{_RUN}.decode_cuda_graph_runner:DecodeCudaGraphRunner.can_run_graph": (*_SELF, *_FB),
    f"{_RUN}.decode_cuda_graph_runner:DecodeCudaGraphRunner.load_batch": (
        *_SELF, *_FB, "pp_proxy_tensors"),
    f"{_RUN}.eager_runner:EagerRunner.load_batch": (
        *_SELF, *_FB, "pp_proxy_tensors", "**kwargs"),
    f"{_RUN}.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_run_graph": (*_SELF, *_FB),
    "sglang.srt.beam_search.coordinator:BeamCoordinator.validate_and_init": (
        *_SELF, "req", "recv_req"),
    "sglang.srt.managers.scheduler:Scheduler": None,
    "sglang.srt.managers.scheduler:Scheduler.handle_shutdown": (*_SELF, "recv_req"),
    "sglang.srt.managers.scheduler:Scheduler.abort_request": (*_SELF, "recv_req"),
    "sglang.srt.managers.schedule_batch:ScheduleBatch.retract_decode": _SELF,
    "sglang.srt.managers.scheduler:Scheduler._abort_on_waiting_timeout": _SELF,
    "sglang.srt.managers.scheduler:Scheduler._abort_on_queued_limit": (*_SELF, "recv_req"),
    "sglang.srt.managers.scheduler:Scheduler.on_idle": _SELF,
    "sglang.srt.managers.scheduler:Scheduler.maybe_sleep_on_idle": _SELF,
    "sglang.srt.entrypoints.engine:Engine.collective_rpc": (*_SELF, "method", "**kwargs"),
    "sglang.srt.server_args:ServerArgs.check_server_args": _SELF,
    "sglang.srt.server_args:ServerArgs.resolve_once": _SELF,
    "sglang.srt.arg_groups.overrides:resolution_result": ("server_args", "field", "default"),
    "sglang.srt.models.registry:ModelRegistry": None,
}
"""``module:qualname`` -> parameter names (``*args`` / ``**kwargs`` / ``kw:name`` marked),
or None where only existence matters."""

_FB_FIELDS = ("forward_mode", "batch_size", "input_ids", "positions", "rids", "seq_lens",
              "seq_lens_cpu", "seq_lens_sum", "extend_seq_lens_cpu", "extend_prefix_lens_cpu")
_SA_FIELDS = ("tp_size", "pp_size", "dp_size", "enable_dp_attention", "attn_cp_size",
              "nnodes", "speculative_algorithm", "enable_two_batch_overlap", "enable_pdmux",
              "disaggregation_mode", "enable_lora", "lora_paths", "dllm_algorithm",
              "enable_mis", "enable_layernorm_sp", "enable_torch_compile", "rl_on_policy_target",
              "model_impl",
              "num_continuous_decode_steps", "forward_hooks", "startup_weight_load_mode",
              "cuda_graph_config", "disable_radix_cache", "is_embedding", "dtype")

PINNED_FIELDS: Mapping[str, tuple[str, ...]] = {
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch": _FB_FIELDS,
    "sglang.srt.server_args:ServerArgs": _SA_FIELDS,
}
"""Dataclass fields read by ``batch.py`` and ``facts.py``."""


def verify_upstream_basis() -> list[str]:
    """Every difference between the installed SGLang and the pinned basis (empty: none).

    Never raises; an import failure is reported as a problem.
    """
    problems: list[str] = []
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ["sglang is not installed"]
    if version != PINNED_VERSION:
        problems.append(f"sglang {version} is installed; the pinned basis is {PINNED_VERSION}")
    problems += _file_problems()
    for target, expected in PINNED_SIGNATURES.items():
        problems += _signature_problems(target, expected)
    for target, fields in PINNED_FIELDS.items():
        problems += _field_problems(target, fields)
    return problems


def _file_problems() -> list[str]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return ["the sglang package directory cannot be located"]
    root = Path(spec.origin).parent
    problems = []
    for rel, digest in PINNED_FILES.items():
        try:
            actual = hashlib.sha256((root / rel).read_bytes()).hexdigest()
        except OSError as exc:
            problems.append(f"sglang/{rel}: cannot be read ({exc.strerror})")
            continue
        if actual != digest:
            problems.append(f"sglang/{rel}: sha256 {actual} differs from the pinned {digest}")
    return problems


def _resolve(target: str) -> Any:
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _params(obj: Any) -> tuple[str, ...]:
    marks: dict[Any, str] = {inspect.Parameter.VAR_POSITIONAL: "*",
                             inspect.Parameter.VAR_KEYWORD: "**",
                             inspect.Parameter.KEYWORD_ONLY: "kw:"}
    return tuple(marks.get(p.kind, "") + p.name
                 for p in inspect.signature(obj).parameters.values())


def _signature_problems(target: str, expected: tuple[str, ...] | None) -> list[str]:
    try:
        obj = _resolve(target)
    except Exception as exc:  # an import error or a missing attribute, reported as such
        return [f"{target}: cannot be resolved ({type(exc).__name__}: {exc})"]
    if expected is None:
        return []
    actual = _params(obj)
    if actual != expected:
        return [f"{target}: parameters {actual} differ from the pinned {expected}"]
    return []


def _field_problems(target: str, fields: tuple[str, ...]) -> list[str]:
    try:
        cls = _resolve(target)
    except Exception as exc:  # as above
        return [f"{target}: cannot be resolved ({type(exc).__name__}: {exc})"]
    present = {f.name for f in dataclasses.fields(cls)}
    missing = [f for f in fields if f not in present]
    return [f"{target}: fields {missing} are gone"] if missing else []
