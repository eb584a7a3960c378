"""A small random-weight Qwen3 checkpoint with a working tokenizer.

SGLang 0.5.19 loads it and serves text prompts such as ``"w1 w2 w3"`` (the GPU tests in
``tests/gpu`` do); transformers loads the same directory, so GPU
tests compare captures against a Hugging Face reference forward of identical weights. The
CLI's ``demo-model`` command and the tests share this code.

The tokenizer is a ``tokenizers`` WordLevel model over ``<unk>``, ``<s>``, ``</s>``,
``w0`` .. ``w{vocab-4}`` with a whitespace pre-tokenizer, wrapped in
``PreTrainedTokenizerFast``: every word ``wN`` is one token, ids are ``N + 3``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

__all__ = ["DEMO_GEOMETRY", "SPECIAL_TOKENS", "demo_config", "write_demo_checkpoint"]

log = structlog.get_logger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
"""The first three vocabulary entries (ids 0, 1, 2): unknown, begin and end of sequence."""

_STD = 0.05


DEMO_GEOMETRY = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 64, "intermediate_size": 512, "vocab_size": 1024,
                 "max_position_embeddings": 4096}
"""The demo checkpoint's geometry by default (``config.json``'s keys): what a run of it
can be checked against before it is written."""


def demo_config(layers: int) -> dict[str, Any]:
    """The ``config.json`` values that size :func:`write_demo_checkpoint`'s default
    checkpoint of ``layers`` layers (architecture and geometry)."""
    return {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": layers,
            **DEMO_GEOMETRY}


def write_demo_checkpoint(
    path: str | Path,
    *,
    layers: int = 4,
    hidden: int = DEMO_GEOMETRY["hidden_size"],
    heads: int = DEMO_GEOMETRY["num_attention_heads"],
    kv_heads: int = DEMO_GEOMETRY["num_key_value_heads"],
    head_dim: int = DEMO_GEOMETRY["head_dim"],
    intermediate: int = DEMO_GEOMETRY["intermediate_size"],
    vocab: int = DEMO_GEOMETRY["vocab_size"],
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """Write a random Qwen3 checkpoint (safetensors) plus tokenizer into ``path``.

    Weights are drawn from N(0, 0.05) with a generator seeded by ``seed``; RMSNorm
    weights are 1.0. The same arguments give the same bytes.

    Args:
        path: target directory (created; existing files of the same names are replaced).
        layers / hidden / heads / kv_heads / head_dim / intermediate / vocab: the model
            geometry (``hidden`` need not equal ``heads * head_dim``, as in Qwen3).
        seed: the weight seed.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``, the stored weight dtype
            (SGLang's ``dtype="auto"`` serves the checkpoint in it; float32 as float16).

    Returns:
        The directory, as a :class:`Path`.

    Raises:
        ValueError: a geometry SGLang's Qwen3 cannot serve (heads not a multiple of
            kv_heads, a vocabulary too small for the special tokens).
    """
    import torch
    import transformers

    # transformers is only partly typed: treat its classes as untyped.
    config_cls: Any = transformers.Qwen3Config
    model_cls: Any = transformers.Qwen3ForCausalLM

    if heads % kv_heads:
        msg = f"heads={heads} must be a multiple of kv_heads={kv_heads}"
        raise ValueError(msg)
    if vocab <= len(SPECIAL_TOKENS):
        msg = f"vocab={vocab} must exceed the {len(SPECIAL_TOKENS)} special tokens"
        raise ValueError(msg)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                   "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        msg = f"dtype={dtype!r}; accepted: bfloat16, float16, float32"
        raise ValueError(msg)

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=DEMO_GEOMETRY["max_position_embeddings"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Qwen3ForCausalLM"],
    )
    model = model_cls(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * _STD)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(vocab).save_pretrained(out)
    log.info("dmi.demo_model.written", path=str(out), layers=layers, hidden=hidden,
             vocab=vocab, dtype=dtype)
    return out


def _tokenizer(vocab: int) -> Any:
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    fast_cls: Any = transformers.PreTrainedTokenizerFast

    words = [*SPECIAL_TOKENS, *(f"w{i}" for i in range(vocab - len(SPECIAL_TOKENS)))]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = Whitespace()
    return fast_cls(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
