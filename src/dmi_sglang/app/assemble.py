"""Pure read-side rules: completeness of a request, and which stored rows to use.

Dedupe after retractions: SGLang may retract a request and forward some positions
again, with a different chunking. Every record carries ``seq`` (the capture step), so
for each position the row of the record with the highest ``seq`` wins; the winners are
then sliced out of their records and concatenated in position order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Sequence

import attrs

from dmi_sglang.domain.hooks import CATALOG, Hook
from dmi_sglang.domain.positions import Positions
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.errors import IncompleteCaptureError, StoreError

__all__ = [
    "Slice",
    "covered_prefix",
    "hook_for",
    "joined_rows",
    "missing",
    "narrowed",
    "select_rows",
    "selected_positions",
]

_BY_ACT = {h.act_name: h for h in CATALOG}
_BY_NAME = {h.name: h for h in CATALOG}


def hook_for(name: str) -> Hook:
    """A catalog hook by short name (``resid_pre``) or stored act_name.

    Raises:
        IncompleteCaptureError: no such hook (a LookupError).
    """
    hook = _BY_NAME.get(name) or _BY_ACT.get(name)
    if hook is None:
        msg = f"unknown hook {name!r}; accepted: {', '.join(_BY_NAME)}"
        raise IncompleteCaptureError(msg)
    return hook


def missing(
    run_id: str,
    request_id: str,
    run: RunInfo | None,
    manifest: RequestManifest | None,
    ranges: Sequence[tuple[str, int, int, int, int]],
    *,
    mixed: Collection[tuple[str, int]] = (),
) -> tuple[str, ...]:
    """Why a request's capture is not complete; empty when it is.

    Complete means: the request's manifest is committed, and for every
    ``(act_name, layer)`` of ``run.captures`` the stored ranges (``ranges``: the reader's
    ``(act_name, layer_no, shard_rank, start, end)``) of every part the run stores
    (``shard_rank`` 0 .. parts-1 under tensor parallelism, else 0) cover every position
    of :func:`selected_positions`. A manifest is committed when its request finished
    cleanly and every row of it was stored (while the run goes on, see
    ``RecordSink.commit_requests``), or when the run stopped cleanly; so a committed
    request stays complete whatever becomes of its run later.

    A record of a part the run does not store (``shard_rank`` outside its parts), or
    records of one ``(act_name, layer)`` in more than one dtype or row shape (``mixed``:
    the reader's :attr:`~dmi_sglang.domain.ports.RequestExtents.mixed`), make the
    capture incomplete too: the store is damaged, and nothing of it is read.

    Raises:
        StoreError: the run's tensor-parallel setting is damaged.
    """
    if run is None:
        return (f"run {run_id!r} is not in the store",)
    if manifest is None or not manifest.committed:
        return (_not_committed(run, request_id, manifest),)
    by_key: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for act, layer, shard, start, end in ranges:
        by_key.setdefault((act, layer, shard), []).append((start, end))
    reasons = []
    rules = run.position_rules()
    tp = run.tensor_parallel
    for act, layer in run.captures:
        kept = selected_positions(manifest, act, rules.get((act, layer)))
        parts = tp.plan_for_act(act).parts
        stray = sorted(sh for a, n, sh in by_key
                       if (a, n) == (act, layer) and not 0 <= sh < parts)
        if stray:  # a damaged store: refused here, before any export starts
            reasons.append(f"{act} layer {layer}: records of shard_rank {stray}, but the run "
                           f"stores {parts} part(s) of it")
        for shard in range(parts):
            spans = by_key.get((act, layer, shard), [])
            if kept.step == 1:
                gaps = [f"[{a}, {b})" for a, b in _uncovered(kept.start, kept.stop, spans)]
            else:
                gaps = [str(p) for p in _uncovered_positions(kept, spans)]
            if gaps:
                more = f" and {len(gaps) - 4} more" if len(gaps) > 4 else ""
                part = f" shard_rank {shard}" if parts > 1 else ""
                reasons.append(f"{act} layer {layer}{part}: positions "
                               f"{', '.join(gaps[:4])}{more} missing")
        if (act, layer) in mixed:
            reasons.append(f"{act} layer {layer}: records of more than one dtype or row "
                           "shape (a damaged store: its rows or parts cannot be joined)")
    return tuple(reasons)


def _not_committed(run: RunInfo, request_id: str, manifest: RequestManifest | None) -> str:
    """Why a request has no committed manifest, from the run's state."""
    run_id, status = run.run_id, run.status
    if status is RunStatus.RUNNING:
        return (f"run {run_id!r} is running, not committed, and request {request_id!r} is "
                "not committed yet: it has not finished (or was cancelled), or the run "
                "leaves it out (DMX_REQUEST_SAMPLE, or dmi_capture=False)")
    if status is not RunStatus.COMMITTED:
        error = f": {run.error}" if run.error else ""
        return f"run {run_id!r} is {status.value}, not committed{error}"
    if manifest is None:
        return (f"request {request_id!r} of run {run_id!r} has no manifest: the run never "
                "saw it, or left it out (DMX_REQUEST_SAMPLE, or dmi_capture=False)")
    return (f"the manifest of request {request_id!r} is not committed: the request was "
            "cancelled (aborted) or had not finished when the run stopped")


def selected_positions(manifest: RequestManifest, act: str, rule: Positions | None) -> range:
    """The positions of a request a capture of hook ``act`` holds, in order: the
    manifest's coverage, narrowed by the capture's position rule (None: every position;
    a step above 1 for ``every(K)``)."""
    cov = manifest.coverage(hook_for(act))
    if rule is None:
        return range(cov.start, max(cov.start, cov.end))
    return rule.kept(cov.start, cov.end, prompt=manifest.prompt_tokens,
                     completion=manifest.completion_tokens)


def narrowed(kept: range, start: int | None, end: int | None) -> range:
    """The positions of ``kept`` in ``[start, end)`` (None: no bound on that side)."""
    lo = 0 if start is None else max(0, -(-(start - kept.start) // kept.step))
    hi = len(kept) if end is None else max(0, -(-(end - kept.start) // kept.step))
    out = kept[lo:hi]  # a slice of a stepped range ends on a whole step, maybe past both
    limit = kept.stop if end is None else min(kept.stop, max(end, kept.start))
    return range(out.start, max(out.start, min(out.stop, limit)), out.step)


def covered_prefix(spans: Sequence[tuple[int, int]], first: int, step: int) -> range:
    """The positions ``first, first + step, ...`` that the spans ``[start, end)`` hold,
    up to the first one they miss."""
    holds = _holder(spans)
    p = first
    while holds(p):
        p += step
    return range(first, p, step)


def _holder(spans: Sequence[tuple[int, int]]) -> Callable[[int], bool]:
    """Whether a position lies in one of the spans ``[start, end)``."""
    merged: list[list[int]] = []  # sorted and disjoint
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]

    def holds(position: int) -> bool:
        i = bisect.bisect_right(starts, position) - 1
        return i >= 0 and position < merged[i][1]

    return holds


def _uncovered_positions(kept: range, spans: list[tuple[int, int]]) -> list[int]:
    """The positions of ``kept`` no span ``[start, end)`` holds."""
    holds = _holder(spans)
    return [p for p in kept if not holds(p)]


def _uncovered(lo: int, hi: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    gaps: list[tuple[int, int]] = []
    pos = lo
    for start, end in sorted(spans):
        if start > pos and pos < hi:
            gaps.append((pos, min(start, hi)))
        pos = max(pos, end)
        if pos >= hi:
            break
    if pos < hi:
        gaps.append((pos, hi))
    return gaps


@attrs.frozen
class Slice:
    """Rows ``[row_from, row_to)`` of ``records[index]``, in the output's position order."""

    index: int
    row_from: int
    row_to: int


def joined_rows(records: Sequence[CaptureRecord], slices: Sequence[Slice],
                row_size: int) -> bytearray:
    """The rows ``slices`` (from :func:`select_rows`) pick out of ``records``, joined.

    Raises:
        StoreError: a picked record whose payload is not its rows of ``row_size`` bytes.
    """
    out = bytearray()
    for s in slices:
        r = records[s.index]
        if len(r.payload) != r.rows * row_size:
            msg = (f"{r.act_name} layer {r.layer_no} [{r.start_token_idx}, "
                   f"{r.end_token_idx}): {len(r.payload)} payload bytes do not fit {r.dtype} "
                   f"{list(r.shape)} ({r.rows} rows of {row_size} bytes)")
            raise StoreError(msg)
        out += memoryview(r.payload)[s.row_from * row_size : s.row_to * row_size]
    return out


def select_rows(records: Sequence[CaptureRecord], positions: range) -> list[Slice]:
    """For each of ``positions`` (in order) the row of the highest-``seq`` record holding
    it, as runs of consecutive rows of one record.

    Raises:
        IncompleteCaptureError: a position no record holds.
        StoreError: a record whose first dim is not its token range.
    """
    for r in records:
        if not r.shape or r.shape[0] != r.rows:
            msg = (
                f"record {r.act_name} layer {r.layer_no} [{r.start_token_idx}, "
                f"{r.end_token_idx}) has shape {list(r.shape)}: rows do not match positions"
            )
            raise StoreError(msg)
    owner = [-1] * len(positions)
    by_seq = sorted(range(len(records)), key=lambda i: records[i].seq, reverse=True)
    for i in by_seq:
        r = records[i]
        held = narrowed(positions, r.start_token_idx, r.end_token_idx)
        first = (held.start - positions.start) // positions.step if held else 0
        for k in range(first, first + len(held)):
            if owner[k] < 0:
                owner[k] = i
    if -1 in owner:
        pos = positions[owner.index(-1)]
        shown = (f"[{positions.start}, {positions.stop})" if positions.step == 1
                 else f"{positions.start}, {positions.start + positions.step}, ... "
                      f"below {positions.stop}")
        msg = f"position {pos} is missing from the stored rows of positions {shown}"
        raise IncompleteCaptureError(msg)
    slices: list[Slice] = []
    k = 0
    while k < len(owner):
        i = owner[k]
        row = positions[k] - records[i].start_token_idx
        end = k + 1
        while (end < len(owner) and owner[end] == i
               and positions[end] - records[i].start_token_idx == row + end - k):
            end += 1
        slices.append(Slice(i, row, row + end - k))
        k = end
    return slices
