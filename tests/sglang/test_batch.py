"""BatchLayout from real SGLang ForwardBatch (and ScheduleBatch/Req) objects on CPU."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.sglang


def _fb(mode: str, rids: list[str] | None, seq_lens: list[int],
        prefix: list[int] | None = None, extend: list[int] | None = None) -> Any:
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    tokens = sum(extend) if extend is not None else len(seq_lens)
    return ForwardBatch(
        forward_mode=ForwardMode[mode],
        batch_size=len(seq_lens),
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        req_pool_indices=torch.arange(len(seq_lens)),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        out_cache_loc=torch.arange(tokens),
        seq_lens_sum=sum(seq_lens),
        rids=rids,
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend,
        extend_seq_lens=None if extend is None else torch.tensor(extend, dtype=torch.int32),
        extend_prefix_lens=None if prefix is None else torch.tensor(prefix, dtype=torch.int32),
    )


def test_decode_one_row_per_request_at_seq_len_minus_one() -> None:
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch
    from dmi_sglang.domain.layout import ForwardKind

    layout = layout_from_forward_batch(_fb("DECODE", ["a", "b", "c"], [7, 3, 12]))
    assert layout.kind is ForwardKind.DECODE
    assert layout.positions() == [("a", 6), ("b", 2), ("c", 11)]
    assert layout.padded_batch_size == 3
    padded = layout_from_forward_batch(_fb("DECODE", ["a", "b", "c"], [7, 3, 12]),
                                       padded_batch_size=4)
    assert (padded.raw_batch_size, padded.padded_batch_size, padded.padded_token_rows) == (
        3, 4, 4)


def test_a_steady_decode_batch_moves_on_and_any_other_is_read_afresh() -> None:
    """Consecutive decode forwards of the same requests, each one token further, reuse
    the previous layout moved on by a position; a seq_len that does not follow (a
    request recomputed after a retraction) or another batch is read from the batch."""
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch
    from dmi_sglang.domain.layout import BatchLayout

    rids = ["a", "b", "c"]
    first = layout_from_forward_batch(_fb("DECODE", rids, [7, 3, 12]))
    moved = layout_from_forward_batch(_fb("DECODE", list(rids), [8, 4, 13]))
    assert moved == BatchLayout.decode(("a", "b", "c"), [8, 4, 13])
    assert moved.request_ids is first.request_ids  # the same stored tuple
    assert moved.follows(first)
    assert moved.run == first.run
    assert moved.run_step == first.run_step + 1
    jumped = layout_from_forward_batch(_fb("DECODE", rids, [9, 4, 14]))
    assert jumped.positions() == [("a", 8), ("b", 3), ("c", 13)]
    assert not jumped.follows(moved)  # b did not move on
    assert jumped.run != moved.run  # a run of its own
    again = layout_from_forward_batch(_fb("DECODE", rids, [9, 4, 14]))  # read twice
    assert not again.follows(jumped)
    assert layout_from_forward_batch(_fb("DECODE", rids, [10, 5, 15])).follows(again)
    other = layout_from_forward_batch(_fb("DECODE", ["a", "c"], [10, 15]))
    assert other.positions() == [("a", 9), ("c", 14)]
    padded = layout_from_forward_batch(_fb("DECODE", ["a", "c"], [11, 16]), padded_batch_size=4)
    assert (padded.positions(), padded.padded_batch_size) == ([("a", 10), ("c", 15)], 4)


def test_a_steady_batch_is_known_by_its_seq_lens_sum() -> None:
    """A decode batch of the same requests whose ``seq_lens_sum`` grew by one a request
    moves on without reading its seq_lens; a batch whose every request moved on by two
    (all recomputed after a retraction) is read afresh; a batch whose seq_lens do not add
    up to ``seq_lens_sum``, or without a sum, is read and not moved on from."""
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch

    rids = ["x", "y"]
    first = layout_from_forward_batch(_fb("DECODE", rids, [5, 9]), padded_batch_size=4)
    steady = _fb("DECODE", list(rids), [6, 10])
    steady.seq_lens_cpu = None  # not read: the sum says the batch moved on
    moved = layout_from_forward_batch(steady, padded_batch_size=4)
    assert moved.moved_on_from(first)
    assert (moved.positions(), moved.padded_batch_size) == ([("x", 5), ("y", 9)], 4)
    eager = layout_from_forward_batch(_fb("DECODE", list(rids), [7, 11]))
    assert (eager.positions(), eager.padded_batch_size) == ([("x", 6), ("y", 10)], 2)
    both_two = layout_from_forward_batch(_fb("DECODE", list(rids), [9, 13]))
    assert both_two.positions() == [("x", 8), ("y", 12)]
    assert both_two.run != eager.run
    wrong = _fb("DECODE", ["p", "q"], [3, 4])
    wrong.seq_lens_sum = 8
    assert layout_from_forward_batch(wrong).positions() == [("p", 2), ("q", 3)]
    after_wrong = _fb("DECODE", ["p", "q"], [4, 5])
    after_wrong.seq_lens_sum = 10  # one more a request than the wrong sum: not trusted
    assert layout_from_forward_batch(after_wrong).positions() == [("p", 3), ("q", 4)]
    unsummed = [_fb("DECODE", ["p", "q"], [n, n + 1]) for n in (3, 4)]
    for fb in unsummed:
        fb.seq_lens_sum = None
    a, b = (layout_from_forward_batch(fb) for fb in unsummed)
    assert b.positions() == [("p", 3), ("q", 4)]
    assert b.follows(a)  # by positions, read from the batch
    assert not b.moved_on_from(a)


def test_a_prefill_between_two_decodes_ends_the_steady_batch() -> None:
    """A finished request's id taken by a new request, prefilled in a mixed forward
    beside the running one: the decode after it has the same rids and a sum one larger a
    request than the decode before the prefill (the new request starts lower, the running
    one went two further), and is read afresh, not moved on."""
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch

    before = layout_from_forward_batch(_fb("DECODE", ["a", "b"], [10, 20]))
    layout_from_forward_batch(_fb("MIXED", ["a", "b"], [9, 21], prefix=[0, 20],
                                  extend=[9, 1]))
    after = layout_from_forward_batch(_fb("DECODE", ["a", "b"], [10, 22]))
    assert after.positions() == [("a", 9), ("b", 21)]
    assert not after.moved_on_from(before)


def test_only_a_decode_layout_moves_on() -> None:
    from dmi_sglang.domain.layout import BatchLayout
    from dmi_sglang.errors import CommitError

    assert BatchLayout.decode(["a"], [3]).moved_on().positions() == [("a", 3)]
    with pytest.raises(CommitError, match="only a decode layout moves on"):
        BatchLayout.extend(["a"], [0], [3]).moved_on()


def test_extend_rows_follow_prefix_and_extend_lists() -> None:
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch
    from dmi_sglang.domain.layout import ForwardKind

    fb = _fb("EXTEND", ["a", "b"], [5, 10], prefix=[0, 6], extend=[5, 4])
    layout = layout_from_forward_batch(fb)
    assert layout.kind is ForwardKind.EXTEND
    assert [(r.request_id, r.row_offset, r.start, r.count, r.emits_token)
            for r in layout.requests] == [("a", 0, 0, 5, True), ("b", 5, 6, 4, True)]
    assert layout.token_rows == 9
    assert layout.logit_rows == 2


def test_an_unfinished_chunk_emits_no_token() -> None:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.sampling.sampling_params import SamplingParams

    from dmi_sglang.adapters.sglang_v0519.batch import (
        layout_from_forward_batch,
        unfinished_rids,
    )

    short = Req("short", "w1 w2", [4, 5], SamplingParams(max_new_tokens=4))
    long = Req("long", "w1 w2 w3", [4, 5, 6] * 400, SamplingParams(max_new_tokens=4))
    batch = ScheduleBatch(reqs=[short, long], chunked_req=long)
    assert unfinished_rids(batch) == frozenset({"long"})
    assert unfinished_rids(ScheduleBatch(reqs=[short])) == frozenset()
    assert unfinished_rids(ScheduleBatch(reqs=[short], chunked_req=long)) == frozenset()
    fb = _fb("EXTEND", ["short", "long"], [2, 512], prefix=[0, 0], extend=[2, 512])
    layout = layout_from_forward_batch(fb, unfinished_rids=unfinished_rids(batch))
    assert [r.emits_token for r in layout.requests] == [True, False]
    assert layout.logit_rows == 1


def test_mixed_batch_holds_prefill_chunks_and_decode_rows() -> None:
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch
    from dmi_sglang.domain.layout import ForwardKind

    # A new prompt of 6 tokens mixed with two running requests decoding one token each.
    fb = _fb("MIXED", ["new", "run1", "run2"], [6, 9, 4], prefix=[0, 8, 3], extend=[6, 1, 1])
    layout = layout_from_forward_batch(fb)
    assert layout.kind is ForwardKind.MIXED
    assert layout.positions()[-2:] == [("run1", 8), ("run2", 3)]
    assert layout.token_rows == 8


def test_idle_and_refused_batches() -> None:
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch
    from dmi_sglang.domain.layout import ForwardKind
    from dmi_sglang.errors import CommitError

    assert layout_from_forward_batch(_fb("IDLE", [], [])).kind is ForwardKind.IDLE
    with pytest.raises(CommitError, match="TARGET_VERIFY cannot be captured"):
        layout_from_forward_batch(_fb("TARGET_VERIFY", ["a"], [3]))
    with pytest.raises(CommitError, match="without rids"):
        layout_from_forward_batch(_fb("EXTEND", None, [3], prefix=[0], extend=[3]))
    with pytest.raises(CommitError, match="padded"):
        layout_from_forward_batch(_fb("EXTEND", ["a"], [3], prefix=[0], extend=[3]),
                                  padded_batch_size=2)
    with pytest.raises(CommitError, match="not prefix"):
        layout_from_forward_batch(_fb("EXTEND", ["a"], [4], prefix=[0], extend=[3]))


def test_gpu_fields_are_the_fallback() -> None:
    import dataclasses

    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch

    fb = _fb("EXTEND", ["a", "b"], [5, 10], prefix=[0, 6], extend=[5, 4])
    bare = dataclasses.replace(fb, extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None,
                               seq_lens_cpu=None)
    assert layout_from_forward_batch(bare) == layout_from_forward_batch(fb)
