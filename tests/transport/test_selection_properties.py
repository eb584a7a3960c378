"""Property: a selective capture (position rules, requests left out) stores exactly the
rows a full capture of the same forwards stores, filtered by the rules and the sample,
each once, over random prefills (chunked or not), decodes, finishes, padded replays with
padding strip on or off, windows on or off, and rings small enough to go piecewise."""

from __future__ import annotations

import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmi_sglang.adapters.transport import TorchCaptureTransport, TransportOptions
from dmi_sglang.app.assemble import selected_positions
from dmi_sglang.domain.capacity import RingCapacity
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.layout import BatchLayout
from dmi_sglang.domain.positions import PositionRule, Positions
from dmi_sglang.domain.records import RequestManifest
from dmi_sglang.testing import MemorySink

from .conftest import SHAPE, Driver, each_row, raw_bytes, rows_tensor, select, stored_rows
from .scheduler_sim import layout_of, script

FULL = "resid_pre,resid_mid,final_ln,final_logits"


def _driver(text: str, payload: int = 1 << 16, **options: object) -> tuple[Driver, MemorySink]:
    sink, selection, holder = MemorySink(), select(text), []
    transport = TorchCaptureTransport(
        capacity=RingCapacity(payload, payload, 1024), selection=selection, shape=SHAPE,
        max_graph_batch=8, sink=sink, run_id="run-1", device="cpu",
        options=TransportOptions(**options),  # type: ignore[arg-type]
        capture_probe=lambda: holder[0].capturing)
    driver = Driver(transport, selection)
    holder.append(driver)
    return driver, sink


@st.composite
def scenarios(draw: st.DrawFn):
    n = draw(st.integers(1, 5))
    rids = [f"r{i}" for i in range(n)]
    prompts = [draw(st.integers(1, 9)) for _ in rids]
    steps: list[tuple] = []
    if draw(st.booleans()):  # prompts in two chunks
        first = [max(1, p // 2) for p in prompts]
        steps.append(("extend", rids, [0] * n, first, prompts))
        rest = [i for i in range(n) if prompts[i] > first[i]]
        if rest:
            steps.append(("extend", [rids[i] for i in rest], [first[i] for i in rest],
                          [prompts[i] - first[i] for i in rest], [prompts[i] for i in rest]))
    else:
        steps.append(("extend", rids, [0] * n, prompts, prompts))
    pos, live = list(prompts), list(range(n))
    for _ in range(draw(st.integers(0, 8))):
        if len(live) > 1 and draw(st.integers(0, 4)) == 0:
            gone = live.pop(draw(st.integers(0, len(live) - 1)))
            steps.append(("finish", rids[gone], pos[gone] - draw(st.integers(0, 1))))
        steps.append(("decode", [rids[i] for i in live], [pos[i] + 1 for i in live]))
        for i in live:
            pos[i] += 1
    skip = frozenset(r for r in rids if draw(st.booleans()))
    a = draw(st.integers(0, 12))
    rule = draw(st.sampled_from([f"positions({a}-{draw(st.integers(a, 14))})",
                                 "last_prompt", "generated", "last",
                                 f"every({draw(st.integers(1, 4))})"]))
    ruled = draw(st.sampled_from([("resid_pre",), ("final_ln",), ("resid_pre", "final_ln"),
                                  ("final_logits",)]))
    return (steps, dict(zip(rids, prompts, strict=True)), skip, rule, ruled,
            draw(st.booleans()), draw(st.booleans()), draw(st.booleans()),
            draw(st.sampled_from([0, 768, 1024])))


def _run(d: Driver, steps: list[tuple], padded: bool, strip: bool) -> None:
    for step in steps:
        if step[0] == "extend":
            _, rids, prefix, extend, ends = step
            d.forward(BatchLayout.extend(rids, prefix, extend, seq_lens=ends))
        elif step[0] == "finish":
            if step[1] not in d.skip:
                d.t.finish_request(step[1], step[2])
        elif step[1]:
            _, rids, seq_lens = step
            if padded:
                d.forward(BatchLayout.decode(rids, seq_lens, padded_batch_size=8),
                          padded=True, strip=strip)
            else:
                d.forward(BatchLayout.decode(rids, seq_lens))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(scenarios())
def test_a_selective_capture_stores_the_selected_rows_of_a_full_capture(scenario) -> None:
    steps, prompts, skip, rule, ruled, padded, strip, coalesce, small = scenario
    text = ",".join(f"{h}:{rule}" if h in ruled else h for h in FULL.split(","))
    full, full_sink = _driver(FULL, coalesce_decode=coalesce)
    some, some_sink = _driver(text, payload=small or 1 << 16, coalesce_decode=coalesce)
    some.skip, some.prompts = skip, prompts
    for d in (full, some):
        if padded:
            d.graph_capture(8)
        _run(d, steps, padded, strip)
    full.t.stop()
    some.t.stop()
    ends = {s[1]: s[2] for s in steps if s[0] == "finish"}
    want = _selected(full_sink.records, Positions.parse(rule), ruled, skip, prompts, ends)
    got = stored_rows(some_sink.records)
    assert got == want, (sorted(set(got) - set(want))[:3], sorted(set(want) - set(got))[:3])
    assert all(c == 1 for c in got.values())


def _selected(records, keeps: Positions, ruled: tuple[str, ...], skip: frozenset[str],
              prompts: dict[str, int], ends: dict[str, int]) -> collections.Counter:
    """The rows of a full capture a selective one must store: of the captured requests,
    and of the ruled hooks only the positions the rule keeps while capturing; ``last``
    keeps one row of each finished request (``ends``: its ``logits_end``), once, however
    often a retraction recomputed it."""
    want: collections.Counter = collections.Counter()
    for key, stored in stored_rows(records).items():
        rid, act, _, position, _ = key
        if rid in skip:
            continue
        count = stored
        if any(act.endswith(h) for h in ruled):
            completion = None  # while capturing: a rule's span runs to the end
            if keeps.rule is PositionRule.LAST:
                if rid not in ends:
                    continue
                count, completion = 1, ends[rid] - prompts[rid] + 1
            if not keeps.kept(position, position + 1, prompt=prompts[rid],
                              completion=completion):
                continue
        want[key] = count
    if keeps.rule is PositionRule.LAST_PROMPT and "final_logits" in ruled:
        # the row of the last prompt position is stored as soon as it is copied, also
        # for a request that then ends without a token (a full capture drops it then)
        for rid, end in ends.items():
            if rid not in skip and end == prompts[rid] - 1:
                row = rows_tensor(hook_by_name("final_logits"), -1, [(rid, end)])
                want[(rid, "final_logits", -1, end, raw_bytes(row))] = 1
    return want


def _latest(records) -> dict[tuple, bytes]:
    """(request, hook, layer, position) -> the row of the newest step that holds it (what
    a reader returns after a retraction recomputed positions)."""
    best: dict[tuple, tuple[int, bytes]] = {}
    for r, position, data in each_row(records):
        key = (r.request_id, r.act_name, r.layer_no, position)
        if key not in best or best[key][0] < r.seq:
            best[key] = (r.seq, data)
    return {k: v for k, (_, v) in best.items()}


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(script(), st.sampled_from(["last_prompt", "generated", "positions(2-6)", "last",
                                  "every(3)"]),
       st.sampled_from([("resid_pre",), ("final_logits",), ("resid_pre", "final_logits"),
                        ("final_ln", "final_logits")]),
       st.booleans(), st.booleans(), st.booleans())
def test_under_a_scheduler_a_selective_capture_reads_what_a_full_one_does(
        scenario, rule: str, ruled: tuple[str, ...], padded: bool, strip: bool,
        coalesce: bool) -> None:
    """Chunked prefills, MIXED batches, retractions and extra forwards from a toy
    scheduler: the selective capture stores the filtered rows of the full capture, and
    for every finished request the reader's span of each capture holds the same rows."""
    steps, reqs, skip = scenario
    prompts = {r.rid: r.prompt for r in reqs}
    text = ",".join(f"{h}:{rule}" if h in ruled else h for h in FULL.split(","))
    full, full_sink = _driver(FULL, coalesce_decode=coalesce)
    some, some_sink = _driver(text, coalesce_decode=coalesce)
    some.skip, some.prompts = skip, prompts
    for d in (full, some):
        _replay(d, steps, padded, strip)
    full.t.stop()
    some.t.stop()
    keeps = Positions.parse(rule)
    ends = {s[1]: s[2] for s in steps if s[0] == "finish"}
    assert stored_rows(some_sink.records) == _selected(full_sink.records, keeps, ruled, skip,
                                                       prompts, ends)
    got, whole = _latest(some_sink.records), _latest(full_sink.records)
    for manifest in _manifests(steps, reqs, skip):
        for act, layer in {(k[1], k[2]) for k in whole}:
            rule_of = keeps if any(act.endswith(h) for h in ruled) else None
            kept = selected_positions(manifest, act, rule_of)
            for position in kept:
                key = (manifest.request_id, act, layer, position)
                assert got.get(key) == whole[key], (key, kept)


def _replay(d: Driver, steps: list[tuple], padded: bool, strip: bool) -> None:
    if padded:
        d.graph_capture(8)
    for step in steps:
        if step[0] == "finish":
            if step[1] not in d.skip:
                d.t.finish_request(step[1], step[2])
        elif step[1] == "decode" and padded:
            d.forward(layout_of(step, 8), padded=True, strip=strip)
        else:
            d.forward(layout_of(step))


def _manifests(steps: list[tuple], reqs, skip: frozenset[str]) -> list[RequestManifest]:
    """The manifests the session would write for the finished, captured requests."""
    computed = collections.defaultdict(list)
    for step in steps:
        if step[0] == "fwd":
            lay = layout_of(step)
            for rid, start, n in zip(lay.request_ids, lay.starts, lay.counts, strict=True):
                computed[rid].append((start, start + n))
    return [RequestManifest(
        "run-1", r.rid, r.prompt, r.completion,
        computed_from=min([a for a, _ in computed[r.rid]] + [r.prompt]),
        overlap_extra_forward=max(b for _, b in computed[r.rid]) >= r.prompt + r.completion)
        for r in reqs if r.rid not in skip and r.noticed]
