"""The bandwidth plan's arithmetic (the transport test checks its bytes against captures)."""

from __future__ import annotations

import pytest

from dmi_sglang.domain.bandwidth import (
    DEFAULT_RATES,
    Rates,
    plan_bandwidth,
    throughput_bound,
)
from dmi_sglang.domain.hooks import CATALOG, ModelHooks, parse_selection
from dmi_sglang.domain.shapes import ModelShape

QWEN3_06B = ModelShape(28, 1024, 16, 8, 128, 3072, 151936)
HOOKS = ModelHooks("Qwen3ForCausalLM", frozenset(h.name for h in CATALOG), 28)


def captures(text: str):
    return parse_selection(text).resolve(HOOKS)


def test_hidden_states_of_qwen3_06b_at_stock_speed_are_store_bound() -> None:
    plan = plan_bandwidth(captures("hidden-states"), QWEN3_06B, prompt_tokens=256,
                          completion_tokens=128, tok_s=21_000)
    assert plan.bytes_per_request == 28 * (256 + 128) * 1024 * 2  # the extra forward too
    assert plan.bytes_per_prompt_token == 28 * 1024 * 2
    assert plan.bytes_per_generated_token == plan.bytes_per_request / 128
    assert plan.needed_bps == pytest.approx(plan.bytes_per_generated_token * 21_000)
    by_stage = {s.stage: s for s in plan.stages}
    assert set(by_stage) == {"d2h", "store", "disk"}
    assert by_stage["d2h"].bound == 1.0
    assert by_stage["store"].bound == pytest.approx(0.65e9 / plan.needed_bps)
    assert by_stage["disk"].bound == pytest.approx(1.3e9 / plan.needed_bps)
    assert plan.limiting.stage == "store"
    assert plan.bound == by_stage["store"].bound
    assert by_stage["store"].max_tok_s == pytest.approx(0.65e9 / plan.bytes_per_generated_token)


def test_logits_are_one_float32_row_per_generated_token() -> None:
    plan = plan_bandwidth(captures("final_logits"), QWEN3_06B, prompt_tokens=10,
                          completion_tokens=4, stored=False)
    assert plan.bytes_per_generated_token == 151936 * 4
    assert plan.bytes_per_prompt_token == 0
    assert [s.stage for s in plan.stages] == ["d2h"]
    assert plan.tok_s is None
    assert plan.needed_bps is None
    assert plan.bound is None
    assert plan.limiting.max_tok_s == pytest.approx(DEFAULT_RATES.d2h_bps / (151936 * 4))


def test_compression_raises_the_disk_limit() -> None:
    rates = Rates(d2h_bps=50e9, store_bps=10e9, disk_bps=1e9, compression=2.0)
    plan = plan_bandwidth(captures("hidden-states"), QWEN3_06B, prompt_tokens=1,
                          completion_tokens=1, tok_s=1.0, rates=rates)
    assert {s.stage: s.limit_bps for s in plan.stages}["disk"] == 2e9


@pytest.mark.parametrize(("prompt", "completion", "tok_s", "words"), [
    (0, 4, None, "prompt 0 and completion 4 tokens"),
    (4, 0, None, "prompt 4 and completion 0 tokens"),
    (4, 4, 0.0, "tokens per second 0.0: must be positive"),
])
def test_bad_workloads_are_refused_by_name(prompt, completion, tok_s, words) -> None:
    with pytest.raises(ValueError, match=words):
        plan_bandwidth(captures("resid_pre"), QWEN3_06B, prompt_tokens=prompt,
                       completion_tokens=completion, tok_s=tok_s)


def test_throughput_bound() -> None:
    assert throughput_bound(0.0, None) == 1.0
    assert throughput_bound(None, 5.0) is None
    assert throughput_bound(10.0, 5.0) == 0.5
    assert throughput_bound(10.0, 50.0) == 1.0


def test_payload_modifiers_shrink_the_planned_bytes() -> None:
    def per_token(text: str) -> int:
        return plan_bandwidth(captures(text), QWEN3_06B, prompt_tokens=10,
                              completion_tokens=4, stored=False).bytes_per_generated_token

    assert per_token("final_logits:topk(64)") == 64 * 4 + 64 * 4  # fp32 values, int32 ids
    assert per_token("final_logits:topk(64):bf16") == 64 * 2 + 64 * 4
    assert per_token("final_logits:fp16") == 151936 * 2
    assert per_token("hidden-states:fp16") == per_token("hidden-states")  # bf16 -> fp16


@pytest.mark.parametrize("prompt", [255, 256, 257])
def test_every_k_adds_a_kth_of_a_row_per_prompt_token_whatever_the_prompt(prompt: int) -> None:
    plan = plan_bandwidth(captures("resid_pre@0:every(8)"), QWEN3_06B, prompt_tokens=prompt,
                          completion_tokens=10)
    assert plan.bytes_per_prompt_token == 1024 * 2 / 8  # one bf16 row every 8 positions


def test_the_bounds_count_only_the_sampled_share_of_requests() -> None:
    full = plan_bandwidth(captures("hidden-states"), QWEN3_06B, prompt_tokens=256,
                          completion_tokens=128, tok_s=21_000)
    tenth = plan_bandwidth(captures("hidden-states"), QWEN3_06B, prompt_tokens=256,
                           completion_tokens=128, tok_s=21_000, sample=0.1)
    assert tenth.bytes_per_request == full.bytes_per_request  # a captured request's
    assert tenth.needed_bps == pytest.approx(full.needed_bps * 0.1)
    for a, b in zip(full.stages, tenth.stages, strict=True):
        assert b.max_tok_s == pytest.approx(10 * a.max_tok_s)
    nothing = plan_bandwidth(captures("hidden-states"), QWEN3_06B, prompt_tokens=256,
                             completion_tokens=128, tok_s=21_000, sample=0.0)
    assert nothing.bound is None or nothing.bound == 1.0
    with pytest.raises(ValueError, match=r"request sample 1\.5"):
        plan_bandwidth(captures("resid_pre"), QWEN3_06B, prompt_tokens=1,
                       completion_tokens=1, sample=1.5)
