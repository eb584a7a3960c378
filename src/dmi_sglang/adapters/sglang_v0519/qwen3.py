"""Capture points around an upstream SGLang 0.5.19 ``Qwen3ForCausalLM`` instance.

Nothing of SGLang's model code is copied: :func:`install_capture_points` replaces the
``forward`` of chosen submodule *instances* with a wrapper that calls the original and
hands one tensor per selected hook to ``capturer.capture(hook, layer_no, tensor)``. The
wrappers are plain Python, so under decode CUDA-graph capture they run once per captured
batch size and their GPU work (the capturer's copies) is recorded into the graph; at
replay only that recorded work runs. docs/hooked-qwen3.md explains every wrap point.

Contract with the capturer: a tensor handed to ``capture`` is valid only during the call.
SGLang's fused kernels overwrite several of them in place shortly after (the embedding is
the residual that layer 1's fused add+RMSNorm overwrites; o_proj's and the MLP's outputs
are overwritten by the next norm; RoPE rotates q and k in place right after their capture;
the sampler divides and soft-maxes the logits in place), so the capturer copies before
returning (a stream-ordered copy suffices) and the capture points hand it the model's own
tensors, never a clone of their own (a clone would be one more device copy per capture).
Capture points do not fire for tensors without rows (SGLang's IDLE batches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from sglang.srt.models.qwen3 import Qwen3ForCausalLM
from torch import nn

from dmi_sglang.adapters.sglang_v0519 import _points as p
from dmi_sglang.adapters.sglang_v0519._points import GLOBAL_LAYER
from dmi_sglang.errors import CaptureError
from dmi_sglang.tensor_ports import Capturer

__all__ = [
    "ARCHITECTURE",
    "GLOBAL_LAYER",
    "DMIQwen3ForCausalLM",
    "install_capture_points",
    "register_hooked_models",
    "remove_capture_points",
    "unregister_hooked_models",
]

log = structlog.get_logger(__name__)

ARCHITECTURE = "Qwen3ForCausalLM"
"""The HF architecture name (and SGLang ModelRegistry key) the hooked class serves."""

_INSTALLED = "_dmi_capture_points"


class DMIQwen3ForCausalLM(Qwen3ForCausalLM):  # type: ignore[misc]  # sglang is untyped
    """SGLang's ``Qwen3ForCausalLM``, unchanged; registered under the upstream key.

    It adds no code (its constructor is the upstream one): its only purpose is identity,
    so the load_model hook can tell a model built while dmi-sglang was registered.
    Capture points are added to the instance afterwards by
    :func:`install_capture_points`, which accepts any upstream instance.
    """


def install_capture_points(model: nn.Module, capturer: Capturer) -> list[str]:
    """Wrap the selected capture points of an upstream Qwen3ForCausalLM instance.

    Call it after the weights are loaded and before CUDA graphs are captured (the
    ``ModelRunner.load_model`` hook), so the wrappers become part of the graphs.

    Returns:
        The installed points in firing order, ``"hook@layer"`` for per-layer hooks and
        ``"hook"`` for global ones.

    Raises:
        CaptureError: not an upstream Qwen3ForCausalLM, capture points already installed,
            or a pipeline-parallel slice of the model. Whatever an install raises, the
            wrappers it installed before are removed first.
    """
    if not isinstance(model, Qwen3ForCausalLM):
        msg = f"capture points need SGLang's Qwen3ForCausalLM, got {type(model).__name__}"
        raise CaptureError(msg)
    if getattr(model, _INSTALLED, None) is not None:
        msg = "capture points are already installed on this model"
        raise CaptureError(msg)
    top: Any = model  # SGLang is untyped: its submodules are reached dynamically
    inner = top.model
    num_layers = int(top.config.num_hidden_layers)
    if (inner.start_layer, inner.end_layer) != (0, num_layers):
        msg = f"layers {inner.start_layer}-{inner.end_layer} of {num_layers}: PP is unsupported"
        raise CaptureError(msg)
    patches: list[p.Patch] = []
    done: list[str] = []

    def want(hook: str, layer: int = GLOBAL_LAYER) -> bool:
        if capturer.wants(hook, layer):
            done.append(hook if layer == GLOBAL_LAYER else f"{hook}@{layer}")
            return True
        return False

    try:
        if want("token_ids"):
            p.wrap(patches, model, p.entry(capturer))
        if want("embed"):
            p.wrap(patches, inner.embed_tokens, p.after(capturer, "embed", GLOBAL_LAYER))
        for i in range(num_layers):
            _install_layer(inner.layers[i], i, capturer, want, patches)
        final, final_ln = want("resid_final"), want("final_ln")
        if final or final_ln:
            p.wrap(patches, inner.norm, p.norm(capturer, GLOBAL_LAYER,
                                               resid="resid_final" if final else None,
                                               normed="final_ln" if final_ln else None))
        if want("final_logits"):
            p.wrap(patches, top.logits_processor, p.logits(capturer))
        if capturer.joins:
            _install_joins(top, capturer, patches)
    except BaseException:  # a halfway install leaves no wrapper behind
        for patch in reversed(patches):
            patch.undo()
        raise
    object.__setattr__(model, _INSTALLED, tuple(patches))
    log.info("dmi.capture_points.installed", count=len(done), wrapped=len(patches))
    return done


def _install_joins(top: Any, c: Capturer, patches: list[p.Patch]) -> None:
    """Where the capturer's copies of the residual stream must be done (its ``join``):
    before the fused norm that next changes a captured residual in place (installed
    last, so it runs before that norm's own capture wrapper), and when the model's
    forward returns (see :class:`~dmi_sglang.tensor_ports.Capturer`). Installed only
    for a capturer that :attr:`~dmi_sglang.tensor_ports.Capturer.joins`."""
    layers = top.model.layers
    for i, layer in enumerate(layers):
        if c.wants("resid_pre", i):  # changed in place by the layer's second norm
            p.wrap(patches, layer.post_attention_layernorm, p.join_before(c))
        if c.wants("resid_mid", i):  # changed in place by the next layer's first norm
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else top.model.norm
            p.wrap(patches, nxt, p.join_before(c))
    p.wrap(patches, top, p.join_after(c))


def _install_layer(
    layer: Any,
    i: int,
    c: Capturer,
    want: Callable[[str, int], bool],
    patches: list[p.Patch],
) -> None:
    """One decoder layer's points, asked for in firing order (the order ``want`` logs)."""
    attn = layer.self_attn
    pre, ln1 = want("resid_pre", i), want("ln1", i)
    if pre or ln1:
        p.wrap(patches, layer.input_layernorm,
               p.norm(c, i, resid="resid_pre" if pre else None, normed="ln1" if ln1 else None))
    wq, wk = want("q", i), want("k", i)
    if wq or wk:
        tap = p.QKTap(c, i, attn.num_heads, attn.num_kv_heads, attn.head_dim, wq, wk)
        p.wrap(patches, attn, p.arm(tap))
        p.tap_rope(attn.rotary_emb)
    wv, wz = want("v", i), want("z", i)
    if wv or wz:
        kv = (attn.num_kv_heads, attn.head_dim) if wv else None
        p.wrap(patches, attn.attn, p.radix(c, i, kv=kv, z=wz))
    if want("attn_out", i):
        p.wrap(patches, attn.o_proj, p.after(c, "attn_out", i))
    mid, ln2 = want("resid_mid", i), want("ln2", i)
    if mid or ln2:
        p.wrap(patches, layer.post_attention_layernorm,
               p.norm(c, i, resid="resid_mid" if mid else None, normed="ln2" if ln2 else None))
    mlp_in, mlp_post, mlp_out = want("mlp_in", i), want("mlp_post", i), want("mlp_out", i)
    if mlp_post:
        p.wrap(patches, layer.mlp.act_fn, p.after(c, "mlp_post", i))
    if mlp_in or mlp_out:
        p.wrap(patches, layer.mlp, p.mlp(c, i, want_in=mlp_in, want_out=mlp_out))


def remove_capture_points(model: nn.Module) -> None:
    """Restore the wrapped modules' ``forward`` (no-op when nothing is installed).

    CUDA graphs captured while the points were installed keep them.
    """
    patches: tuple[p.Patch, ...] = getattr(model, _INSTALLED, None) or ()
    for patch in reversed(patches):
        patch.undo()
    if hasattr(model, _INSTALLED):
        object.__delattr__(model, _INSTALLED)


def register_hooked_models() -> None:
    """Serve ``Qwen3ForCausalLM`` checkpoints with :class:`DMIQwen3ForCausalLM`.

    Sets ``ModelRegistry.models["Qwen3ForCausalLM"]``; ``hf_config.architectures`` is left
    alone (SGLang keys behaviour on it). Idempotent.

    Raises:
        CaptureError: another package already replaced the upstream class.
    """
    from sglang.srt.models.registry import ModelRegistry

    current = ModelRegistry.models.get(ARCHITECTURE)
    if current is DMIQwen3ForCausalLM:
        return
    if current is not Qwen3ForCausalLM:
        msg = (f"ModelRegistry serves {ARCHITECTURE} with {current!r}, not SGLang's own "
               "class (SGLANG_EXTERNAL_MODEL_PACKAGE or another plugin?)")
        raise CaptureError(msg)
    ModelRegistry.models[ARCHITECTURE] = DMIQwen3ForCausalLM
    log.info("dmi.model_registered", architecture=ARCHITECTURE)


def unregister_hooked_models() -> None:
    """Put SGLang's own class back (no-op when it is there)."""
    from sglang.srt.models.registry import ModelRegistry

    if ModelRegistry.models.get(ARCHITECTURE) is DMIQwen3ForCausalLM:
        ModelRegistry.models[ARCHITECTURE] = Qwen3ForCausalLM
