"""The ports, in domain vocabulary only (plain values; no torch, SGLang or ClickHouse).

* :class:`RecordReader`: reads records and manifests back per (run, request).
* :class:`CaptureTransport`: moves captured tensors from the GPU to the sink, step by step.
* :class:`CaptureSession`: one run's capture inside one scheduler process, as the SGLang
  adapter's runtime hooks drive it (steps, requests, stop).
* :class:`TrackedRequest`: what the capture session reads of an engine's request.
* :class:`CaptureSpec`: what an SGLang adapter knows when it asks for a capture pipeline.
* :class:`EngineTap`: the monitored engine's side of the app (attach check, final stop).
* :class:`ReferenceModel`: a model run outside SGLang (transformers on CPU) whose forwards
  hand over what the capture points would see, as :class:`ReferenceForward` values.

The record sink, which takes numpy columns, is :class:`dmi_sglang.columns.RecordSink`.
Interfaces that must speak torch tensors (what capture points call, and the factory
that returns them) live in :mod:`dmi_sglang.tensor_ports`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Literal, Protocol, get_args, runtime_checkable

import attrs

from dmi_sglang.domain.capacity import Preflight
from dmi_sglang.domain.hooks import ModelHooks, Selection
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.plan import CommitPlan
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo
from dmi_sglang.domain.settings import Settings
from dmi_sglang.domain.shapes import DType, ModelShape
from dmi_sglang.errors import ConfigurationError

__all__ = [
    "HOOK_PARTS",
    "CaptureReads",
    "CaptureSession",
    "CaptureSpec",
    "CaptureTransport",
    "ClaimOutcome",
    "EngineTap",
    "HookPart",
    "HookTotal",
    "RecordReader",
    "ReferenceForward",
    "ReferenceModel",
    "RequestExtents",
    "RequestSummary",
    "RowLayout",
    "RunClaims",
    "StoredRange",
    "TrackedRequest",
    "TransportStats",
]


@attrs.frozen
class RequestSummary:
    """A request's footprint in the store."""

    run_id: str
    request_id: str
    records: int
    """The request's records in the store, every hook and layer."""
    bytes: int

    @property
    def rows(self) -> int:
        """Deprecated name of :attr:`records` (a request's records were once called rows,
        which elsewhere means a tensor's token positions)."""
        return self.records


@attrs.frozen
class HookTotal:
    """One captured hook's footprint in a run (every layer together)."""

    act_name: str
    layers: int
    records: int
    rows: int
    bytes: int


@attrs.frozen
class RowLayout:
    """The dtype and row shape one hook and layer of a request were stored with."""

    act_name: str
    layer_no: int
    dtype: str
    row_shape: tuple[int, ...]


StoredRange = tuple[str, int, int, int, int]
"""``(act_name, layer_no, shard_rank, start, end)`` of stored records."""


@attrs.frozen
class RequestExtents:
    """What a request's stored records cover, without their payloads: what an export
    needs before its first byte, from one pass over the store.

    Attributes:
        ranges: the distinct :data:`StoredRange` of its records, sorted.
        layouts: per stored ``(act_name, layer_no)``, the dtype and row shape of one of
            its records, by act_name, then layer.
    """

    ranges: tuple[StoredRange, ...]
    layouts: tuple[RowLayout, ...]
    mixed: tuple[tuple[str, int], ...] = ()
    """The ``(act_name, layer_no)`` whose records (of any part) name more than one dtype
    or row shape: a damaged store, whose rows or parts cannot be joined."""

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[str, int, int, int, int, str, Sequence[int]]],
                  ) -> RequestExtents:
        """From ``(act_name, layer_no, shard_rank, start, end, dtype, row_shape)`` rows,
        one or more per stored range (a layout is taken from the first row of its
        ``(act_name, layer_no)`` in sorted order)."""
        ranges: set[StoredRange] = set()
        layouts: dict[tuple[str, int], RowLayout] = {}
        mixed: set[tuple[str, int]] = set()
        for act, layer, shard, start, end, dtype, row_shape in sorted(
                rows, key=lambda r: (r[0], r[1], r[2], r[3], r[4])):
            ranges.add((act, layer, shard, start, end))
            layout = RowLayout(act, layer, dtype, tuple(row_shape))
            first = layouts.setdefault((act, layer), layout)
            if (first.row_shape != layout.row_shape
                    or _dtype_key(first.dtype) != _dtype_key(layout.dtype)):
                mixed.add((act, layer))
        return cls(tuple(sorted(ranges)), tuple(layouts[k] for k in sorted(layouts)),
                   tuple(sorted(mixed)))


def _dtype_key(name: str) -> str:
    """A stored dtype name in one spelling (an unknown name as it is)."""
    try:
        return DType.parse(name).value
    except ConfigurationError:
        return name


@runtime_checkable
class RecordReader(Protocol):
    """**Port**: reads captures back. Opens the store per call and closes it after, unless
    the calls run inside :meth:`session`."""

    def session(self) -> AbstractContextManager[RecordReader]:
        """Keep the store open for the calls inside the block (re-entrant)."""
        ...

    def runs(self) -> Sequence[RunInfo]:
        """Every run in the store, newest first."""
        ...

    def requests(self, run_id: str) -> Sequence[RequestSummary]:
        """Requests of a run with their sizes."""
        ...

    def run(self, run_id: str) -> RunInfo | None:
        """One run's latest state, or None when the store has no such run."""
        ...

    def manifest(self, run_id: str, request_id: str) -> RequestManifest | None:
        """The request's manifest, or None when the run never wrote one."""
        ...

    def manifests(self, run_id: str) -> Sequence[RequestManifest]:
        """The latest manifest of each request of a run that has one."""
        ...

    def records(
        self,
        run_id: str,
        request_id: str,
        *,
        act_name: str | None = None,
        layer_no: int | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> Sequence[CaptureRecord]:
        """Stored records of a request, optionally of one hook / layer, optionally only
        those overlapping positions ``[start, end)``; superseded copies included."""
        ...

    def ranges(self, run_id: str,
               request_id: str) -> Sequence[tuple[str, int, int, int, int]]:
        """Distinct ``(act_name, layer_no, shard_rank, start, end)`` of a request's stored
        records, without payloads (cheap completeness checks)."""
        ...

    def extents(self, run_id: str, request_id: str) -> RequestExtents:
        """A request's stored ranges and row layouts, without payloads, in one pass (an
        export's completeness check and header)."""
        ...

    def hook_totals(self, run_id: str) -> Sequence[HookTotal]:
        """Per stored act_name of a run, its footprint, by act_name."""
        ...

    def delete_run(self, run_id: str) -> int:
        """Delete a run's records, manifests and run row; returns records deleted."""
        ...


class CaptureReads(Protocol):
    """**Port**: what a serving process reads back of its store for its HTTP clients,
    as plain values: JSON-ready listings and a request's captures as a safetensors
    stream, read piece by piece (memory bounded by one piece, see ``app.export``).

    Errors: ``NotInStoreError`` for a run or request the store does not hold,
    ``IncompleteCaptureError`` for a capture that is not complete (its listing says
    why), ``StoreError`` when the store cannot be read.
    """

    def runs(self) -> list[dict[str, object]]:
        """Every run of the store, newest first."""
        ...

    def requests(self, run_id: str) -> list[dict[str, object]]:
        """The requests a run stored, with their sizes and whether each is complete."""
        ...

    def listing(self, run_id: str, request_id: str) -> dict[str, object]:
        """One request: completeness (and why not), lengths, and per tensor its name,
        hook, layer, dtype, shape and positions."""
        ...

    def safetensors(self, run_id: str,
                    request_id: str) -> tuple[int, Iterator[bytes | memoryview]]:
        """A complete request's captures as one safetensors file: its length in bytes
        and its pieces in order (the header first; nothing is read until iterated), each
        ``bytes`` or a byte ``memoryview`` (a piece is not copied once more to be bytes)."""
        ...


@attrs.frozen
class ClaimOutcome:
    """What claiming a run id found: ``won``, or the run (or claim) that holds the id."""

    won: bool
    existing: RunInfo | None = None
    """The stored run of that id, when there is one (None: claimed, no run recorded)."""


@runtime_checkable
class RunClaims(Protocol):
    """**Port**: run ids are claimed in the store before an engine starts, so that one id
    names exactly one run. Of two starts racing for an id, exactly one wins."""

    def claim(self, run_id: str) -> ClaimOutcome:
        """Claim ``run_id`` for a new run, unless a run or a claim of it exists."""
        ...

    def claimed(self, run_id: str) -> bool:
        """Whether ``run_id`` is claimed."""
        ...

    def release(self, run_id: str) -> None:
        """Drop the claim of ``run_id`` (idempotent)."""
        ...


@attrs.frozen
class TransportStats:
    """Per-run statistics of a capture transport.

    Attributes:
        steps: forwards committed with at least one capture.
        tensors: captured tensors.
        rows / bytes: rows and bytes handed to the sink.
        ring_high_water: most payload bytes in flight at once.
        stalls / stall_seconds: times a step waited for the drain, and for how long.
        piecewise_stall_seconds: of ``stall_seconds``, the waits of piecewise steps'
            parts (prefills larger than the ring's free space).
        forced_eager: decode steps run eagerly because their padded plan did not fit.
        piecewise_steps: eager steps committed tensor by tensor.
        discarded_logit_rows: ``final_logits`` rows not stored because they decided no
            generated token (the overlap scheduler's extra forward of a finished request).
        fp16_overflows: values a ``fp16`` storage dtype turned infinite (beyond
            +-65504), counted on the device at the capture points (known at stop).
        capture_seconds: seconds the forward's thread spent in the capture points
            themselves: eager forwards (prefill, eager decode) and the recording of
            decode graphs at startup; a graph replay runs none. Not part of the
            hooks' own time a session reports.
    """

    steps: int = 0
    tensors: int = 0
    rows: int = 0
    bytes: int = 0
    ring_high_water: int = 0
    stalls: int = 0
    stall_seconds: float = 0.0
    piecewise_stall_seconds: float = 0.0
    forced_eager: int = 0
    piecewise_steps: int = 0
    discarded_logit_rows: int = 0
    fp16_overflows: int = 0
    capture_seconds: float = 0.0


@runtime_checkable
class CaptureTransport(Protocol):
    """**Port**: per-step commits in, records out to a :class:`RecordSink`.

    The tensor-level side (capture points the model calls) is
    :class:`dmi_sglang.tensor_ports.Capturer`; this is the step protocol the capture
    session drives.
    """

    @property
    def device_bytes(self) -> int:
        """Device memory the transport holds (ring and arena)."""
        ...

    def preflight(self, plan: CommitPlan,
                  eager_plan: Callable[[], CommitPlan] | None = None) -> Preflight:
        """How the step would be committed now (see :func:`~.capacity.preflight`);
        ``eager_plan`` makes the unpadded plan of a graph step, only when it is needed."""
        ...

    def commit(self, plan: CommitPlan, *, step: int) -> None:
        """Reserve ring space for the step (waiting for the drain as needed)."""
        ...

    def seal(self) -> None:
        """The forward finished: hand the step to the drain."""
        ...

    def abort(self) -> None:
        """The forward raised: free the open step without storing it (none open: a
        no-op)."""
        ...

    def uncommitted_replay(self) -> None:
        """A decode graph is about to replay with no committed step (between steps)."""
        ...

    def abandon(self) -> None:
        """The run failed (between steps, on the scheduler's thread): read nothing more
        from the device (later replays may write what a read would race with); a later
        :meth:`stop` still hands the sink what the drain holds."""
        ...

    def stop(self) -> TransportStats:
        """Terminal, idempotent: drain everything, flush the sink, raise any failure."""
        ...

    def stats(self) -> TransportStats:
        """Statistics so far."""
        ...

    def settle(self) -> None:
        """Between steps, with no forward to follow soon: hand finish notices that wait
        for the next commit (the ``last`` rule's slot reads) to the drain now, when that
        cannot wait. Never raises (a failure is reported by ``stop``)."""
        ...

    def finish_request(self, request_id: str, logits_end: int | None,
                       manifest: RequestManifest | None = None) -> None:
        """A request finished: its ``final_logits`` rows at positions ``>= logits_end``
        decided no generated token (None: keep every row). With ``manifest`` (it
        finished cleanly), the sink commits the request once every row of it is
        stored (``RecordSink.commit_requests``), while the run goes on."""
        ...

    def undelivered_manifests(self) -> list[RequestManifest]:
        """The manifests :meth:`finish_request` was given that the sink has not taken
        (``commit_requests`` did not return yet, or never will: the run failed first).
        A failed run's record writes them uncommitted (none of them was handed on)."""
        ...

    def drain_counters(self) -> Mapping[str, float]:
        """Where the drain's time went so far (seconds and counts, by name)."""
        ...

    @property
    def failure(self) -> Exception | None:
        """The transport's sticky failure as the error ``stop`` would raise (None while
        it works): cheap, for an idle engine to learn it without a forward."""
        ...


class TrackedRequest(Protocol):
    """What the capture session reads of an engine's request (SGLang's ``Req``)."""

    @property
    def rid(self) -> str:
        """The request id."""
        ...

    @property
    def origin_input_ids(self) -> Sequence[int]:
        """The prompt's token ids."""
        ...

    @property
    def output_ids(self) -> Sequence[int]:
        """The generated token ids so far."""
        ...

    def finished(self) -> bool:
        """True once the request generated its last token."""
        ...


@attrs.frozen
class CaptureSpec:
    """What the SGLang adapter hands the capture factory in a scheduler, before weights load.

    Attributes:
        settings: the resolved settings (run id, store, ring sizes, ...).
        run: the run's row, written when the capture opens.
        selection / shape: the resolved hook selection and the model's row shapes.
        max_graph_batch: the largest decode CUDA-graph batch (1 without graphs).
        device: the scheduler's device (``"cuda:N"``; ``"cpu"`` in tests).
        max_prefill_tokens: the longest prefill chunk (startup capacity check).
        max_requests: the most requests in one forward (startup capacity check).
        read_address: see the attribute.
    """

    settings: Settings
    run: RunInfo
    selection: Selection
    shape: ModelShape
    max_graph_batch: int
    device: str
    max_prefill_tokens: int
    max_requests: int
    read_address: str = ""
    """Where the store's owner answers a server's reads (an IPC address the server's main
    process chose); empty: no server reads through it."""


HookPart = Literal["requests", "begin", "preflight", "commit", "end"]
"""A hook of a decode graph step: the worker's batch hook, the forward's start, the
graph's preflight (the batch read into a layout included), its commit, the seal after
the forward."""
HOOK_PARTS: tuple[HookPart, ...] = get_args(HookPart)
"""The :data:`HookPart` values, in the order a step runs them."""


@runtime_checkable
class CaptureSession(Protocol):
    """**Port**: one run's capture in one scheduler process.

    The SGLang adapter's runtime hooks drive it, once per forward: ``begin_forward``;
    for a decode graph step ``graph_allowed`` (preflight; False runs it eagerly) and
    ``commit_graph(graph_plan(...))``; for an eager step ``commit_eager``; then
    ``end_forward`` (or ``abort_forward`` when the forward raised). ``stop`` is the
    authoritative flush.
    """

    @property
    def run(self) -> RunInfo:
        """The run this session captures."""
        ...

    @property
    def active(self) -> bool:
        """True until the session stopped."""
        ...

    @property
    def unfinished(self) -> frozenset[str]:
        """Requests of the batch about to run whose prompt chunk does not finish it."""
        ...

    def idle(self) -> None:
        """The engine has no batch to run: report the requests that finished since the
        last forward (their commits need not wait for another forward). Raises the
        capture's failure at the first idle that finds it (a server then ends the
        capture without waiting for a forward), not at the later ones."""
        ...

    @property
    def refusal(self) -> str | None:
        """Why new requests are not captured now (the store reached its cap, or its disk
        runs short); None while they are."""
        ...

    def add_requests(self, reqs: Iterable[TrackedRequest], unfinished: frozenset[str]) -> None:
        """The engine is about to run a batch of these requests."""
        ...

    def add_host_seconds(self, seconds: float, *, before_forward: bool = False,
                         part: HookPart | None = None) -> None:
        """Count scheduler-thread time the adapter's hooks spent for the capture;
        ``before_forward``: spent for the next forward before its commit (the batch
        hook, part ``requests``), so counted with that forward's kind once it is
        committed; ``part``: which hook of the forward spent it, counted apart for
        decode graph steps (without one, in the sum only)."""
        ...

    def requests_dropped(self, reqs: Iterable[TrackedRequest]) -> None:
        """The engine let these requests go without finishing them (an abort of a
        request waiting to run): each is reported ended, never complete, at the next
        forward or idle; requests that finished, or never ran, are ignored."""
        ...

    def begin_forward(self) -> int:
        """A forward starts; returns its step number."""
        ...

    def in_forward(self) -> bool:
        """True between :meth:`begin_forward` and :meth:`end_forward`."""
        ...

    def graph_allowed(self, layout: BatchLayout, padded_bs: int) -> bool:
        """Preflight a decode graph step; False: run it eagerly."""
        ...

    def graph_plan(self, padded_bs: int, layout_of: Callable[[], BatchLayout]) -> CommitPlan:
        """The padded plan of this decode step."""
        ...

    def commit_graph(self, plan: CommitPlan) -> None:
        """The graph runner fixed the padded batch: commit its plan."""
        ...

    def commit_eager(self, layout: BatchLayout) -> None:
        """The eager runner fixed the batch: commit the unpadded plan."""
        ...

    def end_forward(self) -> None:
        """The forward returned: seal the step."""
        ...

    def abort_forward(self) -> None:
        """The forward raised: forget the step."""
        ...

    def uncommitted_replay(self) -> None:
        """A decode graph is about to replay outside a captured forward: what its
        recorded capture writes must land nowhere that matters."""
        ...

    def stop(self) -> TransportStats:
        """Drain, flush, write manifests and the run status; terminal and idempotent."""
        ...

    def fail(self, error: BaseException) -> None:
        """End the capture as failed with ``error`` (between steps, on the scheduler's
        thread, which it does not hold up): what was captured is flushed where the store
        still takes it, and the run recorded failed with no request complete, on a side
        thread. Terminal; a later :meth:`stop` waits a while for that record, then raises
        ``error``. Never raises itself."""
        ...

    def timing(self, stats: TransportStats) -> Mapping[str, float]:
        """Where the run's time went (for the stop log and benchmarks)."""
        ...


class EngineTap(Protocol):
    """**Port**: the app's handle on monitoring inside a running engine."""

    def assert_active(self, run_id: str) -> None:
        """Raise unless monitoring attached in every scheduler for ``run_id``.

        Raises:
            CaptureError: with the scheduler's reason (never a bare AssertionError).
        """
        ...

    def stop_monitoring(self) -> None:
        """The authoritative flush; terminal; a failure stays failed.

        Raises:
            CaptureError: with the scheduler's reason (never a bare AssertionError).
        """
        ...


@attrs.frozen
class ReferenceForward:
    """One forward of a :class:`ReferenceModel` for one request.

    Attributes:
        start: the first position the forward computed (0 for the prompt's forward).
        tokens: the token ids it forwarded, one row each (positions ``start`` onwards).
        next_token: the token its logits decided (greedy).
        payloads: per selected ``(hook name, layer_no)`` (``layer_no = -1`` for global
            hooks), the raw rows the capture point saw, as
            :meth:`~dmi_sglang.domain.shapes.ModelShape.row` lays them out: one row per
            forwarded token for token-row hooks, one row (the next-token logits) for
            ``final_logits``.
    """

    start: int
    tokens: tuple[int, ...]
    next_token: int
    payloads: Mapping[tuple[str, int], bytes] = attrs.field(eq=False, repr=False)


class ReferenceModel(Protocol):
    """**Port**: a model run outside SGLang for a reference capture (transformers on CPU).

    It offers the catalog's hooks under the same names and row shapes as the hooked SGLang
    model; which rows are stored is decided by the domain's plan, not by the model.
    """

    @property
    def model_path(self) -> str:
        """The model directory it loaded."""
        ...

    @property
    def description(self) -> str:
        """What runs it (libraries, device, dtype), for the runs table."""
        ...

    @property
    def hooks(self) -> ModelHooks:
        """The hooks it offers and its number of layers."""
        ...

    @property
    def shape(self) -> ModelShape:
        """Its row shapes and dtypes."""
        ...

    def encode(self, prompt: str) -> Sequence[int]:
        """A prompt's token ids, as the serving engine would tokenize it."""
        ...

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 selection: Selection) -> Iterator[ReferenceForward]:
        """Greedy generation of one request: the prompt's forward, then one forward per
        generated token that is fed back, until ``max_new_tokens`` tokens or an end of
        sequence token were decided (the last decided token is never forwarded)."""
        ...
