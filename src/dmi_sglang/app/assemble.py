"""Pure read-side rules: completeness of a request, and which stored rows to use.

Dedupe after retractions: SGLang may retract a request and forward some positions
again, with a different chunking. Every record carries ``seq`` (the capture step), so
for each position the row of the record with the highest ``seq`` wins; the winners are
then sliced out of their records and concatenated in position order.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dmi_sglang.domain.hooks import CATALOG, Hook
from dmi_sglang.domain.positions import Positions
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.errors import IncompleteCaptureError, StoreError

__all__ = ["Slice", "hook_for", "missing", "select_rows", "selected_span"]

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
    ranges: Sequence[tuple[str, int, int, int]],
) -> tuple[str, ...]:
    """Why a request's capture is not complete; empty when it is.

    Complete means: the run is committed, the request's manifest is committed, and for
    every ``(act_name, layer)`` of ``run.captures`` the stored ranges cover every
    position of :func:`selected_span`.
    """
    if run is None:
        return (f"run {run_id!r} is not in the store",)
    if run.status is not RunStatus.COMMITTED:
        error = f": {run.error}" if run.error else ""
        return (f"run {run_id!r} is {run.status.value}, not committed{error}",)
    if manifest is None:
        return (f"request {request_id!r} of run {run_id!r} has no manifest: the run never "
                "saw it, or left it out (DMX_REQUEST_SAMPLE, or dmi_capture=False)",)
    if not manifest.committed:
        return (f"the manifest of request {request_id!r} is not committed",)
    by_key: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for act, layer, start, end in ranges:
        by_key.setdefault((act, layer), []).append((start, end))
    reasons = []
    rules = run.position_rules()
    for act, layer in run.captures:
        lo, hi = selected_span(manifest, act, rules.get((act, layer)))
        gaps = _uncovered(lo, hi, by_key.get((act, layer), [])) if hi > lo else []
        if gaps:
            shown = ", ".join(f"[{a}, {b})" for a, b in gaps[:4])
            more = f" and {len(gaps) - 4} more" if len(gaps) > 4 else ""
            reasons.append(f"{act} layer {layer}: positions {shown}{more} missing")
    return tuple(reasons)


def selected_span(manifest: RequestManifest, act: str,
                  rule: Positions | None) -> tuple[int, int]:
    """The positions ``[lo, hi)`` of a request a capture of hook ``act`` holds: the
    manifest's coverage, narrowed by the capture's position rule (None: every position;
    empty when ``hi <= lo``)."""
    cov = manifest.coverage(hook_for(act))
    if rule is None:
        return cov.start, cov.end
    return rule.span(cov.start, cov.end, prompt=manifest.prompt_tokens,
                     completion=manifest.completion_tokens)


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


def select_rows(records: Sequence[CaptureRecord], lo: int, hi: int) -> list[Slice]:
    """For each position in ``[lo, hi)`` the row of the highest-``seq`` record holding it.

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
    owner = [-1] * max(0, hi - lo)
    by_seq = sorted(range(len(records)), key=lambda i: records[i].seq, reverse=True)
    for i in by_seq:
        r = records[i]
        for pos in range(max(r.start_token_idx, lo), min(r.end_token_idx, hi)):
            if owner[pos - lo] < 0:
                owner[pos - lo] = i
    if -1 in owner:
        pos = lo + owner.index(-1)
        msg = f"position {pos} is missing from the stored rows [{lo}, {hi})"
        raise IncompleteCaptureError(msg)
    slices: list[Slice] = []
    offset = 0
    while offset < len(owner):
        i = owner[offset]
        end = offset + 1
        while end < len(owner) and owner[end] == i:
            end += 1
        first_row = lo + offset - records[i].start_token_idx
        slices.append(Slice(i, first_row, first_row + end - offset))
        offset = end
    return slices
