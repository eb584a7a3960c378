"""The demo checkpoint: transformers loads it, its tokenizer round-trips, SGLang reads it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sglang


def test_transformers_loads_tokenizes_and_runs_it(demo_checkpoint: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_checkpoint)
    ids = tok("w1 w2 w3 w1020")["input_ids"]
    assert ids == [4, 5, 6, 1023]
    assert tok.decode(ids) == "w1 w2 w3 w1020"
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("w1 nonsense")["input_ids"] == [4, 0]

    model = AutoModelForCausalLM.from_pretrained(demo_checkpoint)
    assert model.dtype == torch.bfloat16
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
        4, 256, 4, 2, 64, 512, 1024)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 4, 1024)
    assert torch.isfinite(logits).all()
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    std = params["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert 0.045 < std < 0.055


def test_same_arguments_same_bytes(tmp_path: Path) -> None:
    from dmi_sglang.adapters.demo_model import write_demo_checkpoint

    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    small = {"layers": 1, "hidden": 64, "heads": 2, "kv_heads": 1, "head_dim": 32,
             "intermediate": 128, "vocab": 64}
    a = write_demo_checkpoint(tmp_path / "a", **small)
    b = write_demo_checkpoint(tmp_path / "b", **small)
    c = write_demo_checkpoint(tmp_path / "c", seed=1, **small)
    assert digest(a) == digest(b) != digest(c)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        write_demo_checkpoint(tmp_path / "d", heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="dtype"):
        write_demo_checkpoint(tmp_path / "e", dtype="int8")


def test_sglang_reads_it_as_a_supported_qwen3(
    resolved_args: Callable[..., Any], demo_checkpoint: Path
) -> None:
    from dmi_sglang.adapters.sglang_v0519.facts import engine_facts

    facts = engine_facts(resolved_args(model_path=str(demo_checkpoint)))
    assert facts.architectures == ("Qwen3ForCausalLM",)
    assert facts.activation_dtype == "bfloat16"
    assert facts.is_generation
