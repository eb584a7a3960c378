"""The bandwidth plan: what a selection moves per token, and which stage limits it.

One piece of arithmetic, used by ``dmi-sglang plan`` and the benchmarks' bounds. It
bounds throughput by bandwidth alone (the capture's own work per step is not in it). A
capture moves each captured byte over three stages: device to host (D2H), into the store
(ClickHouse's insert path) and onto the disk (after the store's compression). Each stage
has a rate; the bound a stage puts on serving is the fraction of a generation rate it can
follow::

    needed   = bytes per generated token x generated tokens/s
    bound    = min(1, stage rate / needed)
    max tok/s = stage rate / bytes per generated token

Bytes per generated token include the prompt: a request of ``prompt`` + ``completion``
tokens stores ``prompt_bytes x prompt + generated_bytes x completion`` (the overlap
scheduler's extra forward included, as a complete capture holds it), spread over its
``completion`` generated tokens. Row counts come from :func:`expected_coverage`, the same
rule the readers judge completeness by, and each capture's position rule
(:mod:`~dmi_sglang.domain.positions`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from dmi_sglang.domain.hooks import Selection
from dmi_sglang.domain.positions import PositionRule
from dmi_sglang.domain.records import expected_coverage
from dmi_sglang.domain.shapes import ModelShape

__all__ = [
    "DEFAULT_RATES",
    "BandwidthPlan",
    "CaptureBytes",
    "Rates",
    "StageBound",
    "capture_bytes",
    "plan_bandwidth",
    "throughput_bound",
]

GB = 1e9


@attrs.frozen
class CaptureBytes:
    """Rows and bytes a complete capture of some requests holds.

    Attributes:
        rows / bytes: over every capture.
        by_act: per stored ``act_name``: ``(rows, bytes)``.
    """

    rows: int
    bytes: int
    by_act: dict[str, tuple[int, int]] = attrs.field(eq=False)


def capture_bytes(
    selection: Selection,
    shape: ModelShape,
    requests: Iterable[tuple[int, int, bool]],
) -> CaptureBytes:
    """Rows and bytes a complete capture of ``selection`` holds for ``requests`` given as
    ``(prompt, completion, overlap_extra_forward)``: every capture's coverage
    (:func:`expected_coverage`), less what its position rule leaves out."""
    todo = [(hook, selection.positions_of(hook.name, layer),
             shape.capture_row(selection, hook, layer).nbytes)
            for hook, layer in selection.captures()]
    rows = nbytes = 0
    by_act: dict[str, tuple[int, int]] = {}
    for prompt, completion, extra in requests:
        for hook, rule, row_nbytes in todo:
            full = expected_coverage(hook, prompt_tokens=prompt, completion_tokens=completion,
                                     overlap_extra_forward=extra)
            n = rule.rows(full.start, full.end, prompt=prompt, completion=completion)
            b = n * row_nbytes
            rows += n
            nbytes += b
            r0, b0 = by_act.get(hook.act_name, (0, 0))
            by_act[hook.act_name] = (r0 + n, b0 + b)
    return CaptureBytes(rows, nbytes, by_act)


def throughput_bound(needed_bps: float | None, limit_bps: float | None) -> float | None:
    """``min(1, limit / needed)``: the fraction of the wanted rate a stage can follow
    (1.0 when nothing is needed, None when an input is unknown)."""
    if needed_bps == 0:
        return 1.0
    if not needed_bps or not limit_bps:
        return None
    return min(1.0, limit_bps / needed_bps)


@attrs.frozen
class Rates:
    """What each stage moves per second (captured bytes; the disk's after compression).

    Attributes:
        d2h_bps: page-locked device-to-host copies.
        store_bps: the store's ingest (captured bytes per second it inserts).
        disk_bps: what the disk writes (synced).
        compression: captured bytes / bytes on disk (1.0: none assumed).
    """

    d2h_bps: float = attrs.field(validator=attrs.validators.gt(0))
    store_bps: float = attrs.field(validator=attrs.validators.gt(0))
    disk_bps: float = attrs.field(validator=attrs.validators.gt(0))
    compression: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))


DEFAULT_RATES = Rates(d2h_bps=55 * GB, store_bps=0.65 * GB, disk_bps=1.3 * GB, compression=1.0)
"""Measured on the H200 host (docs/evidence/2026-12-01-h200-linger-writers): pinned D2H
55 GB/s; the embedded store's ingest with 4 writers about 0.65 GB/s (2 KiB rows); the
disk 1.3 GB/s synced. Compression 1.0: bf16 activations of real models barely compress
with LZ4 (a conservative plan)."""


@attrs.frozen
class StageBound:
    """One stage of the plan.

    Attributes:
        stage: ``"d2h"``, ``"store"`` or ``"disk"``.
        limit_bps: captured bytes per second the stage moves.
        max_tok_s: generated tokens per second it can follow (None: nothing captured).
        bound: at the plan's rate, the fraction it can follow (None without a rate).
    """

    stage: str
    limit_bps: float
    max_tok_s: float | None
    bound: float | None


@attrs.frozen
class BandwidthPlan:
    """What a selection moves at a given workload and rate, and the bound of each stage.

    Attributes:
        prompt_tokens / completion_tokens: the workload's request.
        bytes_per_request: a complete capture of one such request.
        bytes_per_prompt_token: bytes the prompt's positions add per prompt token.
        bytes_per_generated_token: the request's bytes over its generated tokens.
        tok_s: generated tokens per second asked for (None: not given).
        needed_bps: bytes per second at ``tok_s``.
        stages: D2H always; store and disk when the capture is stored.
    """

    prompt_tokens: int
    completion_tokens: int
    bytes_per_request: int
    bytes_per_prompt_token: float
    bytes_per_generated_token: float
    tok_s: float | None
    needed_bps: float | None
    stages: tuple[StageBound, ...]

    @property
    def limiting(self) -> StageBound:
        """The stage with the lowest rate of generated tokens."""
        return min(self.stages, key=lambda s: (s.max_tok_s is not None, s.max_tok_s or 0.0))

    @property
    def bound(self) -> float | None:
        """The bound of the whole capture at ``tok_s`` (the lowest stage's)."""
        bounds = [s.bound for s in self.stages]
        return None if any(b is None for b in bounds) else min(b for b in bounds if b is not None)


def plan_bandwidth(
    selection: Selection,
    shape: ModelShape,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    tok_s: float | None = None,
    stored: bool = True,
    rates: Rates = DEFAULT_RATES,
    sample: float = 1.0,
) -> BandwidthPlan:
    """The plan of one selection for requests of ``prompt_tokens`` + ``completion_tokens``
    served at ``tok_s`` generated tokens per second (see the module docstring), of which
    the share ``sample`` is captured (``DMX_REQUEST_SAMPLE``): the bytes a second and the
    stages' bounds count only those (the bytes per request and token are a captured
    request's).

    Raises:
        ValueError: a prompt shorter than one token, no completion, a rate <= 0, or a
            sample outside 0 .. 1.
    """
    if not 0.0 <= sample <= 1.0:
        msg = f"request sample {sample}: accepted: a number from 0 to 1"
        raise ValueError(msg)
    if prompt_tokens < 1 or completion_tokens < 1:
        msg = (f"prompt {prompt_tokens} and completion {completion_tokens} tokens: both "
               "must be at least 1")
        raise ValueError(msg)
    if tok_s is not None and tok_s <= 0:
        msg = f"tokens per second {tok_s}: must be positive"
        raise ValueError(msg)
    one = capture_bytes(selection, shape, [(prompt_tokens, completion_tokens, True)]).bytes
    # every(K) keeps a row every K positions: the mean over a whole number of strides
    stride = math.lcm(1, *(rule.k for _, _, rule in selection.rules
                           if rule.rule is PositionRule.EVERY))
    longer = capture_bytes(selection, shape,
                           [(prompt_tokens + stride, completion_tokens, True)]).bytes
    per_token = one / completion_tokens
    moved = per_token * sample  # per generated token served: the sampled share's bytes
    needed = moved * tok_s if tok_s is not None else None
    limits = [("d2h", rates.d2h_bps)]
    if stored:
        limits += [("store", rates.store_bps), ("disk", rates.disk_bps * rates.compression)]
    stages = tuple(
        StageBound(name, limit, limit / moved if moved else None,
                   throughput_bound(needed, limit) if needed is not None else None)
        for name, limit in limits)
    return BandwidthPlan(prompt_tokens, completion_tokens, one, (longer - one) / stride,
                         per_token, tok_s, needed, stages)
