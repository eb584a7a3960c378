"""Which (request, position) each row of one forward holds.

SGLang packs a forward's tokens request after request: request ``i`` contributes
``extend_len[i]`` rows for positions ``[prefix_len[i], prefix_len[i] + extend_len[i])``.
A decode forward is the special case ``extend_len = 1``, ``prefix_len = seq_len - 1``.
Decode CUDA-graph replay pads the batch to a captured bucket (``padded_batch_size``); the
padding rows follow the real ones and hold junk.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Sequence

import attrs

from dmi_sglang.errors import CommitError

__all__ = ["BatchLayout", "ForwardKind", "RequestRows", "one_further"]


class ForwardKind(enum.Enum):
    """SGLang's forward modes, as far as capture cares."""

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"


@attrs.frozen
class RequestRows:
    """The rows one request holds in a forward.

    Attributes:
        request_id: SGLang's rid.
        row_offset: index of the request's first row in the packed batch.
        start: first position (``prefix_len``).
        count: rows (``extend_len``).
        emits_token: True when this forward's logits decide a generated token (the last
            chunk of a prompt, every decode); False for an intermediate prefill chunk.
    """

    request_id: str
    row_offset: int
    start: int
    count: int
    emits_token: bool = True

    @property
    def end(self) -> int:
        """One past the last position."""
        return self.start + self.count


class _Moved:
    """Positions not computed yet: each of ``base`` moved on by ``by``."""

    __slots__ = ("base", "by")

    def __init__(self, base: tuple[int, ...], by: int) -> None:
        self.base = base
        self.by = by

    def __repr__(self) -> str:
        return repr(_positions(self))


def _positions(starts: tuple[int, ...] | _Moved) -> tuple[int, ...]:
    """The positions themselves (what layouts compare by)."""
    if isinstance(starts, _Moved):
        by = starts.by
        return tuple([start + by for start in starts.base])
    return starts


@attrs.frozen
class BatchLayout:
    """The packed layout of one forward, from plain values, held as columns.

    Build it with :meth:`decode` or :meth:`extend` (MIXED batches use ``extend`` with
    ``kind=ForwardKind.MIXED``). Request ``i`` holds rows
    ``[row_offsets[i], row_offsets[i] + counts[i])`` for positions
    ``[starts[i], starts[i] + counts[i])``. Columns keep per-step planning cheap: the
    scheduler thread builds one of these every forward.
    """

    kind: ForwardKind
    request_ids: tuple[str, ...]
    _starts: tuple[int, ...] | _Moved = attrs.field(eq=_positions)
    """The first position of each request (see :attr:`starts`); given as ``starts``."""
    counts: tuple[int, ...]
    emits: tuple[bool, ...]
    padded_batch_size: int
    """Requests the forward runs with, padding included (== raw unless graph replay)."""
    token_rows: int
    """Real token rows (padding excluded)."""
    run: int = attrs.field(default=0, eq=False)
    """The run of decode forwards this layout belongs to: a number of its own for each
    layout :meth:`decode` builds, kept by :meth:`moved_on` and :meth:`with_padding`
    (0: no run; other constructors)."""
    run_step: int = attrs.field(default=0, eq=False)
    """Forwards this layout moved on from the first of its run (:meth:`moved_on`)."""

    @property
    def starts(self) -> tuple[int, ...]:
        """The first position of each request, in batch order. A layout :meth:`moved_on`
        computes them when first read (then keeps them): a steady decode step costs the
        scheduler no pass over its batch, and whoever reads the positions (the drain, a
        finish) pays for them."""
        starts = self._starts
        if not isinstance(starts, _Moved):
            return starts
        values = _positions(starts)
        object.__setattr__(self, "_starts", values)  # one reference, replaced whole
        return values

    @property
    def requests(self) -> tuple[RequestRows, ...]:
        """The rows of every request, in batch order."""
        offsets = itertools.accumulate(self.counts, initial=0)
        return tuple(
            RequestRows(rid, off, start, n, emits)
            for rid, off, start, n, emits in zip(
                self.request_ids, offsets, self.starts, self.counts, self.emits, strict=False
            )
        )

    @property
    def raw_batch_size(self) -> int:
        """Real requests."""
        return len(self.request_ids)

    @property
    def padded_token_rows(self) -> int:
        """Token rows the forward computes, padding included."""
        return self.token_rows + (self.padded_batch_size - self.raw_batch_size)

    @property
    def logit_rows(self) -> int:
        """Requests whose logits decide a token this forward."""
        return sum(1 for e, n in zip(self.emits, self.counts, strict=True) if e and n > 0)

    @property
    def is_uniform_decode(self) -> bool:
        """One row per request and every request emits (plain decode). An extend with as
        many rows as requests is one only when no request has none (0 tokens)."""
        return self.token_rows == self.raw_batch_size and all(self.emits) and (
            self.kind is ForwardKind.DECODE or 0 not in self.counts)

    def follows(self, other: BatchLayout) -> bool:
        """True when this layout is the decode forward right after ``other``'s, of the same
        requests, each one position further: known in O(1) when this layout was moved on
        from ``other`` (the same :attr:`run`, the next :attr:`run_step`; a run's
        :meth:`moved_on` is trusted with the positions it was given), else checked
        position by position."""
        if self.kind is not ForwardKind.DECODE or other.kind is not ForwardKind.DECODE:
            return False
        if self.moved_on_from(other):
            return True
        return self.request_ids == other.request_ids and one_further(self.starts, other.starts)

    def moved_on_from(self, other: BatchLayout) -> bool:
        """True when this layout was :meth:`moved_on` from ``other`` (the same :attr:`run`,
        its next :attr:`run_step`): the same requests, rows and emitting requests, each
        one position further. O(1)."""
        return self.run == other.run != 0 and self.run_step == other.run_step + 1

    def positions(self) -> list[tuple[str, int]]:
        """``(request_id, position)`` of every real row, in row order."""
        return [
            (rid, p)
            for rid, start, n in zip(self.request_ids, self.starts, self.counts, strict=True)
            for p in range(start, start + n)
        ]

    @classmethod
    def decode(
        cls,
        request_ids: Sequence[str],
        seq_lens: Sequence[int],
        *,
        padded_batch_size: int | None = None,
    ) -> BatchLayout:
        """A decode forward: one row per request, at position ``seq_len - 1``.

        ``seq_lens`` include the token being forwarded (SGLang's convention).
        """
        _same_length(request_ids=request_ids, seq_lens=seq_lens)
        n = len(request_ids)
        if n and min(seq_lens) < 1:
            bad = next(i for i, v in enumerate(seq_lens) if v < 1)
            msg = f"decode seq_len {seq_lens[bad]} of request {request_ids[bad]!r} must be >= 1"
            raise CommitError(msg)
        return cls._build(ForwardKind.DECODE, tuple(request_ids),
                          tuple([v - 1 for v in seq_lens]), (1,) * n, (True,) * n, n,
                          padded_batch_size, run=next(_RUNS))

    def moved_on(self) -> BatchLayout:
        """The next decode forward of the same requests, each one position further (what
        a steady decode batch becomes every step). Its positions are computed when first
        read (:attr:`starts`): this layout's, one further.

        Raises:
            CommitError: not a decode layout.
        """
        if self.kind is not ForwardKind.DECODE:
            msg = f"only a decode layout moves on by a position, not a {self.kind.value} one"
            raise CommitError(msg)
        starts = self._starts
        moved = (_Moved(starts.base, starts.by + 1) if isinstance(starts, _Moved)
                 else _Moved(starts, 1))
        return BatchLayout(self.kind, self.request_ids, moved, self.counts, self.emits,
                           self.padded_batch_size, self.token_rows, self.run,
                           self.run_step + 1)

    @classmethod
    def extend(
        cls,
        request_ids: Sequence[str],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        *,
        seq_lens: Sequence[int] | None = None,
        kind: ForwardKind = ForwardKind.EXTEND,
    ) -> BatchLayout:
        """An extend (prefill chunk) or mixed forward.

        Args:
            request_ids: rids in batch order.
            prefix_lens: positions already in the KV cache per request.
            extend_lens: positions this forward computes per request.
            seq_lens: the requests' full lengths after this forward, when known: a
                request emits a token only when the chunk reaches it (otherwise every
                request is assumed to emit one).
            kind: EXTEND or MIXED.
        """
        _same_length(request_ids=request_ids, prefix_lens=prefix_lens, extend_lens=extend_lens)
        if seq_lens is not None:
            _same_length(request_ids=request_ids, seq_lens=seq_lens)
        for rid, start, count in zip(request_ids, prefix_lens, extend_lens, strict=True):
            if start < 0 or count < 0:
                msg = f"request {rid!r}: prefix_len {start} and extend_len {count} must be >= 0"
                raise CommitError(msg)
        if seq_lens is None:
            emits = (True,) * len(request_ids)
        else:
            emits = tuple(p + e >= n for p, e, n in zip(prefix_lens, extend_lens, seq_lens,
                                                         strict=True))
        return cls._build(kind, tuple(request_ids), tuple(prefix_lens), tuple(extend_lens),
                          emits, sum(extend_lens), None)

    @classmethod
    def idle(cls) -> BatchLayout:
        """A forward without tokens (SGLang's IDLE mode)."""
        return cls(ForwardKind.IDLE, (), (), (), (), 0, 0)

    @classmethod
    def _build(  # noqa: PLR0917 - private constructor of the columns
        cls,
        kind: ForwardKind,
        rids: tuple[str, ...],
        starts: tuple[int, ...] | _Moved,
        counts: tuple[int, ...],
        emits: tuple[bool, ...],
        token_rows: int,
        padded: int | None,
        *,
        run: int = 0,
        run_step: int = 0,
    ) -> BatchLayout:
        padded_bs = len(rids) if padded is None else padded
        if padded_bs < len(rids):
            msg = f"padded batch size {padded_bs} is smaller than the {len(rids)} real requests"
            raise CommitError(msg)
        return cls(kind, rids, starts, counts, emits, padded_bs, token_rows, run, run_step)

    def subset(self, indices: Sequence[int],
               request_ids: tuple[str, ...] | None = None) -> BatchLayout:
        """The layout of some of its requests (``indices``, in that order), unpadded
        (``request_ids``: their ids, when the caller has them as a tuple already)."""
        counts = tuple(self.counts[i] for i in indices)
        rids = request_ids if request_ids is not None else tuple(
            self.request_ids[i] for i in indices)
        return self._build(self.kind, rids, tuple(self.starts[i] for i in indices), counts,
                           tuple(self.emits[i] for i in indices), sum(counts), None)

    def with_padding(self, padded_batch_size: int) -> BatchLayout:
        """The same layout padded to another batch size (itself when it has that size)."""
        if padded_batch_size == self.padded_batch_size:
            return self
        return self._build(self.kind, self.request_ids, self._starts, self.counts,
                           self.emits, self.token_rows, padded_batch_size, run=self.run,
                           run_step=self.run_step)


_RUNS = itertools.count(1)
"""Numbers of decode runs (:attr:`BatchLayout.run`)."""


def one_further(now: Sequence[int], before: Sequence[int]) -> bool:
    """True when ``now`` is ``before`` with every value one more, in order (a steady
    decode batch's positions or lengths, a step later)."""
    n = len(now)
    return n == len(before) and list(map(operator.sub, now, before)) == [1] * n


def _same_length(**columns: Sequence[object]) -> None:
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        msg = f"batch columns differ in length: {lengths}"
        raise CommitError(msg)
