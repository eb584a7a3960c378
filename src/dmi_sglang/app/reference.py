"""A CPU reference capture: a model run outside SGLang, stored as a normal run.

Version-neutral: it imports only the domain. A :class:`~dmi_sglang.domain.ports.ReferenceModel`
(transformers on CPU, wired by the composition root) runs greedy generation one request at
a time and hands over, per forward, what the capture points saw. Which rows of that are
stored is the domain's rule, exactly as for a monitored SGLang engine: each forward gets
its :class:`~dmi_sglang.domain.layout.BatchLayout` (the prompt's forward an extend, every
later one a decode) and its unpadded :func:`~dmi_sglang.domain.plan.make_plan`, whose
segments and slices cut the records. The records go to the same
:class:`~dmi_sglang.columns.RecordSink`, with one committed manifest per request, so
``ls``, ``show``, ``export`` and the Python handle read the run like any other.

The run is labelled in the runs table: its settings carry
``dmi.source = cpu-reference`` (:data:`~dmi_sglang.domain.records.SOURCE_KEY`) and
``dmi.reference.engine`` (what ran it). There is no overlap scheduler here, so no
request's last generated token is forwarded (``overlap_extra_forward`` is False).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime

import attrs
import structlog

from dmi_sglang.columns import RecordBatch, RecordSink
from dmi_sglang.domain.hooks import Selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import CommitPlan, make_plan, make_read_plan
from dmi_sglang.domain.ports import ReferenceForward, ReferenceModel
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.records import (
    SOURCE_KEY,
    CaptureRecord,
    RequestManifest,
    RunInfo,
    RunSource,
    RunStatus,
    storable_request_id,
)
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import CaptureError

__all__ = [
    "ENGINE_KEY",
    "MODEL_KEY",
    "ReferenceRequest",
    "ReferenceResult",
    "capture_reference",
    "forward_records",
    "reference_run",
]

log = structlog.get_logger(__name__)

ENGINE_KEY = "dmi.reference.engine"
"""Runs-table settings key: what ran a reference capture (libraries, device, dtype)."""
MODEL_KEY = "dmi.reference.model"
"""Runs-table settings key: how to make the model again, when it was generated for the run."""


@attrs.frozen
class ReferenceRequest:
    """One request of a reference capture: its id and its prompt's token ids."""

    request_id: str
    prompt_ids: tuple[int, ...]


@attrs.frozen
class ReferenceResult:
    """What a reference capture stored.

    Attributes:
        run: the run's final state (committed).
        manifests: one committed manifest per request, in request order.
        forwards / records / rows / bytes: forwards run and what they stored.
        seconds: wall time from the run's start to its commit.
    """

    run: RunInfo
    manifests: tuple[RequestManifest, ...]
    forwards: int
    records: int
    rows: int
    bytes: int
    seconds: float


def reference_run(settings: Settings, model: ReferenceModel, selection: Selection, *,
                  model_path: str | None = None, model_note: str | None = None) -> RunInfo:
    """The running row of a reference capture: the resolved settings (secrets removed)
    as a monitored engine records them, labelled ``dmi.source = cpu-reference``.

    Args:
        settings: resolved settings (run id, store, hook selection).
        model: the reference model (its path and description are recorded).
        selection: the selection bound to the model (the run's captures).
        model_path: the model path to record (default: the model's own).
        model_note: how to make the model again, when it was generated for the run.
    """
    entries = dict(settings.to_env(include_secrets=False))
    entries[SOURCE_KEY] = RunSource.CPU_REFERENCE.value
    entries[ENGINE_KEY] = model.description
    if model_note:
        entries[MODEL_KEY] = model_note
    return RunInfo(
        run_id=settings.model_id or "",
        model_path=model.model_path if model_path is None else model_path,
        settings=tuple(sorted(entries.items())),
        captures=tuple((h.act_name, layer) for h, layer in selection.captures()),
        started_at=datetime.now(UTC).isoformat(),
    )


def capture_reference(
    model: ReferenceModel,
    sink: RecordSink,
    run: RunInfo,
    selection: Selection,
    requests: Sequence[ReferenceRequest],
    *,
    max_new_tokens: int,
) -> ReferenceResult:
    """Run every request through ``model`` and store the run in ``sink``, committed.

    The sink is not closed (its opener closes it). A failure records the run as failed
    (best effort, manifests not committed) and propagates.

    Raises:
        CaptureError: the model handed over rows the plan does not expect.
        StoreError: the sink failed.
    """
    started = time.perf_counter()
    selected = {(hook.name, layer) for hook, layer in selection.captures()}
    for hook, layer in selection.captures():  # a row the model cannot have: before the run
        model.shape.capture_row(selection, hook, layer)
    last = {(hook.name, layer): model.shape.capture_row(selection, hook, layer).nbytes
            for hook, layer in selection.captures_kept_by(PositionRule.LAST)}
    sink.start_run(run)
    manifests: list[RequestManifest] = []
    seq = forwards = records = rows = nbytes = 0
    try:
        for request in requests:
            rid = storable_request_id(request.request_id)
            completion = 0
            end = 0
            newest: dict[tuple[str, int], bytes] = {}
            for fwd in model.generate(request.prompt_ids, max_new_tokens=max_new_tokens,
                                      selection=selection):
                for key, size in last.items():  # the forward's last row decided its token
                    data = fwd.payloads[key]
                    newest[key] = data[len(data) - size:]
                layout = _layout(rid, request, fwd, first=completion == 0, end=end)
                seq += 1
                forwards += 1
                plan = make_plan(layout, selection, model.shape, padded=False,
                                 prompts=_prompt_of(len(request.prompt_ids)))
                out = forward_records(plan, fwd.payloads, run_id=run.run_id, seq=seq,
                                      selected=selected)
                if out:
                    sink.put(RecordBatch.from_records(out))
                records += len(out)
                rows += sum(r.rows for r in out)
                nbytes += sum(len(r.payload) for r in out)
                completion += 1
                end = fwd.start + len(fwd.tokens)
            if completion == 0:
                msg = f"request {request.request_id!r}: the model ran no forward"
                raise CaptureError(msg)
            if last:  # the row that decided the last token, as a capture reads it out
                seq += 1
                read = make_read_plan([(rid, len(request.prompt_ids) + completion - 2)],
                                      selection, model.shape)
                out = forward_records(read, newest, run_id=run.run_id, seq=seq)
                sink.put(RecordBatch.from_records(out))
                records += len(out)
                rows += len(out)
                nbytes += sum(len(r.payload) for r in out)
            manifests.append(RequestManifest(
                model_id=run.run_id, request_id=rid, prompt_tokens=len(request.prompt_ids),
                completion_tokens=completion, committed=True))
        done = attrs.evolve(run, stopped_at=datetime.now(UTC).isoformat(),
                            status=RunStatus.COMMITTED)
        sink.finish_run(done, manifests)
    except BaseException as exc:
        log.error("dmi.reference.failed", run_id=run.run_id, error=repr(exc))
        _record_failure(sink, run, manifests, exc)
        raise
    seconds = time.perf_counter() - started
    log.info("dmi.reference.committed", run_id=run.run_id, requests=len(manifests),
             forwards=forwards, records=records, seconds=round(seconds, 3))
    return ReferenceResult(done, tuple(manifests), forwards, records, rows, nbytes, seconds)


def _prompt_of(length: int) -> Callable[[str], int | None]:
    """The prompt lengths of a run of one request at a time: every id has this one."""
    return lambda _request_id: length


def _layout(rid: str, request: ReferenceRequest, fwd: ReferenceForward, *, first: bool,
            end: int) -> BatchLayout:
    """The forward's layout: the prompt's forward is an extend over the whole prompt,
    each later one a decode of the token the previous forward decided."""
    if first:
        if fwd.start != 0 or fwd.tokens != request.prompt_ids:
            msg = (f"request {request.request_id!r}: the first forward must be the whole "
                   f"prompt from position 0, got {len(fwd.tokens)} tokens from {fwd.start}")
            raise CaptureError(msg)
        n = len(fwd.tokens)
        return BatchLayout.extend([rid], [0], [n], seq_lens=[n])
    if fwd.start != end or len(fwd.tokens) != 1:
        msg = (f"request {request.request_id!r}: a decode forward must forward one token at "
               f"position {end}, got {len(fwd.tokens)} from {fwd.start}")
        raise CaptureError(msg)
    return BatchLayout.decode([rid], [fwd.start + 1])


def forward_records(plan: CommitPlan, payloads: Mapping[tuple[str, int], bytes], *,
                    run_id: str, seq: int,
                    selected: Collection[tuple[str, int]] = ()) -> list[CaptureRecord]:
    """The records of one forward: each segment of ``plan`` cut from the rows its capture
    point saw (``payloads``), kept rows and per-request slices as the plan says.
    Payloads of ``selected`` captures the plan leaves out (a position rule that keeps no
    row of this forward) are ignored.

    Raises:
        CaptureError: a payload the plan needs is missing, has the wrong size, or the
            model handed over a capture the selection does not hold.
    """
    wanted = {(seg.hook.name, seg.layer_no) for seg in plan.segments}
    extra = sorted(set(payloads) - wanted - set(selected))
    if extra:
        msg = f"the model handed over captures the plan does not hold: {extra[:4]}"
        raise CaptureError(msg)
    out: list[CaptureRecord] = []
    for seg in plan.segments:
        data = payloads.get((seg.hook.name, seg.layer_no))
        row = seg.row.nbytes
        if data is None or len(data) != seg.source_rows * row:
            got = "nothing" if data is None else f"{len(data)} bytes"
            msg = (f"{seg.hook.name} layer {seg.layer_no}: the plan expects {seg.source_rows} "
                   f"rows of {row} bytes, the model handed over {got}")
            raise CaptureError(msg)
        view = memoryview(data)
        kept = (view[: seg.kept_rows * row] if seg.source_index is None
                else b"".join(view[i * row: (i + 1) * row] for i in seg.source_index))
        for sl in plan.slices(seg):
            out.append(CaptureRecord(
                model_id=run_id,
                request_id=sl.request_id,
                act_name=seg.hook.act_name,
                layer_no=seg.layer_no,
                shard_rank=0,
                start_token_idx=sl.start,
                end_token_idx=sl.end,
                dtype=seg.row.dtype.value,
                shape=(sl.rows, *seg.row.dims),
                payload=bytes(kept[sl.row_offset * row: (sl.row_offset + sl.rows) * row]),
                seq=seq,
            ))
    return out


def _record_failure(sink: RecordSink, run: RunInfo, manifests: Sequence[RequestManifest],
                    exc: BaseException) -> None:
    failed = attrs.evolve(run, stopped_at=datetime.now(UTC).isoformat(),
                          status=RunStatus.FAILED, error=repr(exc))
    try:
        sink.finish_run(failed, [attrs.evolve(m, committed=False) for m in manifests])
    except BaseException as again:  # the store itself may be what failed
        log.error("dmi.failure_not_recorded", run_id=run.run_id, error=repr(again))
