"""The tensor-parallel plans against SGLang 0.5.19's own parallel layers on CPU.

Each rank's layer is built with SGLang's ``tp_rank`` / ``tp_size`` and loaded through its
own ``weight_loader`` from the whole weights, so what a rank computes is what SGLang's
split gives it, not a split this project wrote. The rank tensors are stored as the plan
says (``shard_of``) and combined as the reader combines them; the result must be what
the whole layer computes: q, k, v from ``QKVParallelLinear`` (KV heads fewer than,
equal to and more than the ranks), mlp_post from ``MergedColumnParallelLinear`` and
SGLang's SiluAndMul, attn_out from ``RowParallelLinear(reduce_results=False)`` as
Qwen3's ``o_proj`` is built.
"""

from __future__ import annotations

import pytest
import torch

from dmi_sglang.app.shards import combine
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.tensor_parallel import TensorParallel

pytestmark = pytest.mark.sglang

TOKENS, HIDDEN, HEAD_DIM, INTERMEDIATE = 3, 16, 4, 24


def stored_parts(tp: TensorParallel, name: str,
                 per_rank: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the ranks store of ``name`` (the plan's parts, in shard_rank order)."""
    plan = tp.plan(hook_by_name(name))
    parts: dict[int, torch.Tensor] = {}
    for rank, tensor in enumerate(per_rank):
        shard = plan.shard_of(rank)
        if shard is not None:
            parts[shard] = tensor
    assert sorted(parts) == list(range(plan.parts))
    return [parts[k] for k in range(plan.parts)]


@pytest.mark.parametrize(("heads", "kv_heads", "ranks"),
                         [(8, 2, 4), (8, 4, 2), (8, 1, 8), (8, 8, 8), (4, 2, 1)])
def test_q_k_v_parts_of_sglangs_qkv_projection_make_the_whole(heads: int, kv_heads: int,
                                                               ranks: int) -> None:
    from sglang.srt.layers.linear import QKVParallelLinear

    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + ranks)
    weights = {"q": torch.randn(heads * HEAD_DIM, HIDDEN, generator=g),
               "k": torch.randn(kv_heads * HEAD_DIM, HIDDEN, generator=g),
               "v": torch.randn(kv_heads * HEAD_DIM, HIDDEN, generator=g)}
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    per_rank: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": []}
    for rank in range(ranks):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, bias=False,
                                  tp_rank=rank, tp_size=ranks, params_dtype=torch.float32)
        for shard_id, w in weights.items():
            layer.weight_loader(layer.weight, w, shard_id)
        q, k, v = (x @ layer.weight.data.T).split(
            [layer.num_heads * HEAD_DIM, layer.num_kv_heads * HEAD_DIM,
             layer.num_kv_heads * HEAD_DIM], dim=-1)
        for name, t in (("q", q), ("k", k), ("v", v)):  # stored as [T, heads, head_dim]
            per_rank[name].append(t.reshape(TOKENS, -1, HEAD_DIM))
    tp = TensorParallel(ranks, kv_heads)
    for name, count in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        plan = tp.plan(hook_by_name(name))
        got = combine(plan, stored_parts(tp, name, per_rank[name]), name)
        want = (x @ weights[name].T).reshape(TOKENS, count, HEAD_DIM)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_mlp_post_parts_of_sglangs_gate_up_projection_make_the_whole(ranks: int) -> None:
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    g = torch.Generator().manual_seed(ranks)
    gate = torch.randn(INTERMEDIATE, HIDDEN, generator=g)
    up = torch.randn(INTERMEDIATE, HIDDEN, generator=g)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    per_rank = []
    for rank in range(ranks):
        layer = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False,
                                           tp_rank=rank, tp_size=ranks,
                                           params_dtype=torch.float32)
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        per_rank.append(SiluAndMul().forward_native(x @ layer.weight.data.T))
    tp = TensorParallel(ranks, ranks)
    got = combine(tp.plan(hook_by_name("mlp_post")), stored_parts(tp, "mlp_post", per_rank),
                  "mlp_post")
    want = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_attn_out_parts_of_a_row_parallel_o_proj_sum_to_the_whole(ranks: int) -> None:
    from sglang.srt.layers.linear import RowParallelLinear

    g = torch.Generator().manual_seed(ranks)
    heads = 8
    weight = torch.randn(HIDDEN, heads * HEAD_DIM, generator=g)
    z = torch.randn(TOKENS, heads * HEAD_DIM, generator=g)  # the whole attention output
    width = heads * HEAD_DIM // ranks
    per_rank = []
    for rank in range(ranks):
        layer = RowParallelLinear(heads * HEAD_DIM, HIDDEN, bias=False, tp_rank=rank,
                                  tp_size=ranks, reduce_results=False,
                                  params_dtype=torch.float32)
        layer.weight_loader(layer.weight, weight)
        z_rank = heads_of_rank(z, rank, width)  # rank r's heads, as q was split
        per_rank.append(z_rank @ layer.weight.data.T)
    tp = TensorParallel(ranks, ranks, frozenset({"attn_out"}))
    got = combine(tp.plan(hook_by_name("attn_out")), stored_parts(tp, "attn_out", per_rank),
                  "attn_out")
    torch.testing.assert_close(got, z @ weight.T, rtol=1e-4, atol=1e-4)


def heads_of_rank(z: torch.Tensor, rank: int, width: int) -> torch.Tensor:
    """Rank ``rank``'s columns of the attention output (its heads, in rank order)."""
    return z[:, rank * width : (rank + 1) * width]
