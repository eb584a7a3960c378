"""Capture points on a real upstream SGLang Qwen3ForCausalLM, run on CPU.

The model is SGLang's own class with the demo checkpoint's weights; a packed extend batch
of two prompts runs through it (fake attention, see conftest). Every capture is compared
with the same quantity taken from a transformers forward of the same weights, which pins
the *semantics* of each wrap point (q/k after q/k-norm and before RoPE, the residual
stream from the fused norms' second output, ...), plus shapes, dtypes and firing order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

PROMPTS = [[5, 17, 99, 3, 250, 7], [11, 12, 13, 14]]


class Recorder:
    """A capturer that keeps a copy of everything, in call order."""

    def __init__(self, keys: set[tuple[str, int]] | None = None) -> None:
        self.keys = keys
        self.calls: list[tuple[str, int, Any]] = []

    def wants(self, hook_name: str, layer_no: int) -> bool:
        return self.keys is None or (hook_name, layer_no) in self.keys

    def capture(self, hook_name: str, layer_no: int, tensor: Any) -> None:
        self.calls.append((hook_name, layer_no, tensor.detach().clone()))

    joins = False

    def join(self) -> None:
        pass

    def get(self, hook: str, layer: int) -> Any:
        found = [t for h, n, t in self.calls if (h, n) == (hook, layer)]
        assert len(found) == 1, (hook, layer, len(found))
        return found[0]


def _hf_reference(checkpoint: Path, prompts: list[list[int]]) -> dict[tuple[str, int], Any]:
    """The same quantities from transformers, per prompt, concatenated along tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    got: dict[tuple[str, int], list[Any]] = {}

    def keep(key: tuple[str, int], t: Any) -> None:
        got.setdefault(key, []).append(t.detach().reshape(-1, *t.shape[2:]).clone())

    def hook(name: str, layer: int, *, use_input: bool) -> Callable[..., None]:
        def fn(_m: Any, args: tuple[Any, ...], out: Any) -> None:
            keep((name, layer), args[0] if use_input else out)

        return fn

    inner = hf.model
    mods = [(inner.embed_tokens, "embed", -1, False), (inner.norm, "resid_final", -1, True),
            (inner.norm, "final_ln", -1, False)]
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn
        mods += [(layer.input_layernorm, "resid_pre", i, True),
                 (layer.input_layernorm, "ln1", i, False), (a.q_norm, "q", i, False),
                 (a.k_norm, "k", i, False), (a.v_proj, "v", i, False),
                 (a.o_proj, "z", i, True), (a.o_proj, "attn_out", i, False),
                 (layer.post_attention_layernorm, "resid_mid", i, True),
                 (layer.post_attention_layernorm, "ln2", i, False),
                 (layer.mlp, "mlp_in", i, True), (layer.mlp.down_proj, "mlp_post", i, True),
                 (layer.mlp, "mlp_out", i, False)]
    handles = [m.register_forward_hook(hook(n, i, use_input=u)) for m, n, i, u in mods]
    logits = []
    with torch.no_grad():
        for prompt in prompts:
            logits.append(hf(torch.tensor([prompt])).logits[0, -1:])
    for h in handles:
        h.remove()
    ref = {k: torch.cat(v) for k, v in got.items()}
    ref["final_logits", -1] = torch.cat(logits)
    ref["token_ids", -1] = torch.tensor([t for p in PROMPTS for t in p])
    return ref


@pytest.fixture(scope="module")
def full_capture(
    build_qwen3: Callable[..., Any], extend_batch: Callable[..., Any], fake_attention: None
) -> tuple[Recorder, list[str], Any]:
    import torch

    from dmi_sglang.adapters.sglang_v0519.qwen3 import install_capture_points

    model = build_qwen3(torch.float32)
    recorder = Recorder()
    installed = install_capture_points(model, recorder)
    fb = extend_batch(PROMPTS)
    return recorder, installed, model(fb.input_ids, fb.positions, fb)


def test_every_capture_matches_the_transformers_forward(
    full_capture: tuple[Recorder, list[str], Any], demo_checkpoint: Path
) -> None:
    import torch

    recorder, _, out = full_capture
    ref = _hf_reference(demo_checkpoint, PROMPTS)
    assert {(h, n) for h, n, _ in recorder.calls} == set(ref)
    for (hook, layer), expected in ref.items():
        got = recorder.get(hook, layer)
        got = got.reshape(expected.shape) if hook in ("q", "k", "v") else got
        assert got.shape == expected.shape, (hook, layer)
        torch.testing.assert_close(got.to(expected.dtype), expected, rtol=2e-4, atol=2e-4,
                                   msg=f"{hook}@{layer}")
    # The logits capture is a copy: later in-place changes (the sampler's) do not reach it.
    out.next_token_logits.mul_(0)
    assert recorder.get("final_logits", -1).abs().sum() > 0


@pytest.mark.usefixtures("fake_attention")
def test_q_and_k_are_taken_before_an_in_place_rope_rotates_them(
    build_qwen3: Callable[..., Any], extend_batch: Callable[..., Any], demo_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA, RoPE rotates q and k in place (``forward_cuda``) right after their capture
    points hand them over, uncloned; here the rotary embedding's own method (the one its
    ``forward`` dispatches to) is made to do so too: its results written into its inputs."""
    import torch

    from dmi_sglang.adapters.sglang_v0519.qwen3 import (
        install_capture_points,
        remove_capture_points,
    )

    model = build_qwen3(torch.float32)
    keys = {("q", 1), ("k", 1)}
    recorder = Recorder(keys)
    install_capture_points(model, recorder)
    rope = model.model.layers[0].self_attn.rotary_emb  # shared, tapped once per process
    rotate = rope._forward_method or rope.dispatch_forward()
    rotated = []

    def in_place(positions: Any, query: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        q, k = rotate(positions, query, key, *args, **kwargs)
        query.copy_(q.view_as(query))
        key.copy_(k.view_as(key))
        rotated.append(True)
        return query, key

    monkeypatch.setattr(rope, "_forward_method", in_place)
    try:
        fb = extend_batch(PROMPTS)
        model(fb.input_ids, fb.positions, fb)
    finally:
        remove_capture_points(model)
    assert rotated  # the forward went through the in-place rotation
    ref = _hf_reference(demo_checkpoint, PROMPTS)
    for hook, layer in keys:
        expected = ref[hook, layer]
        torch.testing.assert_close(recorder.get(hook, layer).reshape(expected.shape), expected,
                                   rtol=2e-4, atol=2e-4, msg=f"{hook}@{layer}")


def test_firing_order_is_the_domain_plan_order(
    full_capture: tuple[Recorder, list[str], Any], demo_checkpoint: Path
) -> None:
    from transformers import AutoConfig

    from dmi_sglang.adapters.sglang_v0519.facts import model_hooks
    from dmi_sglang.domain.hooks import parse_selection

    recorder, installed, _ = full_capture
    selection = parse_selection("sglang-full").resolve(
        model_hooks(AutoConfig.from_pretrained(demo_checkpoint))
    )
    expected = [(h.name, n) for h, n in selection.captures()]
    assert [(h, n) for h, n, _ in recorder.calls] == expected
    assert installed == [h if n == -1 else f"{h}@{n}" for h, n in expected]


@pytest.mark.usefixtures("fake_attention")
def test_shapes_and_dtypes_match_the_model_shape(
    build_qwen3: Callable[..., Any], extend_batch: Callable[..., Any]
) -> None:
    import torch

    from dmi_sglang.adapters.sglang_v0519.facts import model_shape
    from dmi_sglang.adapters.sglang_v0519.qwen3 import install_capture_points
    from dmi_sglang.domain.hooks import hook_by_name

    model = build_qwen3(torch.bfloat16)
    recorder = Recorder()
    install_capture_points(model, recorder)
    fb = extend_batch(PROMPTS)
    model(fb.input_ids, fb.positions, fb)
    shape = model_shape(model.config, torch.bfloat16)
    tokens = sum(len(p) for p in PROMPTS)
    for hook, layer, tensor in recorder.calls:
        spec = shape.row(hook_by_name(hook))
        rows = len(PROMPTS) if hook == "final_logits" else tokens
        assert tuple(tensor.shape) == (rows, *spec.dims), (hook, layer)
        assert str(tensor.dtype) == spec.dtype.value, (hook, layer)


@pytest.mark.usefixtures("fake_attention")
def test_unselected_points_are_not_installed_and_removal_restores(
    build_qwen3: Callable[..., Any], extend_batch: Callable[..., Any]
) -> None:
    import torch

    from dmi_sglang.adapters.sglang_v0519.qwen3 import (
        install_capture_points,
        remove_capture_points,
    )
    from dmi_sglang.errors import CaptureError

    model = build_qwen3(torch.float32)
    keys = {("resid_pre", 0), ("resid_pre", 2), ("k", 1), ("final_logits", -1)}
    recorder = Recorder(keys)
    assert install_capture_points(model, recorder) == [
        "resid_pre@0", "k@1", "resid_pre@2", "final_logits"]
    rope = model.model.layers[0].self_attn.rotary_emb  # shared, tapped once per process
    wrapped = {n for n, m in model.named_modules() if "forward" in m.__dict__ and m is not rope}
    assert wrapped == {"model.layers.0.input_layernorm", "model.layers.1.self_attn",
                       "model.layers.2.input_layernorm", "logits_processor"}
    with pytest.raises(CaptureError, match="already installed"):
        install_capture_points(model, recorder)
    fb = extend_batch(PROMPTS)
    model(fb.input_ids, fb.positions, fb)
    assert [(h, n) for h, n, _ in recorder.calls] == sorted(
        keys, key=lambda k: (k[1] if k[1] >= 0 else 99, k[0]))
    remove_capture_points(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if m is not rope)
    recorder.calls.clear()
    model(fb.input_ids, fb.positions, fb)
    assert recorder.calls == []


@pytest.mark.usefixtures("fake_attention")
def test_an_install_that_fails_halfway_leaves_no_wrapper(
    build_qwen3: Callable[..., Any], extend_batch: Callable[..., Any]
) -> None:
    """A capturer whose ``wants`` raises in layer 1: the points wrapped before are
    unwrapped, so the model runs unhooked and a later install wraps each point once."""
    import torch

    from dmi_sglang.adapters.sglang_v0519.qwen3 import (
        install_capture_points,
        remove_capture_points,
    )

    class Failing(Recorder):
        asked = 0

        def wants(self, hook_name: str, layer_no: int) -> bool:
            self.asked += 1
            if self.asked == 20:
                msg = "the capturer broke"
                raise RuntimeError(msg)
            return True

    model = build_qwen3(torch.float32)
    failing = Failing()
    with pytest.raises(RuntimeError, match="the capturer broke"):
        install_capture_points(model, failing)
    rope = model.model.layers[0].self_attn.rotary_emb  # shared, tapped once per process
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__ and m is not rope]
    keys = {("resid_pre", 0), ("final_logits", -1)}
    recorder = Recorder(keys)
    install_capture_points(model, recorder)
    fb = extend_batch(PROMPTS)
    try:
        model(fb.input_ids, fb.positions, fb)
    finally:
        remove_capture_points(model)
    assert failing.calls == []
    assert sorted((h, n) for h, n, _ in recorder.calls) == sorted(keys)


def test_install_refuses_other_models() -> None:
    from torch import nn

    from dmi_sglang.adapters.sglang_v0519.qwen3 import install_capture_points
    from dmi_sglang.errors import CaptureError

    with pytest.raises(CaptureError, match="Qwen3ForCausalLM"):
        install_capture_points(nn.Linear(2, 2), Recorder())


def test_hooked_class_is_registered_under_the_upstream_key(
    build_qwen3: Callable[..., Any],
) -> None:
    import torch
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.registry import ModelRegistry

    from dmi_sglang.adapters.sglang_v0519.qwen3 import (
        DMIQwen3ForCausalLM,
        register_hooked_models,
        unregister_hooked_models,
    )

    assert ModelRegistry.models["Qwen3ForCausalLM"] is Qwen3ForCausalLM
    try:
        register_hooked_models()
        register_hooked_models()  # idempotent
        cls, arch = ModelRegistry.resolve_model_cls(["Qwen3ForCausalLM"])
        assert (cls, arch) == (DMIQwen3ForCausalLM, "Qwen3ForCausalLM")
    finally:
        unregister_hooked_models()
    assert ModelRegistry.models["Qwen3ForCausalLM"] is Qwen3ForCausalLM
    model = build_qwen3(torch.float32, DMIQwen3ForCausalLM)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.architectures == ["Qwen3ForCausalLM"]


class LateRecorder(Recorder):
    """Copies residual-stream tensors only at the next ``join``, as a second stream that
    runs the copies as late as the model allows would: a tensor changed in place before
    its join is recorded changed."""

    joins = True

    def __init__(self, keys: set[tuple[str, int]] | None = None) -> None:
        super().__init__(keys)
        self.late: list[tuple[int, Any]] = []

    def capture(self, hook_name: str, layer_no: int, tensor: Any) -> None:
        from dmi_sglang.domain.hooks import RESIDUAL_STREAM

        if hook_name not in RESIDUAL_STREAM:
            super().capture(hook_name, layer_no, tensor)
            return
        self.late.append((len(self.calls), tensor))
        self.calls.append((hook_name, layer_no, None))

    def join(self) -> None:
        for i, tensor in self.late:
            hook, layer, _ = self.calls[i]
            self.calls[i] = (hook, layer, tensor.detach().clone())
        self.late.clear()


def _norms_in_place(model: Any) -> list[int]:
    """Make every RMSNorm of ``model`` behave as CUDA's ``fused_add_rmsnorm``: the sum is
    written into the residual it was given, which it returns. Counts the fused calls."""
    from sglang.srt.layers.layernorm import RMSNorm

    fused = [0]

    def in_place(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            out = original(*args, **kwargs)
            if residual is None:
                return out
            fused[0] += 1
            residual.copy_(out[1])
            return out[0], residual

        return forward

    for module in model.modules():
        if isinstance(module, RMSNorm):
            object.__setattr__(module, "forward", in_place(module.forward))
    return fused


@pytest.mark.usefixtures("fake_attention")
@pytest.mark.parametrize("hooks", ["resid_pre", "resid_mid", "resid_pre,resid_mid,resid_final"])
def test_residual_stream_copies_may_wait_for_the_join_before_the_in_place_norm(
    build_qwen3: Callable[..., Any], extend_batch: Callable[..., Any], demo_checkpoint: Path,
    hooks: str,
) -> None:
    """The capturer may copy a residual-stream tensor as late as its next ``join`` (a
    decode graph records those copies on a second stream). With the fused norms in place,
    as on CUDA, every such capture still equals the transformers forward's: each join
    comes before the norm that changes the captured residual, and the forward's end
    joins whatever is left."""
    import torch

    from dmi_sglang.adapters.sglang_v0519.qwen3 import (
        install_capture_points,
        remove_capture_points,
    )

    model = build_qwen3(torch.float32)
    fused = _norms_in_place(model)
    layers = int(model.config.num_hidden_layers)
    names = hooks.split(",")
    keys = {(h, n) for h in names if h != "resid_final" for n in range(layers)}
    keys |= {("resid_final", -1)} if "resid_final" in names else set()
    recorder = LateRecorder(keys)
    install_capture_points(model, recorder)
    assert "forward" in model.__dict__  # the forward's end joins (a capturer that joins)
    fb = extend_batch(PROMPTS)
    try:
        model(fb.input_ids, fb.positions, fb)
    finally:
        remove_capture_points(model)
    assert fused[0] == 2 * layers  # every norm but layer 0's first ran fused, in place
    assert not recorder.late  # the forward's end joined the rest
    ref = _hf_reference(demo_checkpoint, PROMPTS)
    assert {(h, n) for h, n, _ in recorder.calls} == keys
    for hook, layer in keys:
        torch.testing.assert_close(recorder.get(hook, layer), ref[hook, layer], rtol=2e-4,
                                   atol=2e-4, msg=f"{hook}@{layer}")


def test_the_forward_end_joins_even_when_the_forward_raises() -> None:
    """A decode graph's capture must end with the capturer's second stream joined: the
    model's wrapper joins after a forward that raised, and the forward's own error is
    the one raised (a failing join does not replace it)."""
    from torch import nn

    from dmi_sglang.adapters.sglang_v0519 import _points as p

    class Failing(nn.Module):
        def forward(self, x: Any) -> Any:
            msg = "the forward broke"
            raise RuntimeError(msg)

    class JoinFails(Recorder):
        joined = 0

        def join(self) -> None:
            self.joined += 1
            msg = "the join broke too"
            raise ValueError(msg)

    recorder = JoinFails()
    module = Failing()
    p.wrap([], module, p.join_after(recorder))
    with pytest.raises(RuntimeError, match="the forward broke"):
        module(1)
    assert recorder.joined == 1
