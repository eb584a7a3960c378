"""How a capture's rows are stored: the payload modifiers of the selection syntax.

A selection item may carry, after ``:``, besides a position rule
(:mod:`~dmi_sglang.domain.positions`):

===================  ===================================================================
``bf16`` / ``fp16``  a storage dtype for float hooks: the rows are cast on the device
                     before they are copied to the host (a smaller copy, a smaller
                     store); the ``dtype`` column records it. ``fp16`` saturates values
                     beyond +-65504 to infinity: the transport counts such values
                     (``fp16_overflows``). Integer hooks keep their type.
``topk(K)``          ``final_logits`` only: instead of the full vocabulary row, the ``K``
                     largest logits of each row, highest first, as two captures:
                     ``logits_topk_values`` (float32, or the item's storage dtype) and
                     ``logits_topk_ids`` (int32 token ids), ``K`` values per row.
===================  ===================================================================

fp8 is not offered: Qwen's residual stream exceeds e4m3's range, so it would need a
stored per-row scale, which DMI's columns have no place for.
"""

from __future__ import annotations

import enum
import re

import attrs

from dmi_sglang.errors import SelectionError

__all__ = ["TOPK_HOOKS", "Payload", "StorageDType", "is_payload_modifier"]


class StorageDType(enum.Enum):
    """A float dtype rows may be cast to before they leave the device."""

    BF16 = "bf16"
    FP16 = "fp16"


TOPK_HOOKS = ("logits_topk_values", "logits_topk_ids")
"""The captures ``final_logits:topk(K)`` makes (values first, as the model emits them)."""

_TOPK = re.compile(r"^topk\(([0-9]+)\)$")  # ASCII digits, as layers and positions
_REFUSED = {"fp8", "e4m3", "fp8_e4m3", "e5m2", "fp8_e5m2"}
ACCEPTED = "bf16, fp16, topk(K) (final_logits only)"
"""The payload modifiers the selection syntax accepts, as error messages name them."""


def is_payload_modifier(text: str) -> bool:
    """True when ``text`` (one ``:`` part of an item) is meant as a payload modifier."""
    name = text.strip()
    return (name in {d.value for d in StorageDType} or name in _REFUSED
            or name.startswith("topk"))


@attrs.frozen
class Payload:
    """How the rows of one capture are stored.

    Attributes:
        dtype: the storage dtype of a float hook, None for the dtype the model computes.
        topk: ``K`` of ``topk(K)`` (``final_logits`` only), 0 for the full row.
    """

    dtype: StorageDType | None = None
    topk: int = 0

    @property
    def is_default(self) -> bool:
        """True when rows are stored as the model computes them."""
        return self.dtype is None and self.topk == 0

    def __str__(self) -> str:
        parts = [f"topk({self.topk})"] if self.topk else []
        if self.dtype is not None:
            parts.append(self.dtype.value)
        return ":".join(parts)

    def with_modifier(self, text: str, token: str = "") -> Payload:
        """This payload with one more modifier (``token``: the item, for the message).

        Raises:
            SelectionError: an unknown or repeated modifier, ``topk(0)``, or fp8.
        """
        where = f" in {token!r}" if token else ""
        name = text.strip()
        if name in _REFUSED:
            msg = (f"{name!r}{where}: fp8 storage is not offered (Qwen's residual stream "
                   f"exceeds e4m3's range and DMI's columns hold no per-row scale); "
                   f"accepted: {ACCEPTED}")
            raise SelectionError(msg)
        match = _TOPK.match(name)
        if match is not None:
            k = int(match.group(1))
            if k < 1:
                msg = f"topk({k}){where}: K must be at least 1"
                raise SelectionError(msg)
            if self.topk:
                msg = f"two topk modifiers{where}; give one"
                raise SelectionError(msg)
            return attrs.evolve(self, topk=k)
        try:
            dtype = StorageDType(name)
        except ValueError:
            msg = f"unknown payload modifier {name!r}{where}; accepted: {ACCEPTED}"
            raise SelectionError(msg) from None
        if self.dtype is not None:
            msg = f"two storage dtypes{where}; give one"
            raise SelectionError(msg)
        return attrs.evolve(self, dtype=dtype)
