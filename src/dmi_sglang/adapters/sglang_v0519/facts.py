"""Support facts from SGLang 0.5.19's *resolved* configuration, and Qwen3's shape and hooks.

SGLang 0.5.19 keeps the operator's input in the ServerArgs fields and stores what
resolution decided as declarations beside them (``server_args.py`` ``resolve_once``;
``arg_groups/overrides.py`` ``resolution_result``): ``server_args.disable_cuda_graph`` stays
False when resolution disabled the graphs. Every value here is therefore read through
``resolution_result``, which answers with the declaration when there is one and the field
otherwise. Architectures, activation dtype and generation-ness come from the model config
SGLang memoised during resolution (``model_config_of``); when that is not available in the
main process (a dummy or remote model path), a local ``config.json`` is read instead, and
what still cannot be decided is left to the scheduler's check (which has the hf_config).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import structlog

from dmi_sglang.adapters.sglang_v0519.version import SGLANG_VERSION, TORCH_PREFIX, installed
from dmi_sglang.domain.hooks import PRESETS, ModelHooks
from dmi_sglang.domain.settings import Settings, monitoring_requested
from dmi_sglang.domain.shapes import DType, ModelShape
from dmi_sglang.domain.support import (
    REJECTIONS,
    SUPPORTED_ARCHITECTURES,
    EngineFacts,
    SupportReport,
    check_support,
)
from dmi_sglang.errors import UnsupportedConfigurationError

__all__ = [
    "QWEN3_HOOKS",
    "engine_facts",
    "main_process_check",
    "model_hooks",
    "model_shape",
]

log = structlog.get_logger(__name__)

QWEN3_HOOKS: frozenset[str] = frozenset(PRESETS["sglang-full"]) - {
    "pos_embed",
    "router_logits",
    "topk_ids",
    "topk_weights",
}
"""Hooks the hooked Qwen3 offers: sglang-full minus pos_embed (RoPE) and MoE routing."""

_DTYPE_NAMES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


@attrs.frozen
class _Collected:
    facts: EngineFacts
    undecided: frozenset[str]
    """Names of support rules whose input could not be read in this process."""


def engine_facts(server_args: Any, *, hf_config: Any = None) -> EngineFacts:
    """The support facts of a ServerArgs record, from SGLang's resolved values.

    Args:
        server_args: a ``sglang.srt.server_args.ServerArgs`` (resolved, as it is when
            ``check_server_args`` runs and in the scheduler).
        hf_config: the model's HF config when the caller has it (the scheduler:
            ``model_runner.model_config.hf_config``); otherwise SGLang's memoised model
            config, then a local ``config.json``.
    """
    return _collect(server_args, hf_config).facts


def main_process_check(server_args: Any) -> SupportReport | None:
    """Refuse an unsupported configuration in the main process, before anything spawns.

    Runs as an AFTER hook on ``ServerArgs.check_server_args``. Does nothing (returns
    None) unless monitoring is requested (``DMX_SGLANG_ENABLE``). Rules whose input
    cannot be read here (the architecture of a model that is not local) are left to
    the scheduler's check.

    Raises:
        UnsupportedConfigurationError: with every reason, not only the first.
        ConfigurationError: a ``DMX_*`` setting is invalid.
    """
    if not monitoring_requested():
        return None
    settings = Settings.from_env()
    collected = _collect(server_args, None)
    report = check_support(collected.facts, allow_prefix_cache=settings.prefix_cache_allowed)
    if collected.undecided:
        skipped = {
            r.reason(collected.facts) for r in REJECTIONS if r.name in collected.undecided
        }
        report = attrs.evolve(
            report, rejections=tuple(r for r in report.rejections if r not in skipped)
        )
        log.info("dmi.support.deferred", rules=sorted(collected.undecided),
                 why="not readable in the main process; the scheduler checks them")
    for forced in report.forced:
        log.warning("dmi.forced", setting=forced.name, why=forced.line)
    for note in report.notes:
        log.info("dmi.support.note", note=note)
    report.raise_if_rejected()
    return report


def model_shape(hf_config: Any, dtype: object) -> ModelShape:
    """The row shapes of a (dense, TP=1) Qwen3 model.

    Args:
        hf_config: the model's HF config (``Qwen3Config`` or anything with its fields).
        dtype: the activation dtype: a ``torch.dtype``, ``"bfloat16"``, ``"torch.float16"``
            or a :class:`DType`.
    """
    heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads
    act = dtype if isinstance(dtype, DType) else DType.parse(str(dtype))
    return ModelShape(
        num_layers=int(hf_config.num_hidden_layers),
        hidden=int(hf_config.hidden_size),
        heads=heads,
        kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate=int(hf_config.intermediate_size),
        vocab=int(hf_config.vocab_size),
        activation_dtype=act,
    )


def model_hooks(hf_config: Any) -> ModelHooks:
    """The hooks the hooked model class offers for this config.

    Raises:
        UnsupportedConfigurationError: the architecture has no hooked model class.
    """
    archs = tuple(getattr(hf_config, "architectures", None) or ())
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        msg = (f"architecture {', '.join(archs) or '(none)'} has no hooked model; "
               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        raise UnsupportedConfigurationError((msg,))
    return ModelHooks(archs[0], QWEN3_HOOKS, int(hf_config.num_hidden_layers))


def _collect(server_args: Any, hf_config: Any) -> _Collected:
    from sglang.srt.arg_groups.overrides import resolution_result

    def get(name: str, default: Any = None) -> Any:
        return resolution_result(server_args, name, default)

    undecided: set[str] = set()
    model_config = _model_config(server_args) if hf_config is None else None
    config: Any = hf_config
    if config is None and model_config is not None:
        config = model_config.hf_config
    raw = _local_config_json(get("model_path")) if config is None else None
    if config is not None:
        archs = tuple(getattr(config, "architectures", None) or ())
    elif raw is not None:
        archs = tuple(raw.get("architectures") or ())
    else:
        archs = ()
        undecided.add("architecture")

    dtype: str | None
    if model_config is not None:
        dtype = str(model_config.dtype).removeprefix("torch.")
        is_generation = bool(model_config.is_generation)
    else:
        is_generation = not bool(get("is_embedding", False))
        dtype = _dtype_from(get("dtype", "auto"), config, raw)
        if dtype is None:
            undecided.add("dtype")
            dtype = "bfloat16"

    decode_backend, prefill_enabled = _graph_backends(get)
    lora_paths = get("lora_paths")
    facts = EngineFacts(
        architectures=archs,
        is_generation=is_generation,
        activation_dtype=dtype or "bfloat16",
        tp_size=int(get("tp_size", 1)),
        pp_size=int(get("pp_size", 1)),
        dp_size=int(get("dp_size", 1)),
        enable_dp_attention=bool(get("enable_dp_attention", False)),
        attn_cp_size=int(get("attn_cp_size", 1)),
        nnodes=int(get("nnodes", 1)),
        speculative_algorithm=_opt_str(get("speculative_algorithm")),
        enable_two_batch_overlap=bool(get("enable_two_batch_overlap", False)),
        enable_pdmux=bool(get("enable_pdmux", False)),
        disaggregation_mode=str(get("disaggregation_mode", "null") or "null"),
        lora=bool(get("enable_lora")) or bool(lora_paths),
        dllm_algorithm=_opt_str(get("dllm_algorithm")),
        enable_mis=bool(get("enable_mis", False)),
        enable_layernorm_sp=bool(get("enable_layernorm_sp", False)),
        enable_torch_compile=bool(get("enable_torch_compile", False)),
        rl_on_policy_target=_opt_str(get("rl_on_policy_target")),
        model_impl=str(get("model_impl", "auto") or "auto"),
        num_continuous_decode_steps=int(get("num_continuous_decode_steps", 1) or 1),
        forward_hooks=bool(get("forward_hooks")),
        startup_weight_load_mode=str(get("startup_weight_load_mode", "serial") or "serial"),
        decode_graph_backend=decode_backend,
        prefill_graph_enabled=prefill_enabled,
        radix_cache_enabled=not bool(get("disable_radix_cache", False)),
        sglang_version=installed("sglang") or "",
        adapter_sglang=SGLANG_VERSION,
        torch_version=_torch_version_on_gpu(),
        torch_prefix=TORCH_PREFIX,
    )
    return _Collected(facts, frozenset(undecided))


def _graph_backends(get: Any) -> tuple[str, bool]:
    """(decode backend, prefill graph enabled) from the resolved ``cuda_graph_config``."""
    config = get("cuda_graph_config")
    if config is not None and not isinstance(config, str | dict):
        decode = str(config.decode.backend)
        prefill = str(config.prefill.backend)
    else:
        # An unresolved record (resolution always fills the config): the raw flags.
        off = bool(get("disable_cuda_graph", False))
        decode = "disabled" if off or get("disable_decode_cuda_graph", False) else str(
            get("cuda_graph_backend_decode") or "full"
        )
        prefill = "disabled" if off or get("disable_prefill_cuda_graph", False) else str(
            get("cuda_graph_backend_prefill") or "breakable"
        )
    return decode, prefill != "disabled"


def _model_config(server_args: Any) -> Any:
    # Only the configuration resolution already built: building one here could reach
    # for the Hugging Face hub (a remote or dummy model path) from the main process.
    if getattr(server_args, "_model_config", None) is None:
        return None
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of

        return model_config_of(server_args)
    except Exception as exc:  # any failure means "not readable here"
        log.info("dmi.model_config_unavailable", error=repr(exc))
        return None


def _local_config_json(model_path: Any) -> dict[str, Any] | None:
    if not model_path:
        return None
    path = Path(str(model_path)) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def served_dtype(config: dict[str, Any]) -> str | None:
    """The activation dtype SGLang serves a ``config.json`` in with ``dtype="auto"`` (None:
    the file names none)."""
    return _dtype_from(None, None, config)


def _dtype_from(requested: Any, config: Any, raw: dict[str, Any] | None) -> str | None:
    text = str(requested or "auto").removeprefix("torch.").lower()
    if text != "auto":
        return _DTYPE_NAMES.get(text, text)
    declared = getattr(config, "torch_dtype", None) if config is not None else None
    if declared is None and raw is not None:
        declared = raw.get("torch_dtype") or raw.get("dtype")
    if declared is None:
        return None
    name = str(declared).removeprefix("torch.")
    # SGLang's "auto" serves float32 checkpoints in float16 (model_config.py).
    return "float16" if name == "float32" else _DTYPE_NAMES.get(name, name)


def _opt_str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def _torch_version_on_gpu() -> str | None:
    """torch's version where it matters (a CUDA machine); None on CPU-only machines."""
    import torch

    return str(torch.__version__).split("+")[0] if torch.cuda.is_available() else None
