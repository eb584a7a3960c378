"""Element types and the row shape of every hook for a model.

The dtype strings are the ``str()`` of the torch dtype (``torch.bfloat16``), as DMI stores
them; readers also accept the short aliases (``torch.half``, ``torch.float``, ...).
"""

from __future__ import annotations

import enum
import math

import attrs

from dmi_sglang.domain.hooks import Hook, Selection
from dmi_sglang.domain.payloads import Payload, StorageDType
from dmi_sglang.errors import ConfigurationError

__all__ = ["DType", "ModelShape", "RowSpec"]


class DType(enum.Enum):
    """Element types a capture can hold, valued by their stored name."""

    BFLOAT16 = "torch.bfloat16"
    FLOAT16 = "torch.float16"
    FLOAT32 = "torch.float32"
    FLOAT64 = "torch.float64"
    INT8 = "torch.int8"
    UINT8 = "torch.uint8"
    INT16 = "torch.int16"
    INT32 = "torch.int32"
    INT64 = "torch.int64"
    BOOL = "torch.bool"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, text: str) -> DType:
        """A dtype from its stored name or a torch alias (``torch.half``, ``bfloat16``).

        Raises:
            ConfigurationError: unknown name; the message lists the accepted ones.
        """
        key = text if text.startswith("torch.") else f"torch.{text}"
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            accepted = ", ".join(d.value for d in cls)
            msg = f"unknown dtype {text!r}; accepted: {accepted}"
            raise ConfigurationError(msg) from None


_ITEMSIZE = {
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.INT8: 1,
    DType.UINT8: 1,
    DType.INT16: 2,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.BOOL: 1,
}

_ALIASES = {
    "torch.half": "torch.float16",
    "torch.float": "torch.float32",
    "torch.double": "torch.float64",
    "torch.short": "torch.int16",
    "torch.int": "torch.int32",
    "torch.long": "torch.int64",
}


@attrs.frozen
class RowSpec:
    """The shape of one row of a hook's tensor: trailing dims and dtype."""

    dims: tuple[int, ...]
    dtype: DType

    @property
    def nbytes(self) -> int:
        """Bytes per row."""
        return math.prod(self.dims) * self.dtype.itemsize


@attrs.frozen
class ModelShape:
    """The sizes of a decoder-only model that determine every hook's row shape.

    Attributes:
        num_layers: decoder layers.
        hidden: residual stream width.
        heads / kv_heads / head_dim: attention geometry (per TP rank at TP=1).
        intermediate: MLP width (0 for none).
        vocab: logits width.
        activation_dtype: dtype of the residual stream and activations.
        logits_dtype: dtype of ``next_token_logits`` (float32 in SGLang).
        token_dtype: dtype of input ids (int64 in SGLang).
    """

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    activation_dtype: DType = DType.BFLOAT16
    logits_dtype: DType = DType.FLOAT32
    token_dtype: DType = DType.INT64

    def capture_row(self, selection: Selection, hook: Hook, layer_no: int) -> RowSpec:
        """Row shape of one capture of ``selection`` as stored (its payload applied)."""
        return self.row(hook, selection.payload_of(hook.name, layer_no))

    def row(self, hook: Hook, payload: Payload | None = None) -> RowSpec:
        """Row shape of ``hook`` for this model, stored with ``payload`` (default: as
        computed).

        Raises:
            ConfigurationError: the hook has no fixed row shape here (attention matrices,
                MoE routing hooks on a dense model), or ``topk(K)`` with ``K`` beyond the
                vocabulary.
        """
        computed = self._computed(hook, payload or _AS_COMPUTED)
        if payload is None or payload.dtype is None or hook.is_integer:
            return computed
        return RowSpec(computed.dims, _STORED[payload.dtype])

    def _computed(self, hook: Hook, payload: Payload) -> RowSpec:
        if hook.derived:
            if not 1 <= payload.topk <= self.vocab:
                msg = (f"{hook.name}: topk({payload.topk}) needs 1 <= K <= the vocabulary "
                       f"({self.vocab})")
                raise ConfigurationError(msg)
            dtype = DType.INT32 if hook.is_integer else self.logits_dtype
            return RowSpec((payload.topk,), dtype)
        act = self.activation_dtype
        match hook.name:
            case (
                "resid_pre" | "ln1" | "attn_out" | "resid_mid" | "ln2" | "mlp_in" | "mlp_out"
                | "resid_final" | "embed" | "pos_embed" | "final_ln"
            ):
                return RowSpec((self.hidden,), act)
            case "q":
                return RowSpec((self.heads, self.head_dim), act)
            case "k" | "v":
                return RowSpec((self.kv_heads, self.head_dim), act)
            case "z":
                return RowSpec((self.heads * self.head_dim,), act)
            case "mlp_post" if self.intermediate > 0:
                return RowSpec((self.intermediate,), act)
            case "token_ids":
                return RowSpec((), self.token_dtype)
            case "final_logits":
                return RowSpec((self.vocab,), self.logits_dtype)
            case _:
                msg = f"hook {hook.name!r} has no row shape for this model"
                raise ConfigurationError(msg)


_AS_COMPUTED = Payload()
_STORED = {StorageDType.BF16: DType.BFLOAT16, StorageDType.FP16: DType.FLOAT16}
