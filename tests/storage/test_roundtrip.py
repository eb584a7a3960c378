"""Bit-exact round trips: tensors in, the same bits out, for every stored dtype."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.domain.store_config import StoreConfig

from ._support import batch_of, commit, handle, manifest, run_info, same_bits

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64)
# Hooks whose rows take each dtype in SGLang: activations, logits, token ids.
HOOK_FOR = {
    torch.bfloat16: ("blocks.hook_ln1", 2),
    torch.float16: ("blocks.hook_mlp_out", 0),
    torch.float32: ("hook_final_ln", -1),
    torch.int32: ("blocks.attn.hook_q", 1),
    torch.int64: ("token_ids", -1),
}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included for floats)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = torch.Size(shape).numel()
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return bits.view(dtype).reshape(shape)


def _roundtrip(
    sink: ClickHouseSink,
    store: StoreConfig,
    run_id: str,
    dtype: torch.dtype,
    trailing: tuple[int, ...],
    bounds: list[int],
    seed: int,
) -> None:
    act, layer = HOOK_FOR[dtype]
    total = bounds[-1]
    t = random_tensor(dtype, (total, *trailing), seed)
    run = run_info(run_id, [(act, layer)])
    sink.start_run(run)
    sink.put(batch_of(run_id, "req", act, layer, t, bounds))
    # token-row hook, no overlap: coverage [0, prompt + completion - 1) = [0, total)
    commit(sink, run, [manifest(run_id, "req", prompt=total, completion=1)])
    h = handle(store, run_id, "req")
    assert h.available, h.missing
    out = h.get(act, layer if layer >= 0 else None)
    assert same_bits(out, t)
    out[0] = out[0]  # writable, owns its memory
    stored = ClickHouseReader(store).records(run_id, "req")
    assert [r.dtype for r in stored] == [str(dtype)] * (len(bounds) - 1)
    assert [r.shape for r in stored] == [(b - a, *trailing) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_several_shapes_round_trip(
    dtype: torch.dtype, open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    shapes: list[tuple[tuple[int, ...], list[int]]] = [
        ((), [0, 1]),  # one scalar row
        ((16,), [0, 5, 6, 7]),  # prefill chunk then decode rows
        ((3, 8), [0, 2, 9]),
        ((2, 3, 4), [0, 4]),
    ]
    for k, (trailing, bounds) in enumerate(shapes):
        _roundtrip(sink, store, f"run-{k}", dtype, trailing, bounds, seed=k)


@pytest.fixture
def sink(open_sink: Callable[..., ClickHouseSink]) -> ClickHouseSink:
    """One sink for the whole test (hypothesis runs every example in one test call)."""
    return open_sink()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    dtype=st.sampled_from(DTYPES),
    trailing=st.lists(st.integers(1, 6), max_size=3).map(tuple),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_dtypes_and_chunkings_round_trip(
    sink: ClickHouseSink,
    store: StoreConfig,
    dtype: torch.dtype,
    trailing: tuple[int, ...],
    cuts: list[int],
    seed: int,
) -> None:
    bounds = [0, *itertools.accumulate(cuts)]
    run_id = f"run-{uuid.uuid4().hex}"  # examples share the store: never reuse a run
    _roundtrip(sink, store, run_id, dtype, trailing, bounds, seed)
