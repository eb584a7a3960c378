"""Stored records, the per-request manifest and the row-coverage rules.

A :class:`CaptureRecord` is one row of the ``offload`` table: one hook, one layer, one
request, one forward's half-open token range ``[start, end)``, raw tensor bytes.

Row coverage (what a complete capture of a request holds):

* token-row hooks cover every forwarded position ``[computed_from, prompt + completion - 1)``;
  with SGLang's overlap scheduler the last generated token is forwarded once more, so
  position ``prompt + completion - 1`` is stored too;
* ``final_logits`` has one row per generated token: the logits of the forward at position
  ``p`` decide token ``p + 1``, so the rows cover ``[prompt - 1, prompt + completion - 1)``
  (the overlap scheduler's extra forward decides nothing and is not stored).

``computed_from`` is 0 unless the prefix cache served the first tokens (then they were
never recomputed and cannot be captured).

Retractions: a request that SGLang retracts and recomputes forwards some positions again.
Every record carries ``seq``, the capture step that produced it (monotonic per run); a
reader keeps, per position, the row of the latest step. See docs/storage.md.
"""

from __future__ import annotations

import enum
import functools

import attrs

from dmi_sglang.domain.hooks import CATALOG, Hook, ModelHooks, RowBasis, parse_selection
from dmi_sglang.domain.positions import Positions
from dmi_sglang.domain.tensor_parallel import TP_KEY, TensorParallel
from dmi_sglang.errors import SelectionError, StoreError

__all__ = [
    "HEARTBEAT_S",
    "SELECTION_KEY",
    "SOURCE_KEY",
    "STALE_AFTER_S",
    "CaptureRecord",
    "Coverage",
    "RequestManifest",
    "RunInfo",
    "RunSource",
    "RunStatus",
    "expected_coverage",
    "original_request_id",
    "storable_request_id",
]


def storable_request_id(request_id: str) -> str:
    """A request id as the store keeps it.

    Itself, unless it cannot be stored as UTF-8 (a lone surrogate, which SGLang's HTTP
    API can deliver) or starts with NUL: those become NUL followed by the hex of their
    bytes (surrogates passed through). No other id maps to the same stored id, so two
    requests never share rows. Applied where ids enter (the SGLang adapter) and where a
    reader looks one up.
    """
    if request_id.isascii() and not request_id.startswith("\x00"):
        return request_id
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        if not request_id.startswith("\x00"):
            return request_id
    return "\x00" + request_id.encode("utf-8", "surrogatepass").hex()


def original_request_id(stored: str) -> str:
    """The request id a stored id came from (the inverse of :func:`storable_request_id`)."""
    if not stored.startswith("\x00"):
        return stored
    try:
        return bytes.fromhex(stored[1:]).decode("utf-8", "surrogatepass")
    except ValueError:
        return stored  # not one of ours: show it as stored


@attrs.frozen
class CaptureRecord:
    """One stored row: a slice of one captured tensor for one request.

    Attributes:
        model_id: the capture run id (DMI's first key column).
        request_id: SGLang's request id (``meta_info["id"]``).
        act_name: the hook's stored name (``blocks.hook_resid_pre``).
        layer_no: the layer, ``-1`` for global hooks.
        shard_rank: tensor-parallel shard (0 at TP=1).
        start_token_idx / end_token_idx: the half-open token range of the rows.
        dtype: stored dtype name (``torch.bfloat16``).
        shape: the slice's shape, rows first.
        payload: raw, contiguous, native-endian bytes: ``bytes``, or a read-only
            one-dimensional byte ``memoryview`` (the transport's zero-copy slices).
        seq: capture step number; later steps supersede earlier ones (retractions).
    """

    model_id: str
    request_id: str
    act_name: str
    layer_no: int
    shard_rank: int
    start_token_idx: int
    end_token_idx: int
    dtype: str
    shape: tuple[int, ...]
    payload: bytes | memoryview = attrs.field(repr=lambda p: f"<{len(p)} bytes>")
    seq: int = 0

    @property
    def rows(self) -> int:
        """Rows in the slice (the first dim)."""
        return self.end_token_idx - self.start_token_idx


@attrs.frozen
class Coverage:
    """The half-open position range ``[start, end)`` a complete capture holds."""

    start: int
    end: int

    @property
    def rows(self) -> int:
        """Positions covered (0 if the range is empty)."""
        return max(0, self.end - self.start)


def expected_coverage(
    hook: Hook,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    overlap_extra_forward: bool,
    computed_from: int = 0,
) -> Coverage:
    """The positions a complete capture of one request holds for ``hook``.

    Args:
        hook: the catalog entry.
        prompt_tokens / completion_tokens: as SGLang reports them in ``meta_info``.
        overlap_extra_forward: True when SGLang's overlap scheduler forwarded the last
            generated token once more (stored for token-row hooks).
        computed_from: first position computed by a forward (prefix-cache hits skip
            the positions before it).
    """
    if hook.row_basis is RowBasis.REQUEST:
        return Coverage(prompt_tokens - 1, prompt_tokens + completion_tokens - 1)
    end = prompt_tokens + completion_tokens - 1 + (1 if overlap_extra_forward else 0)
    return Coverage(computed_from, end)


@attrs.frozen
class RequestManifest:
    """What a complete capture of one request holds, written when the run stops.

    Attributes:
        model_id / request_id: the request's key.
        prompt_tokens / completion_tokens: from the scheduler's view of the request.
        computed_from: first position a forward computed (prefix cache, see above).
        overlap_extra_forward: whether the overlap scheduler's extra forward was stored.
        committed: True only when the run stopped cleanly, everything was flushed, and
            the request finished (a request the engine aborted never is).
    """

    model_id: str
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    computed_from: int = 0
    overlap_extra_forward: bool = False
    committed: bool = False

    def coverage(self, hook: Hook) -> Coverage:
        """Expected positions for ``hook`` (see :func:`expected_coverage`)."""
        return expected_coverage(
            hook,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            overlap_extra_forward=self.overlap_extra_forward,
            computed_from=self.computed_from,
        )


class RunStatus(enum.Enum):
    """Lifecycle of a capture run, as stored in the runs table."""

    RUNNING = "running"
    """Capturing; nothing is guaranteed durable yet."""
    COMMITTED = "committed"
    """Stopped cleanly: every captured row was flushed and the manifest written."""
    FAILED = "failed"
    """Stopped with an error; captures are incomplete."""
    INTERRUPTED = "interrupted"
    """Read side only: stored as running, but its owner is gone (killed or crashed):
    no live process holds the embedded store, or a server-store run's heartbeat is older
    than :data:`STALE_AFTER_S`. What it stored is incomplete."""
    UNREADABLE = "unreadable"
    """Read side only: the run's stored row cannot be read (an unknown status, a
    malformed value); ``error`` says why."""


class RunSource(enum.Enum):
    """What produced a run's captures, as the runs table records it (:data:`SOURCE_KEY`)."""

    SGLANG = "sglang"
    """A monitored SGLang engine (the default: runs without the key)."""
    CPU_REFERENCE = "cpu-reference"
    """A CPU reference capture: transformers on CPU, same hook names and row rules
    (``dmi-sglang reference-capture``), not SGLang."""


SELECTION_KEY = "DMX_HOOK_SELECTION"
"""The runs table's ``settings`` entry holding the hook selection the run used."""

_NAME_OF = {h.act_name: h.name for h in CATALOG}
_ACT_OF = {h.name: h.act_name for h in CATALOG}


@functools.lru_cache(maxsize=64)
def _stored_rules(text: str, captures: tuple[tuple[str, int], ...]) -> tuple[
        tuple[tuple[str, int], Positions], ...]:
    """The position rules of a stored selection, resolved against the run's captures.
    A selection that does not resolve against them has no rules here: every capture is
    then judged against all its positions, so the reader reports gaps rather than call
    an incomplete capture complete."""
    names = {_NAME_OF[a] for a, _ in captures if a in _NAME_OF}
    layers = max((n for _, n in captures), default=-1) + 1
    try:
        selection = parse_selection(text).resolve(
            ModelHooks("stored", frozenset(names), max(layers, 1)))
    except SelectionError:
        return ()
    return tuple(((_ACT_OF[name], layer), rule) for name, layer, rule in selection.rules)


SOURCE_KEY = "dmi.source"
"""The key of the runs table's ``settings`` entry naming the run's :class:`RunSource`;
runs without it come from SGLang."""

TOPK_KERNEL_KEY = "dmi.topk_kernel"
"""The key of the runs table's ``settings`` entry naming the top-k selection a run with
``final_logits:topk(K)`` ran (``DMX_TOPK_KERNEL`` resolved: ``auto`` becomes
``flashinfer`` or ``none``), as tied values may name other columns under another one."""


HEARTBEAT_S = 10.0
"""How often a run on a ClickHouse server store rewrites its running row (its heartbeat)."""
STALE_AFTER_S = 60.0
"""A server-store run whose last heartbeat is older than this reads as interrupted (allow
for clock skew between the capturing host and the reader)."""


@attrs.frozen
class RunInfo:
    """One capture run (one monitored engine).

    Attributes:
        run_id: the ``model_id`` key of every record of the run.
        model_path: the served model.
        settings: the resolved settings as ``DMX_*`` variables (secrets removed), and
            ``dmi.*`` entries that describe the run (:data:`SOURCE_KEY`; ``TP_KEY`` of
            :mod:`~dmi_sglang.domain.tensor_parallel` under tensor parallelism;
            :data:`TOPK_KERNEL_KEY` with a top-k).
        captures: every ``(act_name, layer_no)`` a complete request capture holds.
        started_at / stopped_at: UTC ISO-8601 timestamps (``stopped_at`` empty while
            running).
        status: see :class:`RunStatus`.
        error: the failure, for failed runs.
    """

    run_id: str
    model_path: str
    settings: tuple[tuple[str, str], ...]
    captures: tuple[tuple[str, int], ...]
    started_at: str
    stopped_at: str = ""
    status: RunStatus = RunStatus.RUNNING
    error: str = ""
    owner: str = ""
    """The process that captures it (``host:pid``), recorded at start."""

    def position_rules(self) -> dict[tuple[str, int], Positions]:
        """The position rule of each ``(act_name, layer_no)`` of :attr:`captures` that
        keeps only some positions, from the selection the run used (its
        :data:`SELECTION_KEY` setting); empty when every capture keeps every position."""
        text = next((v for k, v in self.settings if k == SELECTION_KEY), "")
        if not text or ":" not in text:
            return {}
        return dict(_stored_rules(text, self.captures))

    @property
    def source(self) -> str:
        """What produced the run: the value of its :data:`SOURCE_KEY` setting (a
        :class:`RunSource` value), ``"sglang"`` when it has none."""
        return next((v for k, v in self.settings if k == SOURCE_KEY), RunSource.SGLANG.value)

    @property
    def tensor_parallel(self) -> TensorParallel:
        """The run's tensor parallelism, from its :data:`TP_KEY` setting (TP=1 without one).

        Raises:
            StoreError: a setting that does not parse (the run's row is damaged).
        """
        text = next((v for k, v in self.settings if k == TP_KEY), "")
        try:
            return TensorParallel.from_setting(text) if text else TensorParallel.single()
        except ValueError as exc:
            msg = f"run {self.run_id!r}: {exc}"
            raise StoreError(msg) from exc
