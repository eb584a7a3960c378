"""Support facts and the main-process check, on REAL resolved ServerArgs (CPU).

``ServerArgs(..., device="cuda").resolve_once()`` and ``check_server_args()`` both run on
a machine without a GPU; the facts are read from what resolution decided.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

Make = Callable[..., Any]


@pytest.fixture
def monitoring(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("DMX_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("DMX_SGLANG_ENABLE", "1")


def _check(server_args: Any) -> Any:
    from dmi_sglang.adapters.sglang_v0519.facts import main_process_check

    server_args.check_server_args()  # SGLang's own validation passes first
    return main_process_check(server_args)


@pytest.mark.usefixtures("monitoring")
def test_defaults_are_accepted_with_prefill_graph_and_radix_cache_forced(
    resolved_args: Make,
) -> None:
    from dmi_sglang.adapters.sglang_v0519.facts import engine_facts

    server_args = resolved_args()
    report = _check(server_args)
    assert report.supported
    assert {f.name for f in report.forced} == {"prefill cuda graph", "radix cache"}
    facts = engine_facts(server_args)
    assert facts.architectures == ("Qwen3ForCausalLM",)
    assert (facts.activation_dtype, facts.decode_graph_backend) == ("bfloat16", "full")
    assert facts.prefill_graph_enabled
    assert facts.radix_cache_enabled
    assert facts.sglang_version == "0.5.19"
    assert (facts.adapter_sglang, facts.torch_prefix) == ("0.5.19", "2.13.")
    assert facts.torch_version is None  # only checked where CUDA is available


@pytest.mark.usefixtures("monitoring")
def test_resolved_values_are_read_not_raw_fields(
    resolved_args: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmi_sglang.adapters.sglang_v0519.facts import engine_facts

    server_args = resolved_args(disable_cuda_graph=True, disable_radix_cache=True)
    facts = engine_facts(server_args)
    # disable_cuda_graph resolves into the graph config; the decode backend field is None.
    assert server_args.cuda_graph_backend_decode is None
    assert (facts.decode_graph_backend, facts.prefill_graph_enabled) == ("disabled", False)
    report = _check(server_args)
    assert report.forced == ()
    assert any("disabled" in n for n in report.notes)
    monkeypatch.setenv("DMX_ALLOW_PREFIX_CACHE", "1")
    assert {f.name for f in _check(resolved_args()).forced} == {"prefill cuda graph"}


@pytest.mark.usefixtures("monitoring")
def test_tp2_is_refused_in_the_main_process(resolved_args: Make) -> None:
    from dmi_sglang.errors import UnsupportedConfigurationError

    with pytest.raises(UnsupportedConfigurationError) as info:
        _check(resolved_args(tp_size=2))
    assert info.value.reasons == ("tp_size=2; only tp_size=1",)
    assert "cannot monitor this configuration" in str(info.value)


@pytest.mark.usefixtures("monitoring")
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": None},
         "speculative decoding"),
        ({"enable_lora": True, "lora_paths": ["/tmp/no-adapter"]}, "LoRA"),
        ({"enable_torch_compile": True}, "enable_torch_compile=True"),
        ({"model_impl": "transformers"}, "model_impl='transformers'"),
        # Qwen3's norms then keep a float32 residual and float32 outputs (models/qwen3.py):
        # every capture of them failed the planned dtype at each forward (review)
        ({"rl_on_policy_target": "fsdp"}, "rl_on_policy_target='fsdp'"),
        # its scoring forwards return no next-token logits: the seal then failed the
        # whole capture at the first /v1/score request (review)
        ({"enable_mis": True, "attention_backend": "flashinfer"},
         "enable_mis=True (multi-item scoring)"),
    ],
    ids=["speculative", "lora", "torch-compile", "transformers-impl", "rl-on-policy",
         "multi-item-scoring"],
)
def test_each_unsupported_mode_is_refused(
    resolved_args: Make, qwen3_dir: Path, kwargs: dict[str, Any], needle: str
) -> None:
    from dmi_sglang.errors import UnsupportedConfigurationError

    if "speculative_draft_model_path" in kwargs:
        kwargs["speculative_draft_model_path"] = str(qwen3_dir)
    with pytest.raises(UnsupportedConfigurationError) as info:
        _check(resolved_args(**kwargs))
    assert len(info.value.reasons) == 1
    assert needle in info.value.reasons[0]


@pytest.mark.usefixtures("monitoring")
def test_moe_architecture_is_refused(resolved_args: Make, moe_dir: Path) -> None:
    from dmi_sglang.errors import UnsupportedConfigurationError

    with pytest.raises(UnsupportedConfigurationError) as info:
        _check(resolved_args(model_path=str(moe_dir)))
    assert info.value.reasons == (
        "architecture Qwen3MoeForCausalLM is not supported; supported: Qwen3ForCausalLM",
    )


@pytest.mark.usefixtures("monitoring")
def test_several_problems_are_all_listed(resolved_args: Make, moe_dir: Path) -> None:
    from dmi_sglang.errors import UnsupportedConfigurationError

    server_args = resolved_args(model_path=str(moe_dir), tp_size=2, enable_torch_compile=True,
                                enable_lora=True, lora_paths=["/tmp/no-adapter"])
    with pytest.raises(UnsupportedConfigurationError) as info:
        _check(server_args)
    text = str(info.value)
    assert len(info.value.reasons) == 4
    for needle in ("Qwen3MoeForCausalLM", "tp_size=2", "LoRA", "enable_torch_compile"):
        assert needle in text


def test_nothing_happens_without_monitoring(
    resolved_args: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmi_sglang.adapters.sglang_v0519.facts import main_process_check

    monkeypatch.setenv("DMX_SGLANG_ENABLE", "0")
    assert main_process_check(resolved_args(tp_size=2)) is None


@pytest.mark.usefixtures("monitoring")
def test_a_model_without_local_config_defers_the_architecture(resolved_args: Make) -> None:
    from dmi_sglang.adapters.sglang_v0519.facts import engine_facts, main_process_check

    server_args = resolved_args(model_path="dummy")  # resolution stops early for it
    assert engine_facts(server_args).architectures == ()
    assert main_process_check(server_args).supported  # the scheduler checks the arch


def test_hf_config_argument_wins(resolved_args: Make, moe_dir: Path) -> None:
    from transformers import AutoConfig

    from dmi_sglang.adapters.sglang_v0519.facts import engine_facts

    config = AutoConfig.from_pretrained(moe_dir)
    facts = engine_facts(resolved_args(), hf_config=config)
    assert facts.architectures == ("Qwen3MoeForCausalLM",)


def test_model_shape_and_hooks(qwen3_dir: Path, moe_dir: Path) -> None:
    from transformers import AutoConfig

    from dmi_sglang.adapters.sglang_v0519.facts import QWEN3_HOOKS, model_hooks, model_shape
    from dmi_sglang.domain.shapes import DType, ModelShape
    from dmi_sglang.errors import UnsupportedConfigurationError

    config = AutoConfig.from_pretrained(qwen3_dir)
    assert model_shape(config, "bfloat16") == ModelShape(
        num_layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
        vocab=1024, activation_dtype=DType.BFLOAT16,
    )
    assert model_shape(config, "torch.float16").activation_dtype is DType.FLOAT16
    hooks = model_hooks(config)
    assert (hooks.architecture, hooks.num_layers) == ("Qwen3ForCausalLM", 4)
    assert hooks.hooks == QWEN3_HOOKS
    assert not {"pos_embed", "router_logits", "topk_ids", "topk_weights"} & QWEN3_HOOKS
    assert {"resid_pre", "q", "k", "v", "z", "mlp_post", "final_logits"} <= QWEN3_HOOKS
    with pytest.raises(UnsupportedConfigurationError, match="Qwen3MoeForCausalLM"):
        model_hooks(AutoConfig.from_pretrained(moe_dir))


def test_the_engines_checks_name_sglangs_leading_generate_parameters() -> None:
    """DMIEngine.generate checks arguments however they were passed: its names of
    SGLang's first parameters, in order, are SGLang 0.5.19's."""
    import inspect

    from sglang.srt.entrypoints.engine import Engine

    from dmi_sglang.app.engine import _GENERATE_LEADING

    params = list(inspect.signature(Engine.generate).parameters)[1:]
    assert tuple(params[: len(_GENERATE_LEADING)]) == _GENERATE_LEADING
