"""Hypothesis strategies shared by the domain tests."""

from __future__ import annotations

from hypothesis import strategies as st

from dmi_sglang.domain.hooks import PRESETS, ModelHooks, Selection, parse_selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.shapes import DType, ModelShape

QWEN3_HOOKS = frozenset(PRESETS["sglang-full"]) - {
    "pos_embed",
    "router_logits",
    "topk_ids",
    "topk_weights",
}
SHAPE = ModelShape(
    num_layers=3,
    hidden=24,
    heads=4,
    kv_heads=2,
    head_dim=6,
    intermediate=40,
    vocab=50,
    activation_dtype=DType.BFLOAT16,
)
MODEL = ModelHooks("Qwen3ForCausalLM", QWEN3_HOOKS, SHAPE.num_layers)


@st.composite
def selections(draw: st.DrawFn) -> Selection:
    """A random selection of Qwen3 hooks, sometimes with layer ranges."""
    names = draw(st.lists(st.sampled_from(sorted(QWEN3_HOOKS)), min_size=1, max_size=5))
    text = ",".join(names)
    if draw(st.booleans()):
        text = draw(st.sampled_from(["sglang-full", "hidden-states", "hf-only", "logits"]))
    return parse_selection(text).resolve(MODEL)


@st.composite
def decode_layouts(draw: st.DrawFn) -> BatchLayout:
    """A decode step, padded to a bucket >= its batch."""
    n = draw(st.integers(1, 12))
    seq = draw(st.lists(st.integers(1, 500), min_size=n, max_size=n))
    padded = draw(st.integers(n, n + 8))
    return BatchLayout.decode([f"r{i}" for i in range(n)], seq, padded_batch_size=padded)


@st.composite
def extend_layouts(draw: st.DrawFn) -> BatchLayout:
    """An extend (prefill chunk) step; some requests may be mid-prompt."""
    n = draw(st.integers(1, 6))
    prefix = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    extend = draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    rest = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    seq = [p + e + r for p, e, r in zip(prefix, extend, rest, strict=True)]
    return BatchLayout.extend([f"r{i}" for i in range(n)], prefix, extend, seq_lens=seq)
