"""Tensor-parallel plans: every part stored exactly once, settings that round-trip, and
clear refusals."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmi_sglang.domain.hooks import CATALOG, Hook, hook_by_name
from dmi_sglang.domain.records import RunInfo
from dmi_sglang.domain.tensor_parallel import (
    PARTIAL_CANDIDATES,
    TP_KEY,
    ShardPlan,
    TensorParallel,
    TpRule,
)
from dmi_sglang.errors import StoreError


@st.composite
def layouts(draw: st.DrawFn) -> TensorParallel:
    """A TP size and KV head count SGLang can split, and some partial hooks."""
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32) if d % tp == 0 or tp % d == 0]))
    partial = draw(st.frozensets(st.sampled_from(sorted(PARTIAL_CANDIDATES))))
    return TensorParallel(tp, kv, partial)


@given(layouts(), st.sampled_from(CATALOG))
def test_every_part_is_stored_by_exactly_one_rank(tp: TensorParallel, hook: Hook) -> None:
    plan = tp.plan(hook)
    stores = [plan.shard_of(rank) for rank in range(tp.tp_size)]
    kept = [s for s in stores if s is not None]
    assert sorted(kept) == list(range(plan.parts))
    assert plan.parts * plan.replicas == tp.tp_size or plan.rule is TpRule.REPLICATED


@given(layouts(), st.sampled_from(CATALOG))
def test_each_hook_gets_its_rule(tp: TensorParallel, h: Hook) -> None:
    plan = tp.plan(h)
    if tp.tp_size == 1:
        assert plan == ShardPlan(TpRule.REPLICATED, 1)
    elif h.name in tp.partial:
        assert (plan.rule, plan.parts) == (TpRule.PARTIAL, tp.tp_size)
    elif h.tp_sharded:
        kv_split = h.name in {"k", "v"} and tp.kv_heads < tp.tp_size
        assert (plan.rule, plan.parts) == (
            TpRule.SHARDED, tp.kv_heads if kv_split else tp.tp_size)
    else:
        assert (plan.rule, plan.parts, plan.shard_of(0)) == (TpRule.REPLICATED, 1, 0)
    assert tp.plan_for_act(h.act_name) == plan


def test_kv_heads_fewer_than_ranks_are_stored_by_the_first_rank_of_each_group() -> None:
    plan = TensorParallel(8, 2).plan(hook_by_name("v"))
    assert [plan.shard_of(r) for r in range(8)] == [0, None, None, None, 1, None, None, None]
    assert TensorParallel(8, 2).plan(hook_by_name("q")).shard_of(5) == 5


@given(layouts())
def test_the_setting_round_trips(tp: TensorParallel) -> None:
    assert TensorParallel.from_setting(tp.to_setting()) == tp
    run = RunInfo("r", "/m", ((TP_KEY, tp.to_setting()),), (), "t")
    assert run.tensor_parallel == tp


def test_a_run_without_the_setting_is_tp1() -> None:
    tp = RunInfo("r", "/m", (), (), "t").tensor_parallel
    assert tp == TensorParallel.single()
    assert all(tp.plan(h) == ShardPlan(TpRule.REPLICATED, 1) for h in CATALOG)


@pytest.mark.parametrize("text", ["", "tp=2", "tp=2;kv_heads=8", "tp=x;kv_heads=8;partial=",
                                  "tp=2;kv_heads=8;partial=;tp=2", "tp=2;kv=8;partial=",
                                  "tp=\u00b2;kv_heads=8;partial=", "tp=2;kv_heads=3;partial=",
                                  "tp=2;kv_heads=8;partial=q", "tp=0;kv_heads=8;partial="])
def test_a_damaged_setting_is_refused_with_the_text(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{TP_KEY}={text!r}")):
        TensorParallel.from_setting(text)
    if text:
        run = RunInfo("run-9", "/m", ((TP_KEY, text),), (), "t")
        with pytest.raises(StoreError, match=re.escape(f"run 'run-9': {TP_KEY}={text!r}")):
            _ = run.tensor_parallel


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"tp_size": 0, "kv_heads": 1}, "tp_size=0"), ({"tp_size": 2, "kv_heads": -1}, "kv_heads=-1"),
    ({"tp_size": True, "kv_heads": 1}, "tp_size=True"),
    ({"tp_size": 4, "kv_heads": 6}, "kv_heads=6 over tp_size=4"),
    ({"tp_size": 2, "kv_heads": 2, "partial": frozenset({"mlp_post"})}, "'mlp_post'"),
    ({"tp_size": 2, "kv_heads": 2, "partial": frozenset({"resid_pre"})}, "'resid_pre'"),
    ({"tp_size": 2, "kv_heads": 2, "partial": frozenset({"token_ids"})}, "'token_ids'"),
    ({"tp_size": 2, "kv_heads": 2, "partial": "attn_out"}, "partial='attn_out'"),
])
def test_a_layout_sglang_cannot_have_is_refused(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        TensorParallel(**kwargs)  # type: ignore[arg-type]


@given(layouts(), st.sampled_from(CATALOG))
def test_a_rank_beyond_the_runs_ranks_is_refused_not_told_to_store_nothing(
        tp: TensorParallel, hook: Hook) -> None:
    """None means "a replica another rank stores": a rank the run does not have (a global
    rank, another run's tp_size) would drop its part silently."""
    with pytest.raises(ValueError, match=f"rank={tp.tp_size}"):
        tp.plan(hook).shard_of(tp.tp_size)


def test_an_unknown_act_is_one_part_every_rank_holds() -> None:
    plan = TensorParallel(4, 4).plan_for_act("not_a_hook")
    assert [plan.shard_of(r) for r in range(4)] == [0, None, None, None]


@pytest.mark.parametrize(("make", "named"), [
    (lambda: ShardPlan(TpRule.SHARDED, 0), "parts=0"),
    (lambda: ShardPlan(TpRule.SHARDED, 2, replicas=0), "replicas=0"),
    (lambda: ShardPlan(TpRule.SHARDED, 2).shard_of(-1), "rank=-1"),
])
def test_a_plan_refuses_counts_and_ranks_below_range(make: object, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        make()  # type: ignore[operator]
