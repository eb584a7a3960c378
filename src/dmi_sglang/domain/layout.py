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
from collections.abc import Sequence

import attrs

from dmi_sglang.errors import CommitError

__all__ = ["BatchLayout", "ForwardKind", "RequestRows"]


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


@attrs.frozen
class BatchLayout:
    """The packed layout of one forward, from plain values.

    Build it with :meth:`decode` or :meth:`extend` (MIXED batches use ``extend`` with
    ``kind=ForwardKind.MIXED``).
    """

    kind: ForwardKind
    requests: tuple[RequestRows, ...]
    padded_batch_size: int
    """Requests the forward runs with, padding included (== raw unless graph replay)."""

    @property
    def raw_batch_size(self) -> int:
        """Real requests."""
        return len(self.requests)

    @property
    def token_rows(self) -> int:
        """Real token rows (padding excluded)."""
        return sum(r.count for r in self.requests)

    @property
    def padded_token_rows(self) -> int:
        """Token rows the forward computes, padding included."""
        return self.token_rows + (self.padded_batch_size - self.raw_batch_size)

    @property
    def logit_rows(self) -> int:
        """Requests whose logits decide a token this forward."""
        return sum(1 for r in self.requests if r.emits_token)

    def positions(self) -> list[tuple[str, int]]:
        """``(request_id, position)`` of every real row, in row order."""
        return [(r.request_id, p) for r in self.requests for p in range(r.start, r.end)]

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
        rows = tuple(
            RequestRows(rid, i, n - 1, 1)
            for i, (rid, n) in enumerate(zip(request_ids, seq_lens, strict=True))
        )
        for rid, n in zip(request_ids, seq_lens, strict=True):
            if n < 1:
                msg = f"decode seq_len {n} of request {rid!r} must be >= 1"
                raise CommitError(msg)
        return cls._build(ForwardKind.DECODE, rows, padded_batch_size)

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
        ends = seq_lens if seq_lens is not None else [None] * len(request_ids)
        if seq_lens is not None:
            _same_length(request_ids=request_ids, seq_lens=seq_lens)
        offsets = itertools.accumulate(extend_lens, initial=0)
        rows = []
        for rid, start, count, offset, end in zip(
            request_ids, prefix_lens, extend_lens, offsets, ends, strict=False
        ):
            if start < 0 or count < 0:
                msg = f"request {rid!r}: prefix_len {start} and extend_len {count} must be >= 0"
                raise CommitError(msg)
            emits = end is None or start + count >= end
            rows.append(RequestRows(rid, offset, start, count, emits_token=emits))
        return cls._build(kind, tuple(rows), None)

    @classmethod
    def idle(cls) -> BatchLayout:
        """A forward without tokens (SGLang's IDLE mode)."""
        return cls(ForwardKind.IDLE, (), 0)

    @classmethod
    def _build(
        cls, kind: ForwardKind, rows: tuple[RequestRows, ...], padded: int | None
    ) -> BatchLayout:
        padded_bs = len(rows) if padded is None else padded
        if padded_bs < len(rows):
            msg = f"padded batch size {padded_bs} is smaller than the {len(rows)} real requests"
            raise CommitError(msg)
        return cls(kind, rows, padded_bs)


def _same_length(**columns: Sequence[object]) -> None:
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        msg = f"batch columns differ in length: {lengths}"
        raise CommitError(msg)
