"""Real Qwen3 shapes for ``load_format="dummy"`` engines, and their ServerArgs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.constants import MAX_TOTAL_TOKENS, MEM_FRACTION_STATIC, SEED


@dataclass(frozen=True)
class ModelSpec:
    """A Qwen3 shape and rough speeds (time estimates only)."""

    key: str
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    startup_s: float
    """Engine start with warm caches (a cold Triton cache adds compiles to the warm-ups)."""
    decode_tok_s: float
    """Stock output tokens/s at batch 64 with decode graphs (eager: about a tenth)."""
    prefill_tok_s: float

    def generate_s(self, prompt_lens: tuple[int, ...], output_lens: tuple[int, ...],
                   graphs: bool) -> float:
        """Rough seconds of one ``generate`` call: its longest output at the batch-64 step
        time, plus its prefill."""
        step = 64.0 / (self.decode_tok_s if graphs else self.decode_tok_s / 10)
        return max(output_lens) * step + sum(prompt_lens) / self.prefill_tok_s


MODELS: dict[str, ModelSpec] = {
    "0.6b": ModelSpec("0.6b", "qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936, True,
                      45.0, 19000.0, 60000.0),
    "8b": ModelSpec("8b", "qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, False,
                    60.0, 5000.0, 15000.0),
}


def qwen3_config(model: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` of a Qwen3 model of this shape (as on the Hugging Face hub)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": model.hidden, "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads, "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim, "intermediate_size": model.intermediate,
        "vocab_size": model.vocab, "tie_word_embeddings": model.tied,
        "max_position_embeddings": 40960, "max_window_layers": model.layers,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "initializer_range": 0.02,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def write_model_dir(root: Path, model: ModelSpec) -> Path:
    """``root/<name>/config.json`` (idempotent); the directory."""
    path = root / model.name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(qwen3_config(model), indent=1) + "\n")
    return path


def engine_kwargs(model_dir: Path | str, *, graphs: bool, overlap: bool = True,
                  max_bs: int = 64, chunked_prefill_size: int = 4096,
                  seed: int = SEED) -> dict[str, Any]:
    """ServerArgs shared by the stock and monitored engines of one comparison.

    The two settings monitoring forces for the harness's selections (prefill CUDA graphs
    off, radix cache off) are passed to both, and the KV pool is fixed
    (:data:`~harness.constants.MAX_TOTAL_TOKENS`) so that two engines sharing the GPU get
    the same pool whichever started first.
    ``chunked_prefill_size`` 0 keeps SGLang's default.
    """
    kwargs: dict[str, Any] = {
        "model_path": str(model_dir), "load_format": "dummy", "skip_tokenizer_init": True,
        "attention_backend": "triton", "sampling_backend": "pytorch",
        "mem_fraction_static": MEM_FRACTION_STATIC, "max_total_tokens": MAX_TOTAL_TOKENS,
        "disable_prefill_cuda_graph": True, "disable_radix_cache": True,
        "random_seed": seed, "log_level": "error",
    }
    if chunked_prefill_size:
        kwargs["chunked_prefill_size"] = chunked_prefill_size
    if graphs:
        kwargs["cuda_graph_max_bs_decode"] = max_bs
    else:
        kwargs["disable_cuda_graph"] = True
    if not overlap:
        kwargs["disable_overlap_schedule"] = True
    return kwargs


STOCK_ENV = {"DMX_SGLANG_ENABLE": "0"}
"""The environment of a stock engine: the plugin loads and stays off."""


def monitored_env(preset: str, store: Path | None, run_id: str,
                  extra: dict[str, str] | None = None) -> dict[str, str]:
    """The ``DMX_*`` variables that switch monitoring on for a plain ``sglang.Engine``:
    hook ``preset``, the embedded ``store`` (None: capture without storing), the run id,
    then ``extra`` settings."""
    return {"DMX_SGLANG_ENABLE": "1", "DMX_HOOK_SELECTION": preset,
            "DMX_DB_URL": "none" if store is None else f"chdb://{store}",
            "DMX_MODEL_ID": run_id, **(extra or {})}
