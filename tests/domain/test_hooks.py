"""Hook catalog, presets and the selection syntax."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmi_sglang.domain.hooks import (
    CATALOG,
    FIRING_ORDER,
    PRESETS,
    ModelHooks,
    RowBasis,
    hook_by_name,
    parse_selection,
)
from dmi_sglang.domain.payloads import Payload, StorageDType
from dmi_sglang.domain.positions import Positions
from dmi_sglang.errors import SelectionError

QWEN3_HOOKS = frozenset(PRESETS["sglang-full"]) - {
    "pos_embed",
    "router_logits",
    "topk_ids",
    "topk_weights",
}
QWEN3 = ModelHooks("Qwen3ForCausalLM", QWEN3_HOOKS, 4)


def test_catalog_matches_dmi_ids_and_act_names() -> None:
    ids = {h.name: h.id for h in CATALOG if not h.derived}
    assert 10 not in ids.values()
    assert sorted(ids.values()) == [i for i in range(24) if i != 10]
    assert {h.name: h.id for h in CATALOG if h.derived} == {
        "logits_topk_values": 24, "logits_topk_ids": 25}
    assert hook_by_name("resid_pre").act_name == "blocks.hook_resid_pre"
    assert hook_by_name("q").act_name == "blocks.attn.hook_q"
    assert hook_by_name("mlp_post").act_name == "blocks.hook_mlp_post"
    assert hook_by_name("final_ln").act_name == "hook_final_ln"
    assert hook_by_name("token_ids").act_name == "token_ids"
    assert hook_by_name("final_logits").act_name == "final_logits"
    assert hook_by_name("final_logits").row_basis is RowBasis.REQUEST
    request_rows = {"final_logits", "logits_topk_values", "logits_topk_ids"}
    assert all(h.row_basis is RowBasis.TOKEN for h in CATALOG if h.name not in request_rows)
    assert set(FIRING_ORDER) == {h.name for h in CATALOG}


def test_presets() -> None:
    assert set(PRESETS["full"]) == {h.name for h in CATALOG if not h.derived}
    assert set(PRESETS["full"]) - set(PRESETS["sglang-full"]) == {"attn_scores", "pattern"}
    assert PRESETS["hidden-states"] == ("resid_pre",)
    assert PRESETS["logits"] == ("final_logits",)
    assert set(PRESETS["hf-only"]) == {"resid_pre", "final_ln", "final_logits"}


def test_sglang_full_on_qwen3_omits_missing_members() -> None:
    sel = parse_selection("sglang-full").resolve(QWEN3)
    assert set(sel.names) == QWEN3_HOOKS
    assert set(sel.omitted) == {"pos_embed", "router_logits", "topk_ids", "topk_weights"}
    assert sel.layers_of("resid_pre") == (0, 1, 2, 3)
    assert sel.layers_of("final_ln") == ()


def test_explicit_missing_hook_is_an_error() -> None:
    with pytest.raises(SelectionError, match="'pattern' is not available for Qwen3ForCausalLM"):
        parse_selection("resid_pre,pattern").resolve(QWEN3)


def test_layer_ranges() -> None:
    sel = parse_selection("resid_pre@1-2,ln1@3,final_ln").resolve(QWEN3)
    assert sel.layers_of("resid_pre") == (1, 2)
    assert sel.layers_of("ln1") == (3,)
    assert [(h.name, layer) for h, layer in sel.captures()] == [
        ("resid_pre", 1),
        ("resid_pre", 2),
        ("ln1", 3),
        ("final_ln", -1),
    ]
    union = parse_selection("resid_pre@0,resid_pre@2-3").resolve(QWEN3)
    assert union.layers_of("resid_pre") == (0, 2, 3)
    preset = parse_selection("hidden-states@2-3").resolve(QWEN3)
    assert preset.layers_of("resid_pre") == (2, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("resid_pree", "unknown hook or preset 'resid_pree'"),
        ("", "empty hook selection"),
        ("resid_pre,,ln1", "empty item"),
        ("resid_pre@a-b", "bad layer range 'a-b'"),
        ("resid_pre@3-1", "bad layer range '3-1'"),
        ("final_ln@0", "global hook and takes no layer range"),
    ],
)
def test_selection_errors_name_the_bad_token(text: str, message: str) -> None:
    with pytest.raises(SelectionError, match=message) as info:
        parse_selection(text)
    if "unknown" in message:
        assert "accepted hooks: resid_pre" in str(info.value)
        assert "presets: full, sglang-full" in str(info.value)


def test_layer_outside_the_model() -> None:
    with pytest.raises(SelectionError, match="outside the model's layers 0-3"):
        parse_selection("resid_pre@2-4").resolve(QWEN3)


def test_aliases() -> None:
    assert parse_selection("hidden_states").resolve(QWEN3).names == ("resid_pre",)
    assert parse_selection("token-ids").resolve(QWEN3).names == ("token_ids",)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(sorted(QWEN3_HOOKS)),
            st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 3))),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_round_trip_and_captures_in_firing_order(items: list[tuple[str, object]]) -> None:
    parts = []
    for name, rng in items:
        per_layer = hook_by_name(name).per_layer
        if rng is None or not per_layer:
            parts.append(name)
        else:
            lo, hi = sorted(rng)  # type: ignore[call-overload]
            parts.append(f"{name}@{lo}-{hi}")
    parsed = parse_selection(",".join(parts))
    assert parse_selection(str(parsed)) == parsed
    sel = parsed.resolve(QWEN3)
    caps = sel.captures()
    assert len(caps) == len(set(caps))
    per_layer_caps = [(layer, FIRING_ORDER.index(h.name)) for h, layer in caps if layer >= 0]
    assert per_layer_caps == sorted(per_layer_caps)


@pytest.mark.parametrize(
    ("text", "message"),
    [("resid_pre:fp8", "fp8 storage is not offered"),
     ("resid_pre:int8", "unknown modifier 'int8'"),
     # found in review: a mistyped dtype was told only the position rules
     ("resid_pre:BF16", "payload modifiers: bf16, fp16, topk(K)"),
     ("resid_pre:lst", "position rules: all, last_prompt, last, generated"),
     ("resid_pre:every(\u0663)", "unknown position rule"),
     # found in review: a layer range on a preset of global hooks was dropped silently,
     # and int() took 1_0 as layer 10
     ("logits@5", "holds only global hooks: no layer range"),
     ("resid_pre@1_0", "bad layer range '1_0'"),
     ("resid_pre:topk(4)", "applies to final_logits only, not 'resid_pre'"),
     ("hf-only:topk(4)", "applies to final_logits only"),
     ("final_logits:topk(0)", "K must be at least 1"),
     ("token_ids:bf16", "'token_ids' holds integers"),
     ("resid_pre:fp16:bf16", "two storage dtypes"),
     ("final_logits:topk(2):topk(3)", "two topk modifiers"),
     ("resid_pre:generated:last_prompt", "two position rules"),
     ("logits_topk_values", "made by final_logits:topk(K)"),
     ("final_logits:topk(2),final_logits:topk(3)", "two payloads, topk(2) and topk(3)"),
     ("resid_pre@1,resid_pre@1:fp16", "two payloads, as computed and fp16")],
)
def test_payload_modifier_errors_name_the_bad_token(text: str, message: str) -> None:
    with pytest.raises(SelectionError, match=re.escape(message)):
        parse_selection(text).resolve(QWEN3)


def test_payload_modifiers_resolve_per_capture() -> None:
    sel = parse_selection(
        "resid_pre@1-2:last_prompt:fp16,sglang-full@0:bf16,final_logits:generated:topk(8)"
    ).resolve(QWEN3)
    assert sel.payload_of("resid_pre", 1) == Payload(StorageDType.FP16)
    assert sel.payload_of("resid_pre", 0) == Payload(StorageDType.BF16)  # via the preset
    assert sel.payload_of("token_ids", -1) == Payload()  # integers keep their type
    assert sel.payload_of("final_logits", -1) == Payload(StorageDType.BF16)
    assert sel.payload_of("logits_topk_ids", -1) == Payload(topk=8)
    assert sel.positions_of("logits_topk_values", -1) == Positions.parse("generated")
    assert [h.name for h, _ in sel.captures()][-3:] == [
        "final_logits", "logits_topk_values", "logits_topk_ids"]
    # the model must offer final_logits for its top K
    no_logits = ModelHooks("Toy", frozenset({"resid_pre"}), 2)
    with pytest.raises(SelectionError, match="hook 'final_logits' is not available"):
        parse_selection("final_logits:topk(3)").resolve(no_logits)


@given(st.sampled_from(["", ":fp16", ":bf16"]), st.sampled_from(["", ":last_prompt"]),
       st.integers(1, 99))
def test_payload_modifiers_round_trip(dtype: str, rule: str, k: int) -> None:
    for text in (f"resid_pre@1{rule}{dtype}", f"final_logits{dtype}:topk({k}){rule}"):
        parsed = parse_selection(text)
        assert parse_selection(str(parsed)) == parsed


def test_stored_rows_follow_the_payload() -> None:
    from dmi_sglang.domain.shapes import DType, ModelShape, RowSpec
    from dmi_sglang.errors import ConfigurationError

    shape = ModelShape(2, 8, 2, 1, 4, 12, vocab=10)
    values, ids = hook_by_name("logits_topk_values"), hook_by_name("logits_topk_ids")
    assert shape.row(values, Payload(topk=3)) == RowSpec((3,), DType.FLOAT32)
    assert shape.row(values, Payload(StorageDType.FP16, 3)) == RowSpec((3,), DType.FLOAT16)
    assert shape.row(ids, Payload(StorageDType.FP16, 3)) == RowSpec((3,), DType.INT32)
    assert shape.row(hook_by_name("final_logits"), Payload(StorageDType.BF16)) == RowSpec(
        (10,), DType.BFLOAT16)
    with pytest.raises(ConfigurationError, match=r"topk\(11\) needs 1 <= K <= the vocabulary"):
        shape.row(values, Payload(topk=11))


def test_capture_points_fire_final_logits_once_for_its_derived_captures() -> None:
    sel = parse_selection("final_ln,final_logits:topk(8),resid_pre@1").resolve(QWEN3)
    assert [(h.name, n) for h, n in sel.capture_points()] == [
        ("resid_pre", 1), ("final_ln", -1), ("final_logits", -1)]
    plain = parse_selection("final_logits,final_logits:topk(8)").resolve(QWEN3)
    assert [(h.name, n) for h, n in plain.capture_points()] == [("final_logits", -1)]


def test_topk_takes_ascii_digits_only_like_layers_and_positions() -> None:
    with pytest.raises(SelectionError):
        parse_selection("resid_pre@\u0661")
    with pytest.raises(SelectionError):
        parse_selection("resid_pre:positions(\u0661)")
    with pytest.raises(SelectionError, match="topk"):
        parse_selection("final_logits:topk(\u0666\u0664)")
