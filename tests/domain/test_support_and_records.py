"""The support matrix and row coverage."""

from __future__ import annotations

import attrs
import pytest

from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, expected_coverage
from dmi_sglang.domain.support import EngineFacts, check_support
from dmi_sglang.errors import UnsupportedConfigurationError

QWEN3 = EngineFacts(architectures=("Qwen3ForCausalLM",), sglang_version="0.5.19",
                    adapter_sglang="0.5.19", torch_prefix="2.13.")


def test_dense_qwen3_is_supported() -> None:
    report = check_support(QWEN3)
    assert report.supported
    report.raise_if_rejected()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"architectures": ("Qwen3MoeForCausalLM",)}, "Qwen3MoeForCausalLM is not supported"),
        ({"tp_size": 2}, "tp_size=2; only tp_size=1"),
        ({"pp_size": 2}, "pp_size=2"),
        ({"dp_size": 2}, "dp_size=2"),
        ({"enable_dp_attention": True}, "enable_dp_attention"),
        ({"attn_cp_size": 2}, "context parallelism"),
        ({"nnodes": 2}, "nnodes=2"),
        ({"speculative_algorithm": "EAGLE"}, "speculative decoding"),
        ({"enable_two_batch_overlap": True}, "two_batch_overlap"),
        ({"enable_pdmux": True}, "PD multiplexing"),
        ({"disaggregation_mode": "prefill"}, "disaggregation"),
        ({"lora": True}, "LoRA"),
        ({"dllm_algorithm": "x"}, "diffusion"),
        ({"enable_mis": True}, "enable_mis=True (multi-item scoring) is not supported"),
        ({"enable_layernorm_sp": True}, "layernorm sequence parallelism"),
        ({"enable_torch_compile": True}, "enable_torch_compile"),
        ({"rl_on_policy_target": "fsdp"}, "rl_on_policy_target='fsdp'"),
        ({"model_impl": "transformers"}, "model_impl='transformers'"),
        ({"is_generation": False}, "only generation models"),
        ({"num_continuous_decode_steps": 2}, "num_continuous_decode_steps=2"),
        ({"forward_hooks": True}, "forward_hooks"),
        ({"startup_weight_load_mode": "overlap"}, "startup_weight_load_mode='overlap'"),
        ({"activation_dtype": "float32"}, "activation dtype float32"),
        ({"decode_graph_backend": "breakable"}, "decode CUDA graph backend 'breakable'"),
        ({"sglang_version": "0.5.20"}, "sglang 0.5.20 is installed"),
        ({"torch_version": "2.11.0+cu128"}, "torch 2.11.0+cu128 is installed"),
    ],
)
def test_each_rejection(change: dict[str, object], reason: str) -> None:
    report = check_support(attrs.evolve(QWEN3, **change))
    assert not report.supported
    assert any(reason in r for r in report.rejections), report.rejections


def test_every_reason_is_reported_at_once() -> None:
    facts = attrs.evolve(QWEN3, architectures=("Qwen3MoeForCausalLM",), tp_size=2, lora=True)
    with pytest.raises(UnsupportedConfigurationError) as info:
        check_support(facts).raise_if_rejected()
    assert len(info.value.reasons) == 3
    assert "tp_size=2" in str(info.value)
    assert "LoRA" in str(info.value)


def test_forced_settings_and_notes() -> None:
    facts = attrs.evolve(QWEN3, prefill_graph_enabled=True, radix_cache_enabled=True,
                         decode_graph_backend="tc_piecewise")
    report = check_support(facts)
    assert report.supported
    assert {f.name for f in report.forced} == {"prefill cuda graph", "radix cache"}
    assert any("runs as 'full'" in n for n in report.notes)
    kept = check_support(facts, allow_prefix_cache=True)
    assert {f.name for f in kept.forced} == {"prefill cuda graph"}


def test_row_coverage() -> None:
    resid = hook_by_name("resid_pre")
    logits = hook_by_name("final_logits")
    kw = {"prompt_tokens": 5, "completion_tokens": 3}
    assert expected_coverage(resid, overlap_extra_forward=False, **kw).rows == 7
    extra = expected_coverage(resid, overlap_extra_forward=True, **kw)
    assert (extra.start, extra.end) == (0, 8)
    lg = expected_coverage(logits, overlap_extra_forward=True, **kw)
    assert (lg.start, lg.end) == (4, 7)  # one row per generated token
    cached = expected_coverage(resid, overlap_extra_forward=False, computed_from=4, **kw)
    assert (cached.start, cached.end) == (4, 7)
    manifest = RequestManifest("run", "r", 5, 3, overlap_extra_forward=True)
    assert manifest.coverage(resid) == extra


def test_record_repr_hides_payload() -> None:
    rec = CaptureRecord("run", "r", "token_ids", -1, 0, 0, 2, "torch.int64", (2,), b"x" * 16)
    assert "<16 bytes>" in repr(rec)
    assert rec.rows == 2
