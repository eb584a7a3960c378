"""SGLang 0.5.19 ``ForwardBatch`` -> :class:`~dmi_sglang.domain.layout.BatchLayout`.

Fields read (``model_executor/forward_batch_info.py``): ``forward_mode``, ``rids`` (a
Python list in batch order), ``seq_lens_cpu`` (CPU tensor; in decode it includes the token
being forwarded, in extend it is prefix + extend), ``extend_prefix_lens_cpu`` and
``extend_seq_lens_cpu`` (Python lists, main path), and ``seq_lens_sum`` (an int SGLang
computes from ``seq_lens_cpu``; a steady decode batch is known by it, see
:func:`_decode`). The GPU twins are read only when a CPU field is missing (a device
sync).

Which requests emit a token in an extend forward: every request whose chunk ends its
prompt. ``ForwardBatch`` cannot tell: ``seq_lens_cpu`` is prefix + extend for a
half-prefilled request too. The scheduler knows: a prompt longer than the chunk budget is
the scheduler's ``chunked_req``, and ``ScheduleBatch.init_new(..., chunked_req=...)``
stores it on the batch whose chunk is *not* its last (``schedule_policy.add_chunked_req``
returns it only when truncated; after its last chunk it is None). So the caller reads
:func:`unfinished_rids` from the ScheduleBatch (``TpModelWorker.forward_batch_generation``
receives it before building the ForwardBatch) and passes it here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from dmi_sglang.domain.layout import BatchLayout, ForwardKind
from dmi_sglang.domain.records import storable_request_id
from dmi_sglang.domain.sampling import CAPTURE_PARAM
from dmi_sglang.errors import CommitError

__all__ = ["CAPTURED_MODES", "capture_param", "layout_from_forward_batch", "request_cancelled",
           "unfinished_rids"]

CAPTURED_MODES = ("EXTEND", "MIXED", "DECODE", "IDLE")
"""``ForwardMode`` names a monitored engine runs (the others need rejected features)."""


def layout_from_forward_batch(
    fb: Any,
    *,
    padded_batch_size: int | None = None,
    unfinished_rids: Collection[str] = (),
) -> BatchLayout:
    """The packed row layout of one forward.

    Args:
        fb: a ``ForwardBatch`` (the one passed to ``ModelRunner.forward``, or the copy
            ``EagerRunner.load_batch`` returns: both carry ``rids``).
        padded_batch_size: decode-graph replay's bucket size (``DecodeCudaGraphRunner.bs``);
            None for eager forwards.
        unfinished_rids: requests whose prompt continues in a later chunk (they compute
            rows but emit no token); see :func:`unfinished_rids`.

    Raises:
        CommitError: a forward mode dmi-sglang does not capture, a batch without
            ``rids`` (the prefill graph's static batch), inconsistent lengths, or padding
            on a non-decode forward.
    """
    forward_mode = fb.forward_mode
    mode = getattr(forward_mode, "name", None) or str(forward_mode)
    if mode not in CAPTURED_MODES:
        msg = f"forward mode {mode} cannot be captured; captured: {', '.join(CAPTURED_MODES)}"
        raise CommitError(msg)
    if mode == "IDLE":
        return BatchLayout.idle()
    if fb.rids is None:
        msg = f"{mode} ForwardBatch without rids: rows cannot be mapped to requests"
        raise CommitError(msg)
    rids = _storable_rids(fb.rids)
    if mode == "DECODE":
        return _decode(rids, fb, padded_batch_size)
    global _last_decode  # noqa: PLW0603 - a one-entry cache of the scheduler thread
    _last_decode = None  # a prefill between two decodes may bring a request of a reused id
    seq_lens = _ints(fb.seq_lens_cpu, fb.seq_lens)
    if padded_batch_size not in (None, len(rids)):
        msg = f"{mode} forward of {len(rids)} requests padded to {padded_batch_size}"
        raise CommitError(msg)
    prefix = _ints(fb.extend_prefix_lens_cpu, fb.extend_prefix_lens)
    extend = _ints(fb.extend_seq_lens_cpu, fb.extend_seq_lens)
    if len(seq_lens) == len(prefix) == len(extend) and any(
        n != p + e for n, p, e in zip(seq_lens, prefix, extend, strict=True)
    ):
        msg = f"seq_lens {seq_lens} are not prefix {prefix} + extend {extend}"
        raise CommitError(msg)
    unfinished = frozenset(unfinished_rids)
    # A request "ends" beyond this chunk when its prompt continues: one past is enough.
    ends = [p + e + (rid in unfinished) for rid, p, e in zip(rids, prefix, extend, strict=False)]
    kind = ForwardKind.MIXED if mode == "MIXED" else ForwardKind.EXTEND
    return BatchLayout.extend(rids, prefix, extend, seq_lens=ends, kind=kind)


_last_rids: tuple[list[str], tuple[str, ...]] = ([], ())
"""The previous forward's rids and their stored form: consecutive decode forwards mostly
run the same requests, and comparing two lists costs far less than converting one."""


def _storable_rids(raw: list[str]) -> tuple[str, ...]:
    """``fb.rids`` as stored ids (the same tuple object as last time when unchanged)."""
    global _last_rids  # noqa: PLW0603 - a one-entry cache of the scheduler thread
    before, stored = _last_rids
    if raw != before:
        stored = tuple(storable_request_id(r) for r in raw)
        _last_rids = (list(raw), stored)
    return stored


_last_decode: tuple[tuple[str, ...], int, BatchLayout] | None = None
"""The previous decode forward's stored rids, ``seq_lens_sum`` and layout."""


def _decode(rids: tuple[str, ...], fb: Any, padded: int | None) -> BatchLayout:
    """The decode layout (padded to ``padded`` requests when given).

    A steady batch is the previous layout moved on by a position, without reading
    ``seq_lens``: the forward before was a decode (any other forward clears the cache)
    of the same rids tuple, and ``seq_lens_sum`` grew by one a request. Between two
    decode forwards with no other forward between them SGLang 0.5.19 moves every request
    of the batch on by exactly one token: a request whose length changes otherwise was
    prefilled again (recomputed after a retraction, or a new request that took a finished
    one's id), and a prefill is a forward of its own. Any other batch is read from
    ``seq_lens``; one whose ``seq_lens`` do not add up to ``seq_lens_sum`` is not kept
    for the next (the sum would say nothing about it).
    """
    global _last_decode  # noqa: PLW0603 - a one-entry cache of the scheduler thread
    total = getattr(fb, "seq_lens_sum", None)
    last = _last_decode
    if (last is not None and rids is last[0] and total is not None
            and total == last[1] + len(rids)):
        layout = last[2].moved_on()
    else:
        seq_lens = _ints(fb.seq_lens_cpu, fb.seq_lens)
        layout = BatchLayout.decode(rids, seq_lens)
        if total is not None and sum(seq_lens) != total:
            total = None
    layout = layout.with_padding(len(rids) if padded is None else padded)
    _last_decode = None if total is None else (rids, total, layout)
    return layout


def unfinished_rids(schedule_batch: Any) -> frozenset[str]:
    """Rids in a ``ScheduleBatch`` whose prompt continues in a later chunk.

    That is the batch's ``chunked_req`` (at most one in SGLang 0.5.19), when it is one of
    the batch's requests.
    """
    req = getattr(schedule_batch, "chunked_req", None)
    if req is None or not any(r is req for r in schedule_batch.reqs):
        return frozenset()
    return frozenset((storable_request_id(req.rid),))


def _ints(cpu: Any, device: Any) -> list[int]:
    values = cpu if cpu is not None else device
    if values is None:
        return []
    if not hasattr(values, "tolist"):  # a Python sequence (cheaper asked than isinstance)
        return [int(v) for v in values]
    listed = values.tolist()  # a tensor's or an array's elements share one Python type
    return listed if not listed or type(listed[0]) is int else [int(v) for v in listed]


def capture_param(req: Any) -> object:
    """What a ``Req`` asked through ``custom_params["dmi_capture"]`` (its sampling
    parameters' ``custom_params``, passed to the scheduler as the caller sent them), or
    None when it asked nothing."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params.get(CAPTURE_PARAM) if isinstance(params, dict) else None


def request_cancelled(req: Any) -> bool:
    """Whether SGLang ended a finished ``Req`` by an abort (the client went away or
    cancelled, or the scheduler aborted it): its finish reason reports type ``abort``
    (``FINISH_ABORT``). Its capture is never complete."""
    reason = getattr(req, "finished_reason", None)
    to_json = getattr(reason, "to_json", None)
    if to_json is None:
        return False
    info = to_json()
    return isinstance(info, dict) and info.get("type") == "abort"
