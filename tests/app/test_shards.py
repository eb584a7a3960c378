"""The reader's combine: parts made the way SGLang splits a tensor over ranks, stored as
the plan says, come back as the whole tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmi_sglang.app.shards import combine
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.tensor_parallel import ShardPlan, TensorParallel, TpRule
from dmi_sglang.errors import StoreError

HEAD_DIM = 2


def rank_tensors(name: str, whole: torch.Tensor, tp: TensorParallel) -> list[torch.Tensor]:
    """Each rank's tensor of ``whole``, as SGLang 0.5.19 splits it (the oracle)."""
    n = tp.tp_size
    if name in tp.partial:  # partial sums of integer values: exact in any order
        shares = [torch.full_like(whole, float(r + 1)) for r in range(1, n)]
        return [whole - sum(shares, torch.zeros_like(whole)), *shares]
    if name in {"k", "v"} and tp.kv_heads < n:
        replicas = n // tp.kv_heads
        return [whole[:, r // replicas : r // replicas + 1] for r in range(n)]
    if name in {"q", "k", "v", "z", "mlp_post"}:
        return list(whole.chunk(n, dim=1))
    return [whole] * n


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, TensorParallel, torch.Tensor]:
    n = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if d % n == 0 or n % d == 0]))
    name = draw(st.sampled_from(["resid_pre", "attn_out", "mlp_out", "q", "k", "v", "z",
                                 "mlp_post"]))
    partial = frozenset(draw(st.sets(st.sampled_from(["attn_out", "mlp_out"]))))
    tp = TensorParallel(n, kv, partial)
    rows = draw(st.integers(1, 5))
    heads = n * draw(st.integers(1, 3))
    shape = {"q": (rows, heads, HEAD_DIM), "k": (rows, kv, HEAD_DIM),
             "v": (rows, kv, HEAD_DIM), "z": (rows, heads * HEAD_DIM)}.get(name, (rows, 4 * n))
    seed = draw(st.integers(0, 2**31 - 1))
    whole = torch.randint(-99, 99, shape, generator=torch.Generator().manual_seed(seed))
    return name, tp, whole.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))


@settings(max_examples=200, deadline=None)
@given(cases())
def test_the_stored_parts_combine_to_the_whole(case: tuple[str, TensorParallel,
                                                           torch.Tensor]) -> None:
    name, tp, whole = case
    plan = tp.plan(hook_by_name(name))
    held = rank_tensors(name, whole, tp)
    parts: dict[int, torch.Tensor] = {}
    for rank, tensor in enumerate(held):
        shard = plan.shard_of(rank)
        if shard is not None:
            assert shard not in parts
            parts[shard] = tensor.clone()
    got = combine(plan, [parts[k] for k in range(plan.parts)], name)
    assert got.dtype == whole.dtype
    assert torch.equal(got, whole)


def test_a_partial_sum_is_added_in_float32_and_cast_back() -> None:
    plan = ShardPlan(TpRule.PARTIAL, 2)
    a = torch.tensor([[256.0]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0]], dtype=torch.bfloat16)
    # in bf16, ((256 + 1) + 1) rounds to 256 at each step; in float32 it is 258
    assert combine(ShardPlan(TpRule.PARTIAL, 3), [a, b, b], "x").item() == 258.0
    assert combine(plan, [a, b], "x").dtype == torch.bfloat16


@pytest.mark.parametrize(("plan", "parts", "message"), [
    (ShardPlan(TpRule.SHARDED, 2), [torch.zeros(2, 3)], "1 part.s. where the run stores 2"),
    (ShardPlan(TpRule.SHARDED, 2), [torch.zeros(2, 3), torch.zeros(3, 3)], "do not combine"),
    (ShardPlan(TpRule.SHARDED, 2), [torch.zeros(2, 3, 2), torch.zeros(2, 1, 2)],
     "do not combine"),  # SGLang splits evenly: unequal parts are a damaged store
    (ShardPlan(TpRule.SHARDED, 2), [torch.zeros(2), torch.zeros(2)], "do not combine"),
    (ShardPlan(TpRule.PARTIAL, 2), [torch.zeros(2, 3), torch.zeros(2, 4)], "do not combine"),
    (ShardPlan(TpRule.PARTIAL, 2), [torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)],
     "do not combine"),
    (ShardPlan(TpRule.PARTIAL, 2), [torch.zeros(2, dtype=torch.int32)] * 2, "floating point"),
])
def test_parts_that_cannot_combine_are_a_damaged_store(plan: ShardPlan,
                                                       parts: list[torch.Tensor],
                                                       message: str) -> None:
    with pytest.raises(StoreError, match=message):
        combine(plan, parts, "blocks.attn.hook_q layer 3")
