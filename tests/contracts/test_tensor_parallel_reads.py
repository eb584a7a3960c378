"""A TP=2 run read back on every store backend: the handle and the export return the
whole tensors (the shapes a TP=1 run has), and a missing or stray part is reported.

The parts are made from known whole tensors the way SGLang 0.5.19 splits them over two
ranks (q: heads in rank order; k with one KV head: the same head on both ranks;
attn_out at ``o_proj`` with ``reduce_results=False``: partial sums; resid_pre: the same on
both), and stored the way the capture path stores a rank's tensors (the run's plan says
which rank stores which ``shard_rank``).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from safetensors.torch import load as load_safetensors

from dmi_sglang.app.export import StoreReads
from dmi_sglang.app.handle import CaptureHandle
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.tensor_parallel import TP_KEY, TensorParallel
from dmi_sglang.errors import IncompleteCaptureError, StoreError

from .conftest import Backend

RUN = "tp-run"
TP = TensorParallel(tp_size=2, kv_heads=1, partial=frozenset({"attn_out"}))
HOOKS = ("resid_pre", "q", "k", "attn_out")
PROMPT, COMPLETION = 3, 2
POSITIONS = PROMPT + COMPLETION - 1
FORWARDS = ((0, PROMPT), (PROMPT, POSITIONS))  # a prefill, then one decode step
HIDDEN, Q_HEADS, HEAD_DIM = 6, 4, 2


def whole_tensors() -> dict[str, torch.Tensor]:
    """Each hook's whole tensor (layer 0), integer-valued so partial sums are exact."""
    g = torch.Generator().manual_seed(7)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-50, 50, shape, generator=g).to(torch.float32)

    return {"resid_pre": ints(POSITIONS, HIDDEN), "q": ints(POSITIONS, Q_HEADS, HEAD_DIM),
            "k": ints(POSITIONS, TP.kv_heads, HEAD_DIM), "attn_out": ints(POSITIONS, HIDDEN)}


def on_rank(name: str, whole: torch.Tensor, rank: int) -> torch.Tensor:
    """What tensor-parallel rank ``rank`` holds of ``whole``, as SGLang splits it."""
    if name == "q":
        per = Q_HEADS // TP.tp_size
        return whole[:, rank * per : (rank + 1) * per]
    if name == "k":  # fewer KV heads than ranks: rank r holds head r // (tp // kv)
        head = rank // (TP.tp_size // TP.kv_heads)
        return whole[:, head : head + 1]
    if name == "attn_out":  # partial sums: rank 0 holds the rest of rank 1's share
        share = torch.arange(whole.numel(), dtype=torch.float32).reshape(whole.shape) % 5
        return share if rank == 1 else whole - share
    return whole


def stored(wholes: dict[str, torch.Tensor], *, drop: tuple[str, int] | None = None,
           stray: bool = False) -> list[RecordBatch]:
    """Each rank's records, one batch per rank and forward (a batch is one shard_rank)."""
    batches = []
    for rank in range(TP.tp_size):
        for seq, (start, end) in enumerate(FORWARDS):
            by_shard: dict[int, list[CaptureRecord]] = {}
            for name in HOOKS:
                hook = hook_by_name(name)
                shard = TP.plan(hook).shard_of(rank)
                if stray and name == "resid_pre" and rank == 1:
                    shard = 1  # a replicated hook stored twice: not what the plan says
                if shard is None or (drop == (name, shard) and seq == 1):
                    continue
                rows = on_rank(name, wholes[name], rank)[start:end].contiguous()
                by_shard.setdefault(shard, []).append(CaptureRecord(
                    model_id=RUN, request_id="r", act_name=hook.act_name, layer_no=0,
                    shard_rank=shard, start_token_idx=start, end_token_idx=end,
                    dtype="torch.float32", shape=tuple(rows.shape),
                    payload=rows.numpy().tobytes(), seq=seq))
            batches += [RecordBatch.from_records(recs) for recs in by_shard.values()]
    return batches


def write(backend: Backend, **kwargs: object) -> dict[str, torch.Tensor]:
    wholes = whole_tensors()
    run = RunInfo(RUN, "/models/toy", ((TP_KEY, TP.to_setting()),),
                  tuple((hook_by_name(n).act_name, 0) for n in HOOKS), "2026-12-02T10:00:00")
    backend.sink.start_run(run)
    for batch in stored(wholes, **kwargs):  # type: ignore[arg-type]
        backend.sink.put(batch)
    backend.sink.flush()
    backend.sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED,
                                         stopped_at="2026-12-02T10:01:00"),
                            [RequestManifest(RUN, "r", PROMPT, COMPLETION, committed=True)])
    return wholes


def test_a_tp2_capture_reads_back_whole_through_the_handle(backend: Backend) -> None:
    wholes = write(backend)
    handle = CaptureHandle(RUN, "r", backend.reader)
    assert handle.missing == ()
    for name, whole in wholes.items():
        got = handle.get(name, 0)
        assert got.shape == whole.shape, name
        assert torch.equal(got, whole), name
    assert torch.equal(handle.get("q", 0, start=1, end=4), wholes["q"][1:4])
    assert torch.equal(handle.hidden_states[0], wholes["resid_pre"])


def test_a_tp2_capture_exports_whole_tensors(backend: Backend) -> None:
    wholes = write(backend)
    reads = StoreReads(backend.reader)
    listing = reads.listing(RUN, "r")
    assert listing["complete"]
    shapes = {t["hook"]: t["shape"] for t in listing["tensors"]}  # type: ignore[attr-defined]
    assert shapes == {hook_by_name(n).act_name: list(w.shape) for n, w in wholes.items()}
    tensors = load_safetensors(b"".join(reads.safetensors(RUN, "r")[1]))
    for name, whole in wholes.items():
        assert torch.equal(tensors[f"{hook_by_name(name).act_name}.0"], whole), name


@pytest.mark.parametrize(("hook", "shard"), [("q", 1), ("attn_out", 0)])
def test_a_missing_part_makes_the_capture_incomplete(backend: Backend, hook: str,
                                                     shard: int) -> None:
    write(backend, drop=(hook, shard))
    handle = CaptureHandle(RUN, "r", backend.reader)
    act = hook_by_name(hook).act_name
    assert handle.missing == (f"{act} layer 0 shard_rank {shard}: positions [3, 4) missing",)
    with pytest.raises(IncompleteCaptureError, match=f"shard_rank {shard}"):
        handle.get(hook, 0)
    assert StoreReads(backend.reader).listing(RUN, "r")["complete"] is False
    # what an interrupted run's reader may take: the positions every part holds
    partial = CaptureHandle(RUN, "r", backend.reader, partial=True)
    assert partial.partial_positions(hook, 0) == range(0, PROMPT)
    assert partial.get(hook, 0).shape[0] == PROMPT


def test_a_part_the_plan_does_not_store_is_a_damaged_store(backend: Backend) -> None:
    write(backend, stray=True)
    handle = CaptureHandle(RUN, "r", backend.reader)
    with pytest.raises(StoreError, match="shard_rank 1, but the run stores 1 part"):
        handle.get("resid_pre", 0)
