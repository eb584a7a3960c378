"""The support matrix, as data.

:class:`EngineFacts` holds plain values read from SGLang's resolved configuration;
:func:`check_support` turns them into a :class:`SupportReport`: every rejection reason
(not only the first), the settings dmi-sglang forces (each with its log line), and notes.
The main process checks after ``ServerArgs.check_server_args``; the scheduler checks again
before any capture allocation or weight load.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from dmi_sglang.errors import UnsupportedConfigurationError

__all__ = [
    "FORCED",
    "REJECTIONS",
    "SUPPORTED_ARCHITECTURES",
    "EngineFacts",
    "Forced",
    "Rule",
    "SupportReport",
    "check_support",
]

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
"""Architectures with a hooked model class."""
SUPPORTED_DTYPES = ("bfloat16", "float16")
"""Activation dtypes the capture supports."""


@attrs.frozen
class EngineFacts:
    """Plain values of an SGLang configuration that decide support.

    Adapters fill it from SGLang's *resolved* values (never raw ServerArgs fields that
    resolution may override).
    """

    architectures: tuple[str, ...]
    is_generation: bool = True
    activation_dtype: str = "bfloat16"
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    attn_cp_size: int = 1
    nnodes: int = 1
    speculative_algorithm: str | None = None
    enable_two_batch_overlap: bool = False
    enable_pdmux: bool = False
    disaggregation_mode: str = "null"
    lora: bool = False
    dllm_algorithm: str | None = None
    enable_mis: bool = False
    enable_layernorm_sp: bool = False
    enable_torch_compile: bool = False
    rl_on_policy_target: str | None = None
    model_impl: str = "auto"
    num_continuous_decode_steps: int = 1
    forward_hooks: bool = False
    startup_weight_load_mode: str = "serial"
    decode_graph_backend: str = "full"
    prefill_graph_enabled: bool = False
    radix_cache_enabled: bool = False
    sglang_version: str = ""
    """The installed SGLang release."""
    adapter_sglang: str = ""
    """The SGLang release the adapter that read these facts is written against."""
    torch_version: str | None = None
    """Checked only when set (GPU machines)."""
    torch_prefix: str = ""
    """The torch releases ``adapter_sglang`` is built against (a version prefix)."""


@attrs.frozen
class Rule:
    """One rejection: ``applies(facts)`` true means the configuration is refused."""

    name: str
    applies: Callable[[EngineFacts], bool]
    reason: Callable[[EngineFacts], str]


@attrs.frozen
class Forced:
    """A setting dmi-sglang overrides rather than refuses, and the log line it emits."""

    name: str
    applies: Callable[[EngineFacts, bool], bool]
    line: str


def _arch(f: EngineFacts) -> bool:
    return not f.architectures or f.architectures[0] not in SUPPORTED_ARCHITECTURES


REJECTIONS: tuple[Rule, ...] = (
    Rule(
        "adapter facts",
        lambda f: not f.adapter_sglang or not f.torch_prefix,
        lambda f: "the SGLang adapter did not state the release it supports and the torch "
        "it needs (EngineFacts.adapter_sglang / torch_prefix): its checks cannot run",
    ),
    Rule(
        "sglang version",
        lambda f: f.sglang_version != f.adapter_sglang,
        lambda f: f"sglang {f.sglang_version} is installed; this adapter supports exactly "
        f"sglang=={f.adapter_sglang}",
    ),
    Rule(
        "torch version",
        lambda f: f.torch_version is not None and not f.torch_version.startswith(f.torch_prefix),
        lambda f: f"torch {f.torch_version} is installed; sglang {f.adapter_sglang} needs "
        f"torch {f.torch_prefix}x",
    ),
    Rule(
        "architecture",
        _arch,
        lambda f: f"architecture {', '.join(f.architectures) or '(none)'} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
    ),
    Rule(
        "generation model",
        lambda f: not f.is_generation,
        lambda f: "only generation models are supported (this is an embedding/reward model)",
    ),
    Rule(
        "dtype",
        lambda f: f.activation_dtype not in SUPPORTED_DTYPES,
        lambda f: f"activation dtype {f.activation_dtype} is not supported; "
        f"supported: {', '.join(SUPPORTED_DTYPES)}",
    ),
    Rule("tp", lambda f: f.tp_size != 1, lambda f: f"tp_size={f.tp_size}; only tp_size=1"),
    Rule("pp", lambda f: f.pp_size != 1, lambda f: f"pp_size={f.pp_size}; only pp_size=1"),
    Rule("dp", lambda f: f.dp_size != 1, lambda f: f"dp_size={f.dp_size}; only dp_size=1"),
    Rule(
        "dp attention",
        lambda f: f.enable_dp_attention,
        lambda f: "enable_dp_attention=True is not supported",
    ),
    Rule(
        "context parallel",
        lambda f: f.attn_cp_size != 1,
        lambda f: f"attn_cp_size={f.attn_cp_size}; attention context parallelism is not "
        "supported",
    ),
    Rule("multi-node", lambda f: f.nnodes != 1, lambda f: f"nnodes={f.nnodes}; only one node"),
    Rule(
        "speculative decoding",
        lambda f: f.speculative_algorithm is not None,
        lambda f: f"speculative_algorithm={f.speculative_algorithm!r}; speculative decoding "
        "is not supported",
    ),
    Rule(
        "two-batch overlap",
        lambda f: f.enable_two_batch_overlap,
        lambda f: "enable_two_batch_overlap=True is not supported",
    ),
    Rule(
        "pd multiplexing",
        lambda f: f.enable_pdmux,
        lambda f: "enable_pdmux=True (PD multiplexing) is not supported",
    ),
    Rule(
        "disaggregation",
        lambda f: f.disaggregation_mode not in ("null", ""),
        lambda f: f"disaggregation_mode={f.disaggregation_mode!r}; PD disaggregation is not "
        "supported",
    ),
    Rule("lora", lambda f: f.lora, lambda f: "LoRA adapters are not supported"),
    Rule(
        "diffusion llm",
        lambda f: f.dllm_algorithm is not None,
        lambda f: f"dllm_algorithm={f.dllm_algorithm!r}; diffusion LLMs are not supported",
    ),
    Rule(
        "multi-item scoring",
        lambda f: f.enable_mis,
        lambda f: "enable_mis=True (multi-item scoring) is not supported: its scoring "
        "forwards return no next-token logits, so their final_logits rows never exist and "
        "the capture fails mid-run",
    ),
    Rule(
        "layernorm sp",
        lambda f: f.enable_layernorm_sp,
        lambda f: "enable_layernorm_sp=True (layernorm sequence parallelism) is not supported",
    ),
    Rule(
        "torch.compile",
        lambda f: f.enable_torch_compile,
        lambda f: "enable_torch_compile=True is not supported",
    ),
    Rule(
        "rl on-policy target",
        lambda f: f.rl_on_policy_target is not None,
        lambda f: f"rl_on_policy_target={f.rl_on_policy_target!r}: it keeps Qwen3's residual "
        "stream and norm outputs in float32, not in the activation dtype captures are "
        "planned in",
    ),
    Rule(
        "model impl",
        lambda f: f.model_impl not in ("auto", "sglang"),
        lambda f: f"model_impl={f.model_impl!r}; only SGLang's own model implementation "
        "('auto' or 'sglang')",
    ),
    Rule(
        "continuous decode steps",
        lambda f: f.num_continuous_decode_steps != 1,
        lambda f: f"num_continuous_decode_steps={f.num_continuous_decode_steps}; only 1",
    ),
    Rule(
        "forward hooks",
        lambda f: f.forward_hooks,
        lambda f: "the forward_hooks server option is not supported alongside dmi-sglang",
    ),
    Rule(
        "startup weight load",
        lambda f: f.startup_weight_load_mode != "serial",
        lambda f: f"startup_weight_load_mode={f.startup_weight_load_mode!r}; only 'serial'",
    ),
    Rule(
        "decode graph backend",
        lambda f: f.decode_graph_backend not in ("full", "tc_piecewise", "disabled"),
        lambda f: f"decode CUDA graph backend {f.decode_graph_backend!r}; supported: 'full' "
        "(and 'tc_piecewise', which runs as 'full' in sglang 0.5.19) or 'disabled'",
    ),
)
"""Every configuration dmi-sglang refuses, with its reason."""

FORCED: tuple[Forced, ...] = (
    Forced(
        "prefill cuda graph",
        lambda f, _allow_prefix: f.prefill_graph_enabled,
        "prefill CUDA graphs turned off: per-layer capture points do not run at their replay",
    ),
    Forced(
        "radix cache",
        lambda f, allow_prefix: f.radix_cache_enabled and not allow_prefix,
        "radix (prefix) cache turned off: cached prefix tokens are never recomputed, so never "
        "captured (DMX_ALLOW_PREFIX_CACHE=1 keeps it; the manifest then records which "
        "positions were computed)",
    ),
)
"""Settings dmi-sglang overrides, each with the log line it emits."""


@attrs.frozen
class SupportReport:
    """The outcome of :func:`check_support`."""

    rejections: tuple[str, ...]
    forced: tuple[Forced, ...]
    notes: tuple[str, ...]

    @property
    def supported(self) -> bool:
        """True when nothing is rejected."""
        return not self.rejections

    def raise_if_rejected(self) -> None:
        """Raise :class:`UnsupportedConfigurationError` with every reason."""
        if self.rejections:
            raise UnsupportedConfigurationError(self.rejections)


def check_support(facts: EngineFacts, *, allow_prefix_cache: bool = False) -> SupportReport:
    """Check a configuration against the support matrix."""
    rejections = tuple(r.reason(facts) for r in REJECTIONS if r.applies(facts))
    forced = tuple(f for f in FORCED if f.applies(facts, allow_prefix_cache))
    notes: list[str] = []
    if facts.decode_graph_backend == "tc_piecewise":
        notes.append("decode CUDA graph backend 'tc_piecewise' runs as 'full' in sglang 0.5.19")
    if facts.decode_graph_backend == "disabled":
        notes.append("decode CUDA graphs are disabled: every forward runs eagerly")
    if facts.radix_cache_enabled and allow_prefix_cache:
        notes.append("prefix cache kept (DMX_ALLOW_PREFIX_CACHE=1, or a selection of positions "
                     "from the last prompt position on): cached positions are not computed")
    return SupportReport(rejections, forced, tuple(notes))


def request_input_problem(*, has_token_ids: bool, has_input_embeds: bool) -> str | None:
    """Why a request cannot be captured (input embeddings / multimodal), or None."""
    if has_input_embeds or not has_token_ids:
        return "requests with input_embeds or multimodal inputs carry no token ids to capture"
    return None
