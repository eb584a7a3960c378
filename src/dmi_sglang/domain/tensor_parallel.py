"""Tensor parallelism as data: what each rank holds of a hook, what it stores, and how the
reader makes the whole tensor from the stored parts.

Under tensor parallelism (TP = ``tp_size`` ranks) a hook's tensor is, on each rank, one of:

* **replicated**: the whole tensor, the same on every rank (the residual stream, the
  norms, embeddings, token ids, logits after the vocabulary gather). Rank 0 stores it,
  as ``shard_rank`` 0; the other ranks store nothing.
* **sharded**: a slice of the axis after the row axis (q, k, v: heads; z: heads x
  head_dim; mlp_post: the intermediate features), in rank order. Every rank stores its
  slice as ``shard_rank = rank``; the reader concatenates the slices along that axis.
  When the model has fewer KV heads than ranks, SGLang replicates each KV head on
  ``tp_size // kv_heads`` consecutive ranks (rank ``r`` holds KV head
  ``r // replicas``): only the first rank of each group stores k and v, as
  ``shard_rank = r // replicas``, so k and v have ``kv_heads`` parts.
* **partial**: a partial sum; the whole tensor is the sum over ranks. Only the output of
  a row-parallel projection whose all-reduce happens later can be partial
  (:data:`PARTIAL_CANDIDATES`): SGLang 0.5.19 builds Qwen3's ``o_proj`` with
  ``reduce_results=False``, so ``attn_out`` captured at its output is partial on each
  rank; Qwen3's MLP (``Qwen2MLP``) all-reduces in ``down_proj``, so its ``mlp_out`` is
  replicated (models that fuse that all-reduce into the next norm would make it
  partial). Which hooks are partial is a fact of the model, stated by the adapter and
  recorded with the run (:data:`TP_KEY`); every rank stores its part as
  ``shard_rank = rank`` and the reader adds them, in rank order in float32 and cast back
  (not bit-identical to SGLang's own all-reduce in bf16).

The rules assume every rank holds every token row: layernorm sequence parallelism and
DP attention (which scatter rows over ranks) are refused by the support matrix.

At ``tp_size`` 1 every hook is replicated with one part, stored as ``shard_rank`` 0: a
TP=1 run reads exactly as before.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

import attrs

from dmi_sglang.domain.hooks import CATALOG, Hook

__all__ = ["PARTIAL_CANDIDATES", "TP_KEY", "ShardPlan", "TensorParallel", "TpRule"]

TP_KEY = "dmi.tensor_parallel"
"""The run setting that records its tensor parallelism (:meth:`TensorParallel.to_setting`);
absent for TP=1 runs."""

PARTIAL_CANDIDATES = frozenset({"attn_out", "mlp_out"})
"""The hooks that can hold partial sums: outputs of row-parallel projections."""
_KV = frozenset({"k", "v"})
_BY_ACT = {h.act_name: h for h in CATALOG}
_NUMBER = re.compile(r"[0-9]+")


class TpRule(enum.Enum):
    """How the ranks' tensors of one hook make up the whole tensor."""

    REPLICATED = "replicated"
    """Every rank holds the whole tensor: one part, stored by rank 0."""
    SHARDED = "sharded"
    """Each part is a slice along :attr:`ShardPlan.axis`, in part order: concatenate."""
    PARTIAL = "partial"
    """Each part is a partial sum: add them."""


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{attribute.name}={value!r}; accepted: a positive integer"
        raise ValueError(msg)


@attrs.frozen
class ShardPlan:
    """How one hook is stored and read back under tensor parallelism.

    Attributes:
        rule: how the parts combine.
        parts: how many parts are stored (``shard_rank`` 0 .. parts-1).
        replicas: consecutive ranks that hold the same part (the first stores it).

    Raises:
        ValueError: a count below 1.
    """

    rule: TpRule
    parts: int = attrs.field(validator=_positive)
    replicas: int = attrs.field(default=1, validator=_positive)

    axis = 1
    """The axis of the stored tensor (0 is rows) a sharded hook is split along: the first
    after the rows."""

    def shard_of(self, rank: int) -> int | None:
        """The ``shard_rank`` tensor-parallel rank ``rank`` stores this hook as; None when
        that rank stores nothing (a replica another rank stores).

        Raises:
            ValueError: a rank outside ``0 .. parts * replicas - 1`` (the run's ranks).
        """
        ranks = self.parts * self.replicas
        if not 0 <= rank < ranks:
            msg = f"rank={rank}; accepted: a rank from 0 to {ranks - 1}"
            raise ValueError(msg)
        return None if rank % self.replicas else rank // self.replicas


def _partial_names(values: Iterable[str]) -> frozenset[str]:
    if isinstance(values, str):  # a lone name would become its characters
        msg = f"partial={values!r}; accepted: a set of hook names"
        raise ValueError(msg)
    return frozenset(values)


@attrs.frozen
class TensorParallel:
    """A run's tensor parallelism: the rank count and the facts that decide each hook's
    :class:`ShardPlan`.

    Attributes:
        tp_size: tensor-parallel ranks.
        kv_heads: the model's KV heads (all ranks together).
        partial: short names of the hooks each rank holds a partial sum of (some of
            :data:`PARTIAL_CANDIDATES`).

    Raises:
        ValueError: a non-positive count, KV heads SGLang cannot split over ``tp_size``
            ranks (neither divides the other), or a partial hook that is not a
            row-parallel output.
    """

    tp_size: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    partial: frozenset[str] = attrs.field(default=frozenset(), converter=_partial_names)

    def __attrs_post_init__(self) -> None:
        tp, kv = self.tp_size, self.kv_heads
        if kv % tp and tp % kv:
            msg = (f"kv_heads={kv} over tp_size={tp}; accepted: KV heads divisible by the "
                   "ranks, or ranks divisible by the KV heads")
            raise ValueError(msg)
        bad = sorted(self.partial - PARTIAL_CANDIDATES)
        if bad:
            msg = (f"partial hooks {bad}; accepted: {', '.join(sorted(PARTIAL_CANDIDATES))} "
                   "(outputs of row-parallel projections)")
            raise ValueError(msg)

    @classmethod
    def single(cls) -> TensorParallel:
        """No tensor parallelism: one rank, every hook one part."""
        return cls(1, 1)

    def plan(self, hook: Hook) -> ShardPlan:
        """How ``hook`` is stored and read back."""
        if self.tp_size == 1:
            return ShardPlan(TpRule.REPLICATED, 1)
        if hook.name in self.partial:
            return ShardPlan(TpRule.PARTIAL, self.tp_size)
        if not hook.tp_sharded:
            return ShardPlan(TpRule.REPLICATED, 1, replicas=self.tp_size)
        if hook.name in _KV and self.kv_heads < self.tp_size:
            return ShardPlan(TpRule.SHARDED, self.kv_heads,
                             replicas=self.tp_size // self.kv_heads)
        return ShardPlan(TpRule.SHARDED, self.tp_size)

    def plan_for_act(self, act_name: str) -> ShardPlan:
        """:meth:`plan` of the hook stored under ``act_name`` (unknown names: one part,
        which every rank holds)."""
        hook = _BY_ACT.get(act_name)
        if hook is None:
            return ShardPlan(TpRule.REPLICATED, 1, replicas=self.tp_size)
        return self.plan(hook)

    def to_setting(self) -> str:
        """The :data:`TP_KEY` value: ``tp=2;kv_heads=8;partial=attn_out``."""
        return (f"tp={self.tp_size};kv_heads={self.kv_heads};"
                f"partial={','.join(sorted(self.partial))}")

    @classmethod
    def from_setting(cls, text: str) -> TensorParallel:
        """Parse :meth:`to_setting`'s text.

        Raises:
            ValueError: text that is not of that form (the message quotes it).
        """
        fields: dict[str, str] = {}
        for part in text.split(";"):
            key, sep, value = part.partition("=")
            if not sep or key in fields or key not in {"tp", "kv_heads", "partial"}:
                break
            fields[key] = value
        else:
            if fields.keys() == {"tp", "kv_heads", "partial"} and \
                    _NUMBER.fullmatch(fields["tp"]) and _NUMBER.fullmatch(fields["kv_heads"]):
                partial = [p for p in fields["partial"].split(",") if p]
                try:
                    return cls(int(fields["tp"]), int(fields["kv_heads"]), frozenset(partial))
                except ValueError as exc:
                    msg = f"{TP_KEY}={text!r}: {exc}"
                    raise ValueError(msg) from exc
        msg = (f"{TP_KEY}={text!r}; accepted: 'tp=N;kv_heads=N;partial=name,...' as "
               "TensorParallel.to_setting writes it")
        raise ValueError(msg)
