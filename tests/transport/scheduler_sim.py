"""A toy scheduler for property tests: chunked prefill, MIXED batches, decode, retraction
(re-prefilled from a cached prefix or from scratch), the overlap scheduler's extra
forward and finish notices. It only makes layouts; the transport under test does the rest.
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from dmi_sglang.domain.layout import BatchLayout, ForwardKind


@attrs.define
class SimRequest:
    """One request as the toy scheduler sees it."""

    rid: str
    prompt: int
    max_new: int
    completion: int = 0
    pos: int = 0
    """Positions computed (its KV length)."""
    state: str = "wait"
    """wait, run or done."""
    target: int = 0
    """Where its prefill ends: the prompt, or prompt + completion after a retraction."""
    extra: bool = False
    """The overlap scheduler's extra forward is still to come."""
    noticed: bool = False
    retracted: int = 0


@st.composite
def script(draw: st.DrawFn, max_reqs: int = 4, max_steps: int = 30
           ) -> tuple[list[tuple], list[SimRequest], frozenset[str]]:
    """``(steps, requests, left-out ids)``; a step is ``("fwd", kind, layout args)`` or
    ``("finish", rid, logits_end)``."""
    n = draw(st.integers(1, max_reqs))
    reqs = [SimRequest(f"r{i}", draw(st.integers(1, 9)), draw(st.integers(1, 5)))
            for i in range(n)]
    for r in reqs:  # some start from a cached prefix (the radix cache)
        r.target = r.prompt
        r.pos = draw(st.integers(0, r.prompt - 1)) if draw(st.booleans()) else 0
    arrive = [draw(st.integers(0, 3)) for _ in reqs]
    steps: list[tuple] = []
    for t in range(1, draw(st.integers(max_steps // 3, max_steps)) + 1):
        for r in reqs:  # notices of the requests that finished, after any extra forward
            if r.state == "done" and not r.extra and not r.noticed:
                r.noticed = True
                steps.append(("finish", r.rid, r.prompt + r.completion - 1))
        waiting = [r for i, r in enumerate(reqs) if r.state == "wait" and arrive[i] < t]
        running = [r for r in reqs if r.state == "run"]
        if running and draw(st.integers(0, 5)) == 0:
            waiting = [_retract(running, draw), *waiting]
        extras = [r for r in reqs if r.state == "done" and r.extra]
        if waiting and draw(st.booleans()):
            steps.append(_prefill(waiting, running + extras, draw))
        elif running or extras:
            dec = running + extras
            steps.append(("fwd", "decode", ([r.rid for r in dec], [r.pos + 1 for r in dec])))
            for r in dec:
                _advance(r, draw)
    skip = frozenset(r.rid for r in reqs if draw(st.integers(0, 3)) == 0)
    return steps, reqs, skip


def _retract(running: list[SimRequest], draw: st.DrawFn) -> SimRequest:
    r = running.pop(draw(st.integers(0, len(running) - 1)))
    r.state, r.target = "wait", r.prompt + r.completion
    r.pos = draw(st.integers(0, r.prompt + r.completion - 1))  # what the cache kept
    r.retracted += 1
    return r


def _prefill(waiting: list[SimRequest], decoding: list[SimRequest], draw: st.DrawFn) -> tuple:
    budget = draw(st.integers(1, 12))
    rows = []
    for r in waiting:
        if budget <= 0:
            break
        k = min(r.target - r.pos, budget)
        budget -= k
        rows.append((r, r.pos, k, r.pos + k == r.target))
    dec = decoding if decoding and draw(st.booleans()) else []
    rids = [r.rid for r, *_ in rows] + [r.rid for r in dec]
    prefix = [p for _, p, _, _ in rows] + [r.pos for r in dec]
    extend = [k for _, _, k, _ in rows] + [1] * len(dec)
    ends = [p + k + (0 if done else 1) for _, p, k, done in rows] + [r.pos + 1 for r in dec]
    for r, p, k, done in rows:
        r.pos = p + k
        if done:
            r.completion += 1
            r.state = "run" if r.completion < r.max_new else "done"
            r.extra = r.state == "done" and draw(st.booleans())
    for r in dec:
        _advance(r, draw)
    return ("fwd", "mixed" if dec else "extend", (rids, prefix, extend, ends))


def _advance(r: SimRequest, draw: st.DrawFn) -> None:
    r.pos += 1
    if r.state == "done":  # the extra forward
        r.extra = False
        return
    r.completion += 1
    if r.completion >= r.max_new:
        r.state = "done"
        r.extra = draw(st.booleans())


def layout_of(step: tuple, padded_bs: int | None = None) -> BatchLayout:
    """The layout of a ``("fwd", ...)`` step."""
    _, kind, args = step
    if kind == "decode":
        rids, seq = args
        return BatchLayout.decode(rids, seq, padded_batch_size=padded_bs)
    rids, prefix, extend, ends = args
    return BatchLayout.extend(rids, prefix, extend, seq_lens=ends,
                              kind=ForwardKind.MIXED if kind == "mixed" else ForwardKind.EXTEND)
