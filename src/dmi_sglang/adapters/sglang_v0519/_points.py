"""Forward wrappers for capture points (see ``qwen3.py`` and docs/hooked-qwen3.md).

Each factory takes what its capture point needs and returns ``make(original) -> forward``;
:func:`wrap` installs the result as the module *instance's* ``forward``, shadowing the
class's. ``nn.Module.__call__`` finds it, and so does every other holder of the same module
object (SGLang's ``LayerCommunicator`` keeps references to the layer norms it calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from dmi_sglang.tensor_ports import Capturer

__all__ = ["GLOBAL_LAYER", "Patch", "wrap"]

GLOBAL_LAYER = -1
"""``layer_no`` of global hooks (token_ids, embed, resid_final, final_ln, final_logits)."""

Forward = Callable[..., Any]
Make = Callable[[Forward], Forward]

_ROPE_TAPPED = "_dmi_rope_tapped"


@attrs.frozen
class Patch:
    """One wrapped module and the instance-level ``forward`` it had before (or None)."""

    module: nn.Module
    previous: Any

    def undo(self) -> None:
        """Restore the previous ``forward``."""
        if self.previous is None:
            del self.module.forward
        else:
            object.__setattr__(self.module, "forward", self.previous)


def wrap(patches: list[Patch], module: nn.Module, make: Make) -> None:
    """Replace ``module.forward`` (instance attribute) by ``make(current forward)``."""
    previous = module.__dict__.get("forward")
    object.__setattr__(module, "forward", make(module.forward))
    patches.append(Patch(module, previous))


def emit(c: Capturer, hook: str, layer: int, tensor: torch.Tensor) -> None:
    """Hand ``tensor`` to the capturer unless it has no rows (IDLE batches)."""
    if tensor.shape[0]:
        c.capture(hook, layer, tensor)


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    """A call argument given positionally or by keyword (None when absent)."""
    return args[index] if len(args) > index else kwargs.get(name)


def entry(c: Capturer) -> Make:
    """token_ids: the model's ``input_ids`` argument, at its forward's entry."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            ids = arg(args, kwargs, 0, "input_ids")
            if ids is not None:
                emit(c, "token_ids", GLOBAL_LAYER, ids)
            return original(*args, **kwargs)

        return forward

    return make


def join_before(c: Capturer) -> Make:
    """A module that changes the residual stream in place (the next fused norm after a
    residual-stream capture): the capturer's join first."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            c.join()
            return original(*args, **kwargs)

        return forward

    return make


def join_after(c: Capturer) -> Make:
    """The model's forward: the capturer's join once it returned or raised (still inside
    a decode graph's capture, which must end with the capturer's second stream joined;
    a forward that raised keeps its own error)."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                out = original(*args, **kwargs)
            except BaseException:
                with contextlib.suppress(Exception):
                    c.join()
                raise
            c.join()
            return out

        return forward

    return make


def after(c: Capturer, hook: str, layer: int) -> Make:
    """The output (the first element of a linear layer's ``(output, bias)`` tuple)."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            emit(c, hook, layer, out[0] if isinstance(out, tuple) else out)
            return out

        return forward

    return make


def norm(c: Capturer, layer: int, *, resid: str | None, normed: str | None) -> Make:
    """An RMSNorm called as ``norm(x)`` or fused as ``norm(x, residual, ...)``.

    Unfused, the residual stream is the input ``x`` (captured before the call). Fused, it
    is the returned second output, ``x + residual`` (computed in place on CUDA).
    """

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            fused = arg(args, kwargs, 1, "residual") is not None
            if resid is not None and not fused:
                emit(c, resid, layer, arg(args, kwargs, 0, "x"))
            out = original(*args, **kwargs)
            if resid is not None and fused:
                emit(c, resid, layer, out[1])
            if normed is not None:
                emit(c, normed, layer, out[0] if isinstance(out, tuple) else out)
            return out

        return forward

    return make


@attrs.define
class QKTap:
    """Armed by a layer's attention wrapper while its forward runs (see :func:`tap_rope`)."""

    capturer: Capturer
    layer: int
    heads: int
    kv_heads: int
    head_dim: int
    want_q: bool
    want_k: bool


# SGLang caches RotaryEmbedding process-wide (rotary_embedding/factory.py): one instance
# serves every layer, so its wrapper reads the layer from the innermost armed tap.
_armed: list[QKTap] = []


def arm(tap: QKTap) -> Make:
    """The layer's ``Qwen3Attention``: arm ``tap`` for the duration of its forward."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            _armed.append(tap)
            try:
                return original(*args, **kwargs)
            finally:
                _armed.pop()

        return forward

    return make


def tap_rope(rope: nn.Module) -> None:
    """Wrap a RotaryEmbedding once: q and k as passed to it, i.e. after q/k-norm.

    Inert (one list check) when no attention wrapper is armed, so other users of the
    shared instance are unaffected.
    """
    if getattr(rope, _ROPE_TAPPED, False):
        return
    original: Forward = rope.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if _armed:
            tap = _armed[-1]
            # RoPE rotates q and k in place on CUDA, after these calls: the capturer's
            # copy (queued before it returns, on the same stream) precedes the rotation.
            if tap.want_q:
                q = heads(arg(args, kwargs, 1, "query"), tap.heads, tap.head_dim)
                emit(tap.capturer, "q", tap.layer, q)
            if tap.want_k:
                k = heads(arg(args, kwargs, 2, "key"), tap.kv_heads, tap.head_dim)
                emit(tap.capturer, "k", tap.layer, k)
        return original(*args, **kwargs)

    object.__setattr__(rope, "forward", forward)
    object.__setattr__(rope, _ROPE_TAPPED, True)


def heads(t: torch.Tensor, n: int, head_dim: int) -> torch.Tensor:
    """``[T, n*head_dim]`` (possibly a strided view of qkv) as ``[T, n, head_dim]``."""
    return t.reshape(t.shape[0], n, head_dim)


def radix(c: Capturer, layer: int, *, kv: tuple[int, int] | None, z: bool) -> Make:
    """RadixAttention: v is its third input (``kv = (kv_heads, head_dim)``), z its output."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if kv is not None:
                v = arg(args, kwargs, 2, "v")
                if v is not None:
                    emit(c, "v", layer, heads(v, kv[0], kv[1]))
            out = original(*args, **kwargs)
            if z:
                attn = out[0] if isinstance(out, tuple) else out
                emit(c, "z", layer, attn.reshape(attn.shape[0], -1))
            return out

        return forward

    return make


def mlp(c: Capturer, layer: int, *, want_in: bool, want_out: bool) -> Make:
    """The MLP block: mlp_in is its input, mlp_out its output."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if want_in:
                emit(c, "mlp_in", layer, arg(args, kwargs, 0, "x"))
            out = original(*args, **kwargs)
            if want_out:
                emit(c, "mlp_out", layer, out)
            return out

        return forward

    return make


def logits(c: Capturer) -> Make:
    """The logits processor: ``next_token_logits`` of its output."""

    def make(original: Forward) -> Forward:
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            rows = getattr(out, "next_token_logits", None)
            if rows is not None:
                # The sampler divides and soft-maxes these logits in place later: the
                # capturer's copy, queued before emit returns, comes first.
                emit(c, "final_logits", GLOBAL_LAYER, rows)
            return out

        return forward

    return make
