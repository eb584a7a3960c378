"""Rows of the runs and manifest tables, to and from domain objects."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from dmi_sglang.domain.records import RequestManifest, RunInfo, RunStatus

__all__ = ["manifest_from_row", "manifest_row", "run_from_row", "run_row"]

_version_lock = threading.Lock()
_last_version = 0


def _next_version() -> int:
    """A version for a state row: wall-clock ns, strictly increasing in this process.

    The runs and manifest tables keep the row with the highest version per key, so a
    run's final status must out-version its start row even under a coarse clock.
    """
    global _last_version  # noqa: PLW0603 -- one process-wide counter, guarded by the lock
    with _version_lock:
        _last_version = max(time.time_ns(), _last_version + 1)
        return _last_version


_OWNER_KEY = "dmi.owner"
"""The owner rides in the settings column (the runs table layout stays as it was)."""


def run_row(run: RunInfo) -> list[Any]:
    """The runs-table row of ``run`` (columns as in ``_schema.RUNS_COLUMNS``)."""
    settings = [tuple(kv) for kv in run.settings]
    if run.owner:
        settings.append((_OWNER_KEY, run.owner))
    return [
        run.run_id,
        run.model_path,
        settings,
        [tuple(c) for c in run.captures],
        run.started_at,
        run.stopped_at,
        run.status.value,
        run.error,
        _next_version(),
    ]


def run_from_row(row: Sequence[Any]) -> RunInfo:
    """A :class:`RunInfo` from a runs-table row. A row that cannot be read (an unknown
    status, malformed values) gives an ``unreadable`` run whose ``error`` says why, so
    one bad row never hides the others."""
    run_id = str(row[0]) if row else "?"
    try:
        model_path, settings, captures, started, stopped, status, error = row[1:8]
        pairs = [(str(k), str(v)) for k, v in settings]
        return RunInfo(
            run_id=run_id,
            model_path=str(model_path),
            settings=tuple(kv for kv in pairs if kv[0] != _OWNER_KEY),
            captures=tuple((str(a), int(layer)) for a, layer in captures),
            started_at=str(started),
            stopped_at=str(stopped),
            status=_status(status),
            error=str(error),
            owner=next((v for k, v in pairs if k == _OWNER_KEY), ""),
        )
    except (ValueError, TypeError) as exc:
        return RunInfo(run_id=run_id, model_path="", settings=(), captures=(), started_at="",
                       status=RunStatus.UNREADABLE,
                       error=f"the run's stored row cannot be read: {exc}")


def _status(value: object) -> RunStatus:
    status = RunStatus(value)
    if status in (RunStatus.INTERRUPTED, RunStatus.UNREADABLE):  # never stored as such
        raise ValueError(f"status {value!r} is never stored")
    return status


def manifest_row(manifest: RequestManifest, *, committed: bool) -> list[Any]:
    """The manifest-table row of ``manifest``, with ``committed`` as decided by the sink."""
    return [
        manifest.model_id,
        manifest.request_id,
        manifest.prompt_tokens,
        manifest.completion_tokens,
        manifest.computed_from,
        int(manifest.overlap_extra_forward),
        int(committed),
        _next_version(),
    ]


def manifest_from_row(row: Sequence[Any]) -> RequestManifest:
    """A :class:`RequestManifest` from a manifest-table row (without ``version``)."""
    model_id, request_id, prompt, completion, computed_from, overlap, committed = row[:7]
    return RequestManifest(
        model_id=str(model_id),
        request_id=str(request_id),
        prompt_tokens=int(prompt),
        completion_tokens=int(completion),
        computed_from=int(computed_from),
        overlap_extra_forward=bool(overlap),
        committed=bool(committed),
    )
