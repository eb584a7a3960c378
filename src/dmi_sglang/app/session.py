"""One run's capture inside one SGLang scheduler process: steps, requests, stop.

Version-neutral: it imports only the domain, and reaches the transport and the sink
through their ports. One :class:`SchedulerMonitor` (the
:class:`~dmi_sglang.domain.ports.CaptureSession` implementation) exists per monitored
scheduler process; the composition root builds it and the SGLang adapter's runtime hooks
drive it:

* ``ModelRunner.forward`` (around): :meth:`begin_forward` / :meth:`end_forward`;
* the decode graph runner's ``can_run_graph`` (around): :meth:`graph_allowed` (preflight
  of the padded step; a step that cannot fit runs eagerly);
* the graph / eager runner's ``load_batch`` (after): :meth:`commit_graph` /
  :meth:`commit_eager`;
* the worker's ``forward_batch_generation`` (around): :meth:`add_requests`, so the stop
  call knows each request's prompt and completion lengths for the manifest;
* the Scheduler RPC ``dmi_stop_monitoring``: :meth:`stop`.

Finished requests are reported to the transport (``finish_request``) at the start of
the next forward: with the overlap scheduler a request gets one extra decode forward
after its last generated token, and the ``final_logits`` row of that forward decides a
token that is never generated. The scheduler only learns that a request finished after
that forward was launched, so the transport holds each request's newest logits row back
until the next one arrives or the notice says where the request's decisions end
(``prompt + completion - 1``). ``stop`` notifies every request before the transport
stops (unfinished ones keep everything).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

import attrs
import structlog

from dmi_sglang.app.gc_pauses import GcPauses
from dmi_sglang.columns import RecordSink
from dmi_sglang.domain.capacity import Decision
from dmi_sglang.domain.hooks import Selection
from dmi_sglang.domain.layout import BatchLayout, ForwardKind
from dmi_sglang.domain.plan import CommitPlan, StepProtocol, StepState, make_plan
from dmi_sglang.domain.ports import (
    HOOK_PARTS,
    CaptureTransport,
    HookPart,
    TrackedRequest,
    TransportStats,
)
from dmi_sglang.domain.records import RequestManifest, RunInfo, RunStatus, storable_request_id
from dmi_sglang.domain.sampling import RequestSample
from dmi_sglang.domain.shapes import ModelShape
from dmi_sglang.errors import CaptureError
from dmi_sglang.threads import OsNamedThread

__all__ = ["RequestTracker", "SchedulerMonitor"]

log = structlog.get_logger(__name__)


@attrs.define
class _Seen:
    req: TrackedRequest | None
    first_start: int
    last_end: int
    notified: bool = False
    lengths: tuple[int, int] | None = None
    """``(prompt, completion)`` kept when the request finished (its Req is let go)."""
    captured: bool = True
    """False for a request the capture leaves out (request sampling, or its own ask)."""
    decided: bool = False
    cancelled: bool = False
    """The engine ended it by an abort (kept when its Req is let go)."""
    committed: bool = False
    """Its committed manifest went to the transport when it finished (see
    :meth:`RequestTracker.handed_over`): the stop writes no other."""


def _not_asked(_req: TrackedRequest) -> object:
    return None


def _reference(req: TrackedRequest) -> weakref.ref[TrackedRequest] | int:
    """A reference to ``req`` that does not keep it alive: a weak one where its class
    admits it (SGLang's ``Req`` does), else its ``id``."""
    try:
        return weakref.ref(req)
    except TypeError:
        return id(req)


def _refers_to(held: weakref.ref[TrackedRequest] | int | None, req: TrackedRequest) -> bool:
    if held is None:
        return False
    return held() is req if isinstance(held, weakref.ref) else held == id(req)


def _always_open() -> str | None:
    return None


def _never_cancelled(_req: TrackedRequest) -> bool:
    return False


FAIL_RECORD_WAIT_S = 10.0
"""How long :meth:`SchedulerMonitor.stop` waits for a failed run's record before raising
(under the 15 s SGLang's server gives its schedulers to shut down)."""

_LEAVING_ROUNDS = 2
"""Rounds (forwards that start with finished requests reported) a left-out request stays
left out after it was seen finished."""


def logits_end(req: TrackedRequest) -> int:
    """One past the last position whose ``final_logits`` row decided a generated token:
    ``prompt + completion - 1`` (the row at position p decides token p + 1)."""
    return len(req.origin_input_ids) + len(req.output_ids) - 1


class RequestTracker:
    """Requests seen by forwards, for the manifest written at stop.

    Holds SGLang's ``Req`` objects (prompt and output ids) of the live requests, the
    lengths of the finished captured ones (their Req objects are let go, so a long
    serving run keeps a small record per captured request, and nothing of a left-out one
    once its grace rounds passed), and the positions our forwards computed:
    the first position (prefix-cache hits start later) and one past the last (the
    overlap scheduler forwards the last generated token once more).
    """

    def __init__(self, sample: RequestSample | None = None,
                 asked: Callable[[TrackedRequest], object] = _not_asked,
                 cancelled: Callable[[TrackedRequest], bool] = _never_cancelled,
                 gate: Callable[[], str | None] = _always_open) -> None:
        self._sample = sample if sample is not None else RequestSample()
        self._asked = asked
        self._cancelled = cancelled
        self._gate = gate
        self.refused_requests = 0
        """Requests the capture would have taken but the gate refused (store full)."""
        self.refusal: str | None = None
        """Why the gate refused the latest new request (None: it did not)."""
        self.cancelled_requests = 0
        """Captured requests the engine ended by an abort, or whose id a new request
        took while they ran: never complete."""
        self._skipped: set[str] = set()
        self._skip: frozenset[str] = frozenset()
        self._leaving: collections.deque[tuple[int, str]] = collections.deque()
        """Left-out requests reported finished, with the round they were: they stay left
        out for :data:`_LEAVING_ROUNDS` more rounds (a batch built before a request
        finished may still forward it)."""
        self._round = 0
        self._recent: collections.deque[tuple[int, str]] = collections.deque()
        """Requests reported finished in the last :data:`_LEAVING_ROUNDS` rounds (a batch
        built before one finished may forward that same Req object once more)."""
        self._recent_reqs: dict[str, weakref.ref[TrackedRequest] | int] = {}
        """... by id: a weak reference to (or the ``id`` of) the finished Req object."""
        self.reused_requests = 0
        """Requests that came with the id of an earlier one (not captured)."""
        self._reused: set[str] = set()
        """Their ids: left out for the rest of the run."""
        self.seen_requests = 0
        """Requests seen so far."""
        self._odd_asked_told = False
        """A request asked with a value other than true / false (logged once)."""
        self.captured_requests = 0
        """Of those, the requests captured (the others: sampled out or asked not to be)."""
        self._seen: dict[str, _Seen] = {}
        self._live: dict[str, _Seen] = {}
        """Requests with a Req object and no finish notice yet (scanned every forward)."""
        self._decoding: BatchLayout | None = None
        """The newest decode layout not folded into ``_seen`` yet: consecutive decode
        forwards of the same requests (the same ``request_ids`` tuple, which the adapter
        reuses while the batch is unchanged) only move one position further, so only the
        newest one's ends matter (the run's first was folded)."""
        self._batch: list[TrackedRequest] = []
        """The Req objects of the batch :meth:`add_reqs` was given last (let go once it
        holds a finished one)."""
        self._running: frozenset[int] = frozenset()
        """The ``id`` of each Req of the batch :meth:`add_reqs` was given last (alive while
        it runs: the engine holds them): a finished one among them runs once more."""
        self._given = False
        """:meth:`add_reqs` was called since the last :meth:`take_finished`."""
        self._changed = False
        """... with a batch other than the one before, at least once."""
        self._dropped: list[tuple[str, TrackedRequest]] = []
        """Live requests the engine let go unfinished (:meth:`dropped`), to report."""
        self._known: dict[int, TrackedRequest] = {}
        """Req objects already remembered and not finished, by ``id`` (each is held here,
        so its id is not reused while it is): a batch's known requests cost one lookup."""

    def add_reqs(self, reqs: Iterable[TrackedRequest]) -> None:
        """Remember the scheduler's Req objects of a batch about to run.

        The batch of the forward before, again (a running decode batch), costs one
        comparison in C; it also tells :meth:`take_finished` that no request finished
        since (see there). ``reqs`` must be exactly the batch about to run: a caller
        that passes every live request instead never changes its batch, so it would get
        no finishes before stop."""
        batch = reqs if type(reqs) is list else list(reqs)
        self._given = True
        if batch == self._batch:  # identity first: the same Req objects, in C
            return
        self._batch, self._changed = batch.copy(), True  # the engine's list changes in place
        self._running = frozenset(map(id, batch))
        known = self._known
        # Every Req already known (a batch that lost some): one pass in C. ``known`` holds
        # each of its Req objects alive, so an id found there is that same object's.
        if known.keys() >= set(map(id, batch)):
            return
        for req in batch:
            if known.get(id(req)) is req:
                continue
            rid = storable_request_id(req.rid)
            seen = self._seen.get(rid)
            if seen is None:
                seen = self._seen[rid] = _Seen(req, 1 << 62, 0)
            elif seen.notified:
                self._batch = []  # hold no finished Req
                if not _refers_to(self._recent_reqs.get(rid), req):  # a new request
                    self._refuse_reused(rid)
                continue  # the overlap scheduler's extra forward of a finished request
            elif seen.req is not None and seen.req is not req:  # its finish not taken yet
                if not seen.req.finished():  # the first still runs: its capture ends here
                    self._end_capture_of(rid, seen)
                    self._refuse_reused(rid, told=True)
                else:
                    self._refuse_reused(rid)
                continue
            else:
                seen.req = req
            if not seen.decided:
                self._decide(rid, seen, req)
            known[id(req)] = req
            self._live[rid] = seen

    def dropped(self, reqs: Iterable[TrackedRequest]) -> None:
        """The engine let these Req objects go without finishing them (SGLang's abort
        of a request in its waiting queue, a retracted one say): those this tracker holds
        live are reported by the next :meth:`take_finished`, ended by an abort (never
        complete). Finished ones are left to ``finished()``."""
        for req in reqs:
            rid = storable_request_id(req.rid)
            seen = self._live.get(rid)
            if seen is not None and seen.req is req and not req.finished():
                self._dropped.append((rid, req))
                self._changed = True  # the next take_finished looks, batch changed or not

    def gate_refusal(self) -> str | None:
        """What the store gate says now (None: new requests may be captured)."""
        return self._gate()

    def _end_capture_of(self, rid: str, seen: _Seen) -> None:
        """A request still running whose id a new request took (SGLang forgets a streamed
        request whose client went away while the scheduler runs it on): rows carry only
        the id, so neither is captured from here on, and the first's capture, cut short,
        is never complete (its manifest is not committed)."""
        if seen.captured and not seen.cancelled:
            seen.cancelled = True
            self.cancelled_requests += 1
            log.warning("dmi.request_id_taken_while_running", request_id=rid,
                        why="a new request came with the id of one still running; the "
                        "running one's capture ends incomplete, the new one is not captured")

    def _refuse_reused(self, rid: str, *, told: bool = False) -> None:
        """A request arrived with the id of one that finished (SGLang admits an id again
        once its request finished): it is not captured, so the finished request's
        capture, committed under that id, never changes. ``told``: the caller logged
        why already (the first request still ran)."""
        if rid in self._reused:
            return
        if not told:
            log.warning("dmi.request_id_reused", request_id=rid,
                        why="a request of that id finished already; this one is not "
                        "captured")
        self.reused_requests += 1
        self._reused.add(rid)  # never leaves the skip set (see take_finished)
        self._skipped.add(rid)
        self._skip = frozenset(self._skipped)

    def _decide(self, rid: str, seen: _Seen, req: TrackedRequest) -> None:
        """Capture the request or leave it out, once, before its first planned forward
        (a request whose rows a forward already captured stays captured)."""
        self.seen_requests += 1
        seen.decided = True
        asked = self._asked(req)
        if asked is not None and not isinstance(asked, bool) and not self._odd_asked_told:
            self._odd_asked_told = True  # once a run: a client's habit, not a request's
            log.warning("dmi.capture_choice_ignored", request_id=rid, value=repr(asked)[:80],
                        why="custom_params['dmi_capture'] takes true or false (JSON "
                        "booleans); the request sample decides")
        seen.captured = seen.last_end > 0 or self._sample.decide(req.rid, asked)
        if seen.captured and seen.last_end == 0:
            refusal = self._gate()
            if refusal is not None:
                seen.captured = False
                self.refused_requests += 1
                if self.refusal is None:
                    log.warning("dmi.capture_paused", reason=refusal)
            elif self.refusal is not None:
                log.info("dmi.capture_resumed")
            self.refusal = refusal
        if seen.captured:
            self.captured_requests += 1
        else:
            self._skipped.add(rid)
            self._skip = frozenset(self._skipped)

    def prompt_length(self, request_id: str) -> int | None:
        """The prompt length of a request seen (None: never seen)."""
        seen = self._seen.get(request_id)
        if seen is None:
            return None
        if seen.req is not None:
            return len(seen.req.origin_input_ids)
        return seen.lengths[0] if seen.lengths is not None else None

    @property
    def skipped(self) -> frozenset[str]:
        """Live requests the capture leaves out (their rows are never copied)."""
        return self._skip

    def take_finished(self) -> list[tuple[str, int | None]]:
        """Requests that finished since the last call, with :func:`logits_end`; each is
        reported once. O(live requests): one ``finished()`` call each, skipped when
        :meth:`add_reqs` was given only the batch it had before since the last call: a request
        finishes only by a forward it is in, and the engine drops a finished request
        from its batch (SGLang's ``filter_batch``) before the batch runs again, so an
        unchanged batch means the finishes it brought were taken already."""
        self._next_round()
        given, changed = self._given, self._changed
        self._given = self._changed = False
        if given and not changed:
            return []
        # A finished request in the batch about to run is forwarded once more (a batch
        # built before its result was processed: the overlap scheduler's extra forward,
        # or a mixed chunk when consecutive prefills do not overlap): reported after it.
        done = [(rid, seen.req) for rid, seen in self._live.items()
                if seen.req is not None and seen.req.finished()]
        deferred = False
        if done and given:  # else the batch given last ran already
            running = self._running
            kept = [(rid, req) for rid, req in done if id(req) not in running]
            deferred, done = len(kept) < len(done), kept
        if deferred:
            self._changed = True  # the next call looks again, the batch changed or not
        elif done:
            self._batch = []  # hold no finished Req
        out: list[tuple[str, int | None]] = []
        dropped, self._dropped = self._dropped, []
        for rid, req in dropped:  # their capture ended by an abort
            seen = self._live.get(rid)
            if seen is not None and seen.req is req:  # not reported already
                self._let_go(rid, req, out, aborted=True)
        for rid, req in done:
            self._recent.append((self._round, rid))
            self._recent_reqs[rid] = _reference(req)
            self._let_go(rid, req, out, aborted=False)
        return out

    def _let_go(self, rid: str, req: TrackedRequest, out: list[tuple[str, int | None]], *,
                aborted: bool) -> None:
        """A live request is reported: its Req is let go (its lengths kept), a captured
        one goes into ``out`` with :func:`logits_end` of the tokens it kept, a left-out one
        starts its grace rounds. ``aborted``: the engine let it go unfinished (never
        complete); else its finish reason says whether an abort ended it."""
        seen = self._live.pop(rid)
        seen.notified = True
        seen.lengths = (len(req.origin_input_ids), len(req.output_ids))
        if aborted or self._cancelled(req):
            self._note_cancelled(seen)
        seen.req = None
        self._known.pop(id(req), None)
        if seen.captured:
            out.append((rid, logits_end(req)))
        else:
            self._leaving.append((self._round, rid))

    def _next_round(self) -> None:
        """One more round: forget the finished requests of rounds long gone, and let the
        left-out ones whose grace ended out of the skip set."""
        self._round += 1
        while self._recent and self._recent[0][0] <= self._round - _LEAVING_ROUNDS:
            self._recent_reqs.pop(self._recent.popleft()[1], None)
        if self._leaving and self._leaving[0][0] <= self._round - _LEAVING_ROUNDS:
            while self._leaving and self._leaving[0][0] <= self._round - _LEAVING_ROUNDS:
                rid = self._leaving.popleft()[1]
                if rid not in self._reused:
                    self._skipped.discard(rid)
                    # nothing of it was stored, so nothing under its id needs keeping: a
                    # long serving run that leaves most requests out stays bounded
                    seen = self._seen.get(rid)
                    if seen is not None and not seen.captured and seen.notified:
                        self._settle_decoding()  # a pending layout would bring it back
                        del self._seen[rid]
            self._skip = frozenset(self._skipped)

    def ran(self) -> None:
        """The batch given last ran and none is about to run (the engine is idle): its
        finished requests are reported at the next :meth:`take_finished`."""
        self._batch = []
        self._running = frozenset()
        self._changed = True

    def take_all(self) -> list[tuple[str, int | None]]:
        """Every request not reported yet (the run stops): finished ones with
        :func:`logits_end`, the others with None (keep everything)."""
        out: list[tuple[str, int | None]] = []
        for rid, seen in self._seen.items():
            if seen.notified or not seen.captured:
                continue
            seen.notified = True
            req = seen.req
            if req is not None and req.finished() and self._cancelled(req):
                self._note_cancelled(seen)
            out.append((rid, logits_end(req) if req is not None and req.finished() else None))
        self._live.clear()
        self._known.clear()
        self._batch = []
        self._running = frozenset()
        return out

    def _note_cancelled(self, seen: _Seen) -> None:
        """A captured request an abort ended: never complete, counted once."""
        if seen.captured and not seen.cancelled:
            seen.cancelled = True
            self.cancelled_requests += 1

    def add_layout(self, layout: BatchLayout) -> None:
        """Record the positions a forward computes."""
        pending = self._decoding
        decode = layout.kind is ForwardKind.DECODE
        if decode and pending is not None and layout.request_ids is pending.request_ids:
            self._decoding = layout
            return
        if pending is not None:
            self._fold(pending)
        self._fold(layout)
        self._decoding = layout if decode else None

    def _fold(self, layout: BatchLayout) -> None:
        seen_by_rid = self._seen
        for rid, start, count in zip(layout.request_ids, layout.starts, layout.counts,
                                     strict=True):
            seen = seen_by_rid.get(rid)
            if seen is None:
                seen = seen_by_rid[rid] = _Seen(None, 1 << 62, 0)
            if start < seen.first_start:  # noqa: PLR1730 - per request and forward: no call
                seen.first_start = start
            if start + count > seen.last_end:  # noqa: PLR1730
                seen.last_end = start + count

    def commit(self, run_id: str, request_id: str) -> RequestManifest | None:
        """The committed manifest of a captured request :meth:`take_finished` just
        reported, when it finished cleanly (None: cancelled, or not captured); once the
        caller handed it over (:meth:`handed_over`) it is left out of :meth:`manifests`.
        Call :meth:`fold_pending` first (once for all the requests of one report)."""
        seen = self._seen.get(request_id)
        if seen is None or not seen.captured or seen.lengths is None or seen.cancelled:
            return None
        prompt, completion = seen.lengths
        return self._manifest(run_id, request_id, seen, prompt, completion, committed=True)

    def handed_over(self, request_id: str) -> None:
        """The committed manifest :meth:`commit` made went to the transport: the stop
        writes no other (a failed run's record asks the transport for the ones the
        sink never took)."""
        self._seen[request_id].committed = True

    def _settle_decoding(self) -> None:
        """Fold the pending decode layout and let it go (the next one is folded whole)."""
        if self._decoding is not None:
            self._fold(self._decoding)
            self._decoding = None

    def fold_pending(self) -> None:
        """Fold the newest decode layout into the requests' positions (kept as the
        newest: folding twice changes nothing); :meth:`commit` reads them."""
        if self._decoding is not None:
            self._fold(self._decoding)

    def _manifest(self, run_id: str, rid: str, seen: _Seen, prompt: int, completion: int,
                  *, committed: bool) -> RequestManifest:
        return RequestManifest(
            model_id=run_id,
            request_id=rid,
            prompt_tokens=prompt,
            completion_tokens=completion,
            computed_from=min(seen.first_start, prompt),
            overlap_extra_forward=seen.last_end >= prompt + completion,
            committed=committed,
        )

    def manifests(self, run_id: str, *, committed: bool) -> list[RequestManifest]:
        """One manifest per request seen and not committed when it finished (see
        :meth:`commit`); finished requests only count as complete, and a cancelled one
        (ended by an abort) never does: its manifest is not committed."""
        self._settle_decoding()
        out = []
        for rid, seen in self._seen.items():
            req = seen.req
            if not seen.captured or seen.committed:
                continue
            if req is not None:
                prompt, completion = len(req.origin_input_ids), len(req.output_ids)
                finished = (bool(req.finished()) and not seen.cancelled
                            and not self._cancelled(req))
            elif seen.lengths is not None:
                (prompt, completion), finished = seen.lengths, not seen.cancelled
            else:
                continue
            out.append(self._manifest(run_id, rid, seen, prompt, completion,
                                      committed=committed and finished))
        return out


class SchedulerMonitor:
    """The :class:`~dmi_sglang.domain.ports.CaptureSession` of one scheduler process."""

    def __init__(
        self,
        *,
        run: RunInfo,
        selection: Selection,
        shape: ModelShape,
        transport: CaptureTransport,
        sink: RecordSink,
        strip: bool,
        sample: RequestSample | None = None,
        asked: Callable[[TrackedRequest], object] = _not_asked,
        cancelled: Callable[[TrackedRequest], bool] = _never_cancelled,
        gate: Callable[[], str | None] = _always_open,
    ) -> None:
        self._run = run
        self.selection = selection
        self.shape = shape
        self.transport = transport
        self.sink = sink
        self.strip = strip
        self.protocol = StepProtocol()
        self.requests = RequestTracker(sample, asked, cancelled, gate)
        self._prompts = self.requests.prompt_length if any(
            rule.needs_prompt for _, _, rule in selection.rules) else None
        self._lock = threading.Lock()
        self._stopped = False
        self._idle_failure_raised = False
        self._failure: BaseException | None = None
        self._failing: threading.Thread | None = None
        """Writes a failed run's record (:meth:`fail`)."""
        self._gc_timed = False
        """:attr:`gc_pauses` started (at the first batch of requests)."""
        self._preflighted: CommitPlan | None = None
        """The padded plan the preflight of this step built, reused by its commit."""
        self._previous_plan: CommitPlan | None = None
        """The plan made last: a decode step of the same requests reuses its structure."""
        self.unfinished: frozenset[str] = frozenset()
        """Requests of the batch about to run whose prompt chunk does not finish it."""
        self.host_seconds = 0.0
        """Scheduler-thread seconds spent in the runtime hooks' own work (layouts, plans,
        preflights, commits and seals), waits for ring space at commit included. Capture
        calls inside the forward (and a piecewise step's waits there) are not counted."""
        self.graph_forwards = 0
        """Forwards committed as decode graph replays (the others ran eagerly)."""
        self.host_graph_seconds = 0.0
        """The part of :attr:`host_seconds` spent for decode graph replays: their batch
        hooks, preflights, commits and seals (a step the preflight sent to run eagerly
        counts as eager)."""
        self.graph_parts: dict[HookPart, float] = dict.fromkeys(HOOK_PARTS, 0.0)
        """:attr:`host_graph_seconds` by the hook that spent it (the port's
        ``HOOK_PARTS``; time counted without a part is in the sum only)."""
        self._graph_step = False
        self._before_forward = 0.0
        """Seconds counted for the next forward before it was committed."""
        self.gc_pauses = GcPauses()
        """The process's garbage collections from the first batch of requests on, until
        the monitor stops (:meth:`timing`): not the engine's start, whose collections
        (SGLang 0.5.19 runs three around its CUDA-graph capture) serve no request."""
        self.stop_seconds: dict[str, float] = {}
        """The parts of :meth:`stop` that ran: ``transport`` (the drain emptied),
        ``finish_run`` (the sink's flush, manifests, run row and sync) and ``close`` (the
        sink closed: for an embedded store without a read channel, until its owner
        process said its store is closed). A failed stop logs the parts done and how long
        it ran since."""

    @property
    def run(self) -> RunInfo:
        """The run this session captures."""
        return self._run

    @property
    def active(self) -> bool:
        """True until the monitor stopped."""
        return not self._stopped

    @property
    def refusal(self) -> str | None:
        """Why a new request would not be captured now (the store gate, asked afresh);
        None while new requests are captured."""
        return self.requests.gate_refusal() if self.active else None

    def add_requests(self, reqs: Iterable[TrackedRequest], unfinished: frozenset[str]) -> None:
        """The worker is about to run a batch of these requests; ``unfinished`` are those
        whose prompt chunk does not finish them (their logits decide nothing yet)."""
        self.requests.add_reqs(reqs)
        self.unfinished = unfinished
        if not (self._gc_timed or self._stopped):
            self._gc_timed = True
            self.gc_pauses.start()

    def add_host_seconds(self, seconds: float, *, before_forward: bool = False,
                         part: HookPart | None = None) -> None:
        """Count scheduler-thread time the runtime hooks spent for the capture (see the
        port)."""
        self.host_seconds += seconds
        if before_forward:
            self._before_forward += seconds
        elif self._graph_step:
            self.host_graph_seconds += seconds
            if part is not None:
                self.graph_parts[part] += seconds

    def requests_dropped(self, reqs: Iterable[TrackedRequest]) -> None:
        """See the port: reported ended at the next forward or idle."""
        self.requests.dropped(reqs)

    # -- one forward -------------------------------------------------------------------
    def begin_forward(self) -> int:
        """A ``ModelRunner.forward`` starts."""
        if self._stopped:
            msg = "monitoring was stopped (dmi_stop_monitoring); this engine cannot capture more"
            raise CaptureError(msg)
        if not self.in_forward():
            self._report_finished()
        self._preflighted = None
        return self.protocol.begin()

    def _report_finished(self) -> None:
        """Hand the requests that finished since the last call to the transport, each
        with its committed manifest when it finished cleanly."""
        finished = self.requests.take_finished()
        if finished:
            run_id = self.run.run_id
            self.requests.fold_pending()
            for rid, end in finished:
                manifest = self.requests.commit(run_id, rid)
                self.transport.finish_request(rid, end, manifest)
                if manifest is not None:  # the transport took it (it raises when failed)
                    self.requests.handed_over(rid)

    def idle(self) -> None:
        """The engine has no batch to run: report what finished with the last one, and
        let the transport queue what waits for a commit (see the port).

        Raises:
            CaptureError: the transport failed (sticky; its drain or the store failed
                while the engine idled): raised at the first idle that finds it, so a
                server ends the capture and says so without waiting for a forward;
                later idles leave it to the stop or a forward.
        """
        if self._stopped or self.in_forward():
            return
        self.requests.ran()
        try:
            self._report_finished()
            self.transport.settle()
            failure = self.transport.failure
            if failure is not None:
                raise failure
            # a sink that learns its store failed without a call says so (the ClickHouse
            # sink's writers; the store owner's sink: an earlier call failed, or the
            # owner process ended)
            failed = getattr(self.sink, "failure", None)
            if isinstance(failed, Exception):
                msg = f"the capture's store failed: {failed}"
                raise CaptureError(msg) from failed
        except CaptureError:
            if self._idle_failure_raised:
                return
            self._idle_failure_raised = True
            raise

    def in_forward(self) -> bool:
        """True between :meth:`begin_forward` and :meth:`end_forward`."""
        return self.protocol.state is not StepState.IDLE

    def graph_allowed(self, layout: BatchLayout, padded_bs: int) -> bool:
        """Preflight a decode graph step; False makes SGLang run it eagerly."""
        layout = layout.with_padding(padded_bs)
        padded = self._plan(layout, padded=True)
        decision = self.transport.preflight(padded, lambda: self._plan(layout, padded=False))
        if decision.decision is Decision.RUN_EAGER:
            log.info("dmi.forced_eager", step=self.protocol.step, reason=decision.reason)
            self._graph_step = False
            return False
        self._graph_step = True  # the preflight's time: the graph step's
        self._preflighted = padded
        return True

    def graph_plan(self, padded_bs: int, layout_of: Callable[[], BatchLayout]) -> CommitPlan:
        """The padded plan of this decode step: the one its preflight built, else one
        from ``layout_of()`` (the step was not preflighted at this batch size)."""
        plan, self._preflighted = self._preflighted, None
        if plan is None or plan.batch.padded_batch_size != padded_bs:
            plan = self._plan(layout_of().with_padding(padded_bs), padded=True)
        return plan

    def commit_graph(self, plan: CommitPlan) -> None:
        """``DecodeCudaGraphRunner.load_batch`` fixed the padded batch: commit its plan."""
        self._graph_step = True
        self.host_graph_seconds += self._before_forward
        self.graph_parts["requests"] += self._before_forward
        self._before_forward = 0.0
        self._commit(plan)
        self.graph_forwards += 1

    def commit_eager(self, layout: BatchLayout) -> None:
        """``EagerRunner.load_batch`` fixed the batch: commit the unpadded plan."""
        self._graph_step = False
        self._before_forward = 0.0
        self._commit(self._plan(layout, padded=False))

    def _plan(self, layout: BatchLayout, *, padded: bool) -> CommitPlan:
        """The plan of a forward (padded: its decode graph replay): the captured
        requests' rows of the selected captures."""
        plan = self._previous_plan = make_plan(
            layout, self.selection, self.shape, padded=padded,
            strip=self.strip if padded else True, skip=self.requests.skipped,
            prompts=self._prompts, previous=self._previous_plan)
        return plan

    def _commit(self, plan: CommitPlan) -> None:
        self.requests.add_layout(plan.layout)
        self.protocol.commit(plan)
        self.transport.commit(plan, step=self.protocol.step)

    def end_forward(self) -> None:
        """The forward returned: seal the step for the drain."""
        self.protocol.end()
        self.transport.seal()

    def abort_forward(self) -> None:
        """The forward raised: forget the step, and free what the transport reserved for
        it (the exception propagates)."""
        self.protocol.abort()
        self.transport.abort()

    def uncommitted_replay(self) -> None:
        """A decode graph is about to replay outside a captured forward (SGLang ran a
        forward the session does not capture): its recorded capture writes go nowhere
        that matters."""
        self.transport.uncommitted_replay()

    # -- stop --------------------------------------------------------------------------
    def stop(self) -> TransportStats:
        """Drain, flush, write manifests and the run status; terminal and idempotent.

        Raises:
            CaptureError: the first failure, again on every later call.
        """
        failing = self._failing
        if failing is not None:  # a failure's record is being written: give it a while
            failing.join(FAIL_RECORD_WAIT_S)
        with self._lock:
            if self._failure is not None:
                raise CaptureError(str(self._failure)) from self._failure
            if self._stopped:
                return self.transport.stats()
            self._stopped = True
            stopped_at = datetime.now(UTC).isoformat()
            parts, clock = self.stop_seconds, time.perf_counter
            began = clock()
            try:
                for rid, end in self.requests.take_all():
                    self.transport.finish_request(rid, end)
                stats = self.transport.stop()
                parts["transport"] = clock() - began
                began = clock()
                manifests = self.requests.manifests(self.run.run_id, committed=True)
                run = attrs.evolve(self.run, stopped_at=stopped_at, status=RunStatus.COMMITTED)
                self.sink.finish_run(run, manifests)
                parts["finish_run"] = clock() - began
            except BaseException as exc:
                self._failure = exc
                log.error("dmi.stop_failed", run_id=self.run.run_id, error=repr(exc),
                          seconds={k: round(v, 6) for k, v in parts.items()},
                          failed_after_s=round(clock() - began, 6))
                self._record_failure(exc, stopped_at)
                raise CaptureError(f"dmi_stop_monitoring failed: {exc!r}") from exc
            finally:
                self.gc_pauses.stop()
                began = clock()
                self._close_sink()
                parts["close"] = clock() - began
            log.info("dmi.stopped", run_id=self.run.run_id, **attrs.asdict(stats))
            seen, captured = self.requests.seen_requests, self.requests.captured_requests
            log.info("dmi.sampled", run_id=self.run.run_id, requests=seen, captured=captured,
                     cancelled=self.requests.cancelled_requests,
                     refused=self.requests.refused_requests,
                     reused=self.requests.reused_requests,
                     fraction=round(captured / seen, 4) if seen else None)
            log.info("dmi.timing", run_id=self.run.run_id, **self.timing(stats))
            return stats

    def _close_sink(self) -> None:
        """Close the sink after the run's end was written. A failure here is logged, not
        raised: a committed run was synced by ``finish_run`` (durable), and a failed stop
        raises its own error."""
        try:
            self.sink.close()
        except Exception as exc:
            log.error("dmi.sink_close_failed", run_id=self.run.run_id, error=repr(exc))

    def fail(self, error: BaseException) -> None:
        """End the capture as failed (see the port): a server's scheduler does this
        when a capture fails and serving goes on uncaptured."""
        with self._lock:
            if self._failure is not None or self._stopped:
                return
            self._stopped = True
            self._failure = error
            self.gc_pauses.stop()
            try:
                self.transport.abandon()
            except Exception as exc:  # the run fails with ``error`` whatever this is
                log.warning("dmi.fail_abandon", run_id=self.run.run_id, error=repr(exc))
            self._failing = OsNamedThread(target=self._fail_flush, args=(error,),
                                          name="dmi-fail", daemon=True)
            self._failing.start()

    def _fail_flush(self, error: BaseException) -> None:
        stopped_at = datetime.now(UTC).isoformat()
        try:
            self.transport.stop()  # what the drain holds goes out; its own failure is moot
        except BaseException as exc:  # the run fails with ``error`` whatever this is
            log.warning("dmi.fail_flush", run_id=self.run.run_id, error=repr(exc))
        self._record_failure(error, stopped_at)
        try:
            self.sink.close()
        except BaseException as exc:  # the run fails with ``error`` whatever this is
            log.warning("dmi.fail_close", run_id=self.run.run_id, error=repr(exc))
        log.error("dmi.failed", run_id=self.run.run_id, error=repr(error))

    def timing(self, stats: TransportStats) -> dict[str, float]:
        """Where the run's time went: the scheduler thread's seconds in the hooks (and
        their waits for the drain; ``host_graph_seconds`` of them around the
        ``graph_forwards`` decode graph replays), in the capture points of eager forwards
        (and of the decode graphs' recording at startup), the parts of the stop once it ran
        (``stop_transport_seconds``, ``stop_finish_run_seconds``,
        ``stop_close_seconds``: :attr:`stop_seconds`), the process's garbage collections
        from the monitor's first batch of requests until its stop (``gc_*``: each pauses
        the scheduler thread; :attr:`gc_pauses`), and the drain's own counters where the
        transport has them (device-to-host waits, CPU building records, time blocked in
        ``sink.put``)."""
        out: dict[str, float] = {
            "forwards": float(self.protocol.step),
            "host_seconds": self.host_seconds,
            "graph_forwards": float(self.graph_forwards),
            "host_graph_seconds": self.host_graph_seconds,
            **{f"host_graph_{part}_seconds": s for part, s in self.graph_parts.items()},
            "stall_seconds": stats.stall_seconds,
            "piecewise_stall_seconds": stats.piecewise_stall_seconds,
            "capture_seconds": stats.capture_seconds,
            "requests_seen": float(self.requests.seen_requests),
            "requests_captured": float(self.requests.captured_requests),
        }
        out.update({f"stop_{k}_seconds": v for k, v in self.stop_seconds.items()})
        out.update(self.gc_pauses.counters())
        out.update({f"drain_{k}": float(v) for k, v in self.transport.drain_counters().items()})
        return out

    def _record_failure(self, exc: BaseException, stopped_at: str) -> None:
        run = attrs.evolve(self.run, stopped_at=stopped_at, status=RunStatus.FAILED,
                           error=repr(exc))
        try:
            manifests = self.requests.manifests(self.run.run_id, committed=False)
            manifests += [attrs.evolve(m, committed=False)  # handed over, never stored
                          for m in self.transport.undelivered_manifests()]
            self.sink.finish_run(run, manifests)
        except BaseException as again:  # the store itself may be what failed
            log.error("dmi.failure_not_recorded", run_id=self.run.run_id, error=repr(again))

