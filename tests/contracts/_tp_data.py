"""A TP=2 run with known whole tensors, split the way SGLang 0.5.19 splits them over two
ranks (q: heads in rank order; k with one KV head: the same head on both ranks; attn_out
at ``o_proj`` with ``reduce_results=False``: partial sums; resid_pre: the same on both),
and stored the way the capture path stores a rank's tensors (the run's plan says which
rank stores which ``shard_rank``). Shared by the TP read suites."""

from __future__ import annotations

from collections.abc import Collection

import attrs
import torch

from dmi_sglang.columns import RecordBatch, RecordSink
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.tensor_parallel import TP_KEY, TensorParallel

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


def stored(wholes: dict[str, torch.Tensor], *, drop: Collection[tuple[str, int, int]] = (),
           stray: bool = False, ranks: range = range(TP.tp_size)) -> list[RecordBatch]:
    """The records of ``ranks``, one batch per rank and forward (a batch is one
    shard_rank); ``drop``: leave out these ``(hook, shard_rank, forward)``; ``stray``: rank 1
    stores resid_pre too, as a second part the plan does not have."""
    batches = []
    for rank in ranks:
        for seq, (start, end) in enumerate(FORWARDS):
            by_shard: dict[int, list[CaptureRecord]] = {}
            for name in HOOKS:
                hook = hook_by_name(name)
                shard = TP.plan(hook).shard_of(rank)
                if stray and name == "resid_pre" and rank == 1:
                    shard = 1  # a replicated hook stored twice: not what the plan says
                if shard is None or (name, shard, seq) in drop:
                    continue
                rows = on_rank(name, wholes[name], rank)[start:end].contiguous()
                by_shard.setdefault(shard, []).append(CaptureRecord(
                    model_id=RUN, request_id="r", act_name=hook.act_name, layer_no=0,
                    shard_rank=shard, start_token_idx=start, end_token_idx=end,
                    dtype="torch.float32", shape=tuple(rows.shape),
                    payload=rows.numpy().tobytes(), seq=seq))
            batches += [RecordBatch.from_records(recs) for recs in by_shard.values()]
    return batches


RUN_INFO = RunInfo(RUN, "/models/toy", ((TP_KEY, TP.to_setting()),),
                   tuple((hook_by_name(n).act_name, 0) for n in HOOKS), "2026-12-02T10:00:00")
"""The run, as it starts."""


def finish(sink: RecordSink) -> None:
    """Commit the run and its one request."""
    sink.flush()
    sink.finish_run(attrs.evolve(RUN_INFO, status=RunStatus.COMMITTED,
                                 stopped_at="2026-12-02T10:01:00"),
                    [RequestManifest(RUN, "r", PROMPT, COMPLETION, committed=True)])


def write(sink: RecordSink, **kwargs: object) -> dict[str, torch.Tensor]:
    """Every rank's records of the run through ``sink``, committed; the whole tensors."""
    wholes = whole_tensors()
    sink.start_run(RUN_INFO)
    for batch in stored(wholes, **kwargs):  # type: ignore[arg-type]
        sink.put(batch)
    finish(sink)
    return wholes


def rank_one(address: str) -> None:
    """Tensor-parallel rank 1 of the run, as a process of its own: its parts, through
    the store owner's write channel at ``address``."""
    from dmi_sglang.adapters.owner import RemoteSink

    sink = RemoteSink(address, timeout_s=60)
    for batch in stored(whole_tensors(), ranks=range(1, 2)):
        sink.put(batch)
    sink.flush()
    sink.close()
