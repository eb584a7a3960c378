"""A put's pieces as one message (``pieces_to_frames`` / ``pieces_from_frames``): every
record once, in order, each piece at most the piece size of whole records, the payload
sent without a copy (one exchange per put: ``test_owner_writes.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.owner._frames import pieces_from_frames, pieces_to_frames
from dmi_sglang.columns import CaptureKey, RecordBatch

RUN = "run-pieces"
KEYS = (CaptureKey("resid_pre", 0, "torch.bfloat16", (3,)),
        CaptureKey("final_logits", 0, "torch.float32", (5,)),
        CaptureKey("token_ids", 0, "torch.int64", ()))


class _Received:
    """A frame as the owner receives it: its own copy of the bytes, as ``buffer``, at
    an odd address as zmq may hand it out of its read buffer."""

    def __init__(self, data: Any) -> None:
        raw = np.frombuffer(bytes(data), dtype=np.uint8)
        self.buffer = np.concatenate([np.zeros(1, np.uint8), raw])[1:].data


def _batch(rows: list[tuple[int, int]], lead: int) -> RecordBatch:
    """Records of ``(capture index, rows)``, request ``r{i % 2}``, over a payload that
    starts ``lead`` bytes into its buffer (a batch over pooled memory)."""
    sizes = [KEYS[c].row_nbytes * n for c, n in rows]
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64) + lead
    payload = np.random.default_rng(len(rows)).integers(0, 256, int(offsets[-1]) + 3,
                                                        dtype=np.uint8)
    n = len(rows)
    start = np.arange(n, dtype=np.int32) * 10
    return RecordBatch(RUN, ("r0", "r1"), KEYS, np.arange(n, dtype=np.int32) % 2,
                       np.array([c for c, _ in rows], dtype=np.int32), start,
                       start + np.array([k for _, k in rows], dtype=np.int32),
                       np.arange(n, dtype=np.int64) + 100, offsets, payload, shard_rank=1)


def _records(batches: list[RecordBatch]) -> list[tuple[Any, ...]]:
    return [(r.request_id, r.act_name, r.start_token_idx, r.end_token_idx, r.seq,
             bytes(r.payload)) for b in batches for r in b.records()]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.integers(1, 6)),
                     max_size=40),
       piece=st.integers(1, 200), lead=st.integers(0, 9))
def test_pieces_read_back_as_the_batchs_records_in_order(rows: list[tuple[int, int]],
                                                         piece: int, lead: int) -> None:
    batch = _batch(rows, lead)
    header, frames = pieces_to_frames(batch, piece)
    assert len(frames) == 1 + len(header["records"])
    for payload in frames[1:]:  # views of the batch's own payload, not copies
        assert not len(payload) or np.shares_memory(payload, batch.payload)
    got = pieces_from_frames(header, [_Received(f) for f in frames])
    assert _records(got) == _records([batch])
    assert [len(b) for b in got] == header["records"]
    assert all(b.shard_rank == 1 and b.run_id == RUN for b in got)
    for b in got:  # whole records, at most `piece` bytes unless one record alone
        assert len(b) == 1 or b.nbytes <= piece
        assert len(frames[1 + got.index(b)]) == b.nbytes


def test_a_put_whose_frames_do_not_match_its_header_is_refused() -> None:
    header, frames = pieces_to_frames(_batch([(0, 2), (1, 1), (2, 4)], 0), 8)
    received = [_Received(f) for f in frames]
    with pytest.raises(ValueError,
                       match=r"^a put of 3 pieces has 4 frames after its header, got 3$"):
        pieces_from_frames(header, received[:-1])
    with pytest.raises(ValueError, match=r"^the columns of 3 records in 3 pieces take 120 "
                                         r"bytes, got 116$"):
        pieces_from_frames(header, [_Received(frames[0][:-4]), *received[1:]])
    with pytest.raises(ValueError,
                       match=r"^a batch header without its fields: KeyError\('records'\)$"):
        pieces_from_frames({k: v for k, v in header.items() if k != "records"}, received)
    for counts in ([-1, 4, 0], [1, 1.0, 1], [True, 1, 1], "111", []):
        with pytest.raises(ValueError, match=r"^a put's record counts .*; accepted: a "
                                             r"non-empty list of integers >= 0$"):
            pieces_from_frames({**header, "records": counts}, received)
    with pytest.raises(ValueError, match=r"^piece 1 of a put: its records end at byte 20, "
                                         r"its frame holds 19$"):
        pieces_from_frames(header, [*received[:2], _Received(frames[2][:-1]), received[3]])
    with pytest.raises(ValueError, match=r"^piece 0 of a put: its records end at byte 0, "
                                         r"its frame holds 12$"):  # no records, some bytes
        pieces_from_frames({**header, "records": [0, 2, 1]},
                           received)
