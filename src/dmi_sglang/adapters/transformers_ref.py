"""transformers on CPU as a :class:`~dmi_sglang.domain.ports.ReferenceModel`.

A Qwen3 checkpoint (the demo checkpoint, or any ``Qwen3ForCausalLM`` directory) is loaded
with transformers in float32 on the CPU and generates greedily with its KV cache: one
forward over the prompt, then one per generated token fed back. Forward hooks on the
transformers modules hand over, per forward, the same quantities the hooked SGLang Qwen3
captures (docs/hooked-qwen3.md), under the catalog's hook names and row shapes:

========================  ====================================================
hook                      transformers module (layer *i* unless global)
========================  ====================================================
token_ids                 the forward's ``input_ids``
embed                     ``model.embed_tokens`` output
resid_pre / ln1           ``layers[i].input_layernorm`` input / output
q / k                     ``self_attn.q_norm`` / ``k_norm`` output (after q/k-norm,
                          before RoPE)
v                         ``self_attn.v_proj`` output
z / attn_out              ``self_attn.o_proj`` input / output
resid_mid / ln2           ``post_attention_layernorm`` input / output
mlp_in / mlp_out          ``mlp`` input / output
mlp_post                  ``mlp.down_proj`` input (silu(gate) * up)
resid_final / final_ln    ``model.norm`` input / output
final_logits              the forward's last-position logits (the next token's)
========================  ====================================================

Which of those rows are stored is not decided here: the application cuts them with the
domain's plan. Importing this module is cheap; torch and transformers are imported when
a model loads (the ``[demo]`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from dmi_sglang.domain.hooks import ModelHooks, Selection
from dmi_sglang.domain.payloads import TOPK_HOOKS
from dmi_sglang.domain.ports import ReferenceForward
from dmi_sglang.domain.shapes import DType, ModelShape, RowSpec
from dmi_sglang.errors import CaptureError, ConfigurationError

__all__ = [
    "ARCHITECTURE",
    "REFERENCE_HOOKS",
    "TransformersReference",
    "check_packages",
    "model_hooks",
    "model_shape",
    "read_config",
]

log = structlog.get_logger(__name__)

ARCHITECTURE = "Qwen3ForCausalLM"
"""The one architecture whose modules are mapped to hooks."""

_LAYER_POINTS: Mapping[str, tuple[str, bool]] = {
    "resid_pre": ("input_layernorm", True),
    "ln1": ("input_layernorm", False),
    "q": ("self_attn.q_norm", False),
    "k": ("self_attn.k_norm", False),
    "v": ("self_attn.v_proj", False),
    "z": ("self_attn.o_proj", True),
    "attn_out": ("self_attn.o_proj", False),
    "resid_mid": ("post_attention_layernorm", True),
    "ln2": ("post_attention_layernorm", False),
    "mlp_in": ("mlp", True),
    "mlp_post": ("mlp.down_proj", True),
    "mlp_out": ("mlp", False),
}
"""Per-layer hook -> (module under ``model.layers.<i>``, True: its input, False: output)."""
_GLOBAL_POINTS: Mapping[str, tuple[str, bool]] = {
    "embed": ("model.embed_tokens", False),
    "resid_final": ("model.norm", True),
    "final_ln": ("model.norm", False),
}
"""Global hook -> (module, True: its input, False: its output)."""

_FROM_LOGITS = frozenset({"token_ids", "final_logits", *TOPK_HOOKS})
"""Hooks the reference fills from the forward's inputs and outputs, not module hooks."""
REFERENCE_HOOKS: frozenset[str] = frozenset(
    {*_LAYER_POINTS, *_GLOBAL_POINTS, "token_ids", "final_logits"})
"""The hooks the reference offers: those of the hooked SGLang Qwen3 (sglang-full without
pos_embed and the MoE routing hooks)."""


def check_packages() -> None:
    """Import what a reference capture needs.

    Raises:
        ModuleNotFoundError: torch, transformers or tokenizers is missing (``[demo]``).
    """
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a model directory.

    Raises:
        ConfigurationError: no such file, or not a JSON object.
    """
    where = Path(path) / "config.json"
    try:
        config = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        msg = f"cannot read {where}: {exc}"
        raise ConfigurationError(msg) from None
    if not isinstance(config, dict):
        msg = f"{where} is not a JSON object"
        raise ConfigurationError(msg)
    return config


def model_hooks(config: Mapping[str, Any]) -> ModelHooks:
    """The hooks and layers of a model, from its ``config.json`` (no weights read).

    Raises:
        ConfigurationError: not a ``Qwen3ForCausalLM`` checkpoint.
    """
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs or archs[0] != ARCHITECTURE:
        shown = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "(none)"
        msg = f"architecture {shown} has no reference capture; supported: {ARCHITECTURE}"
        raise ConfigurationError(msg)
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= 0:
        msg = f"num_hidden_layers={layers!r} in config.json is not a positive integer"
        raise ConfigurationError(msg)
    return ModelHooks(ARCHITECTURE, REFERENCE_HOOKS, layers)


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """Row shapes of a dense Qwen3 run in float32 (logits float32, token ids int64)."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return ModelShape(
        num_layers=int(config["num_hidden_layers"]),
        hidden=hidden,
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]),
        activation_dtype=DType.FLOAT32,
    )


class TransformersReference:
    """A ``Qwen3ForCausalLM`` checkpoint run by transformers on the CPU in float32.

    Build it with :meth:`load`.
    """

    def __init__(self, path: str, *, model: Any, tokenizer: Any, config: Mapping[str, Any],
                 eos: frozenset[int], description: str) -> None:
        self._path = path
        self._model = model
        self._tokenizer = tokenizer
        self._hooks = model_hooks(config)
        self._shape = model_shape(config)
        self._eos = eos
        self._description = description

    @classmethod
    def load(cls, path: str | Path) -> TransformersReference:
        """Load the checkpoint and its tokenizer (float32, CPU, eval mode).

        Raises:
            ConfigurationError: no readable ``config.json``, or not a ``Qwen3ForCausalLM``
                checkpoint.
            ModuleNotFoundError: torch, transformers or tokenizers is missing.
        """
        config = read_config(path)
        model_hooks(config)  # refuse another architecture before reading weights
        import torch
        import transformers

        auto_model: Any = transformers.AutoModelForCausalLM
        auto_tokenizer: Any = transformers.AutoTokenizer
        model = auto_model.from_pretrained(str(path)).to(device="cpu", dtype=torch.float32)
        model.eval()
        if type(model).__name__ != ARCHITECTURE:
            msg = f"transformers built {type(model).__name__} from {path}, not {ARCHITECTURE}"
            raise ConfigurationError(msg)
        tokenizer = auto_tokenizer.from_pretrained(str(path))
        eos = _ids(getattr(model.generation_config, "eos_token_id", None))
        eos |= _ids(getattr(tokenizer, "eos_token_id", None))
        description = (f"transformers {transformers.__version__}, torch {torch.__version__}, "
                       "cpu, float32, greedy")
        log.info("dmi.reference.loaded", path=str(path), layers=config["num_hidden_layers"],
                 eos=sorted(eos))
        return cls(str(path), model=model, tokenizer=tokenizer, config=config, eos=eos,
                   description=description)

    @property
    def model_path(self) -> str:
        """The model directory."""
        return self._path

    @property
    def description(self) -> str:
        """Libraries, device, dtype and decoding."""
        return self._description

    @property
    def hooks(self) -> ModelHooks:
        """The hooks offered (:data:`REFERENCE_HOOKS`) and the number of layers."""
        return self._hooks

    @property
    def shape(self) -> ModelShape:
        """Row shapes (float32 activations and logits, int64 token ids)."""
        return self._shape

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids, as SGLang tokenizes a text prompt."""
        return [int(t) for t in self._tokenizer(prompt)["input_ids"]]

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 selection: Selection) -> Iterator[ReferenceForward]:
        """Greedy generation with the KV cache; one :class:`ReferenceForward` per forward.

        Raises:
            CaptureError: an empty prompt, a hook this model does not offer, or a hooked
                module that did not fire exactly once in a forward.
        """
        import torch

        if not prompt_ids:
            msg = "a prompt without tokens cannot be forwarded"
            raise CaptureError(msg)
        wanted = [(h.name, layer) for h, layer in selection.captures()]
        unknown = sorted({name for name, _ in wanted} - REFERENCE_HOOKS - set(TOPK_HOOKS))
        if unknown:
            msg = f"hooks {unknown} are not offered by the reference model"
            raise CaptureError(msg)
        specs = {(h.name, layer): self._shape.capture_row(selection, h, layer)
                 for h, layer in selection.captures()}
        seen: dict[tuple[str, int], bytes] = {}
        rows = [0]
        handles = [
            self._module(name, layer).register_forward_hook(
                _keeper(seen, (name, layer), specs[name, layer], rows, self._input(name)))
            for name, layer in wanted if name not in _FROM_LOGITS
        ]
        try:
            tokens, start, past = tuple(int(t) for t in prompt_ids), 0, None
            for _ in range(max_new_tokens):
                seen.clear()
                rows[0] = len(tokens)
                input_ids = torch.tensor([tokens], dtype=torch.long)
                with torch.inference_mode():
                    out = self._model(input_ids=input_ids, past_key_values=past,
                                      use_cache=True, logits_to_keep=1)
                    logits = out.logits[0, -1:].float()
                    nxt = int(logits[0].argmax())
                if ("token_ids", -1) in specs:
                    seen["token_ids", -1] = _payload(input_ids[0], len(tokens),
                                                     specs["token_ids", -1])
                if ("final_logits", -1) in specs:
                    seen["final_logits", -1] = _payload(logits, 1, specs["final_logits", -1])
                topk = specs.get(("logits_topk_values", -1))
                if topk is not None:
                    values, ids = torch.topk(logits, topk.dims[0], dim=-1)
                    seen["logits_topk_values", -1] = _payload(values, 1, topk)
                    seen["logits_topk_ids", -1] = _payload(ids, 1,
                                                           specs["logits_topk_ids", -1])
                absent = [k for k in wanted if k not in seen]
                if absent:
                    msg = f"hooked modules did not fire in a forward: {absent[:4]}"
                    raise CaptureError(msg)
                yield ReferenceForward(start, tokens, nxt, dict(seen))
                if nxt in self._eos:
                    return
                past, start, tokens = out.past_key_values, start + len(tokens), (nxt,)
        finally:
            for handle in handles:
                handle.remove()

    def _module(self, name: str, layer: int) -> Any:
        if name in _GLOBAL_POINTS:
            return self._model.get_submodule(_GLOBAL_POINTS[name][0])
        return self._model.get_submodule(f"model.layers.{layer}.{_LAYER_POINTS[name][0]}")

    @staticmethod
    def _input(name: str) -> bool:
        return (_GLOBAL_POINTS.get(name) or _LAYER_POINTS[name])[1]


def _ids(value: object) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, list | tuple | set | frozenset):
        return frozenset(int(v) for v in value)
    return frozenset()


def _keeper(seen: dict[tuple[str, int], bytes], key: tuple[str, int], spec: RowSpec,
            rows: list[int], use_input: bool) -> Callable[..., None]:
    """A forward hook that keeps the module's input or output as ``spec`` rows."""

    def keep(_module: Any, args: tuple[Any, ...], output: Any) -> None:
        if key in seen:
            msg = f"{key[0]} layer {key[1]}: its module fired twice in one forward"
            raise CaptureError(msg)
        seen[key] = _payload(args[0] if use_input else output, rows[0], spec)

    return keep


def _payload(tensor: Any, rows: int, spec: RowSpec) -> bytes:
    """``tensor`` as ``rows`` rows of ``spec``: raw, contiguous, native-endian bytes."""
    import torch

    dtype = getattr(torch, spec.dtype.value.removeprefix("torch."))
    flat = tensor.detach().reshape(rows, *spec.dims).to(dtype).contiguous()
    data: bytes = flat.view(torch.uint8).numpy().tobytes()
    return data
