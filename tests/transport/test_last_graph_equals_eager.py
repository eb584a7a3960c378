"""The ``last`` rule through decode graphs stores exactly what it stores through eager
forwards, over random serving histories.

A decode graph writes the slots through a device index that each replay flips by
itself, while an eager forward writes through indexes made for the step; the two paths
share nothing but the slot rows and the positions the host keeps. Each history below is
served twice (decode steps padded to a graph bucket, or eager) with the same requests,
prefills, retractions, finishes, left-out requests, too few slots, forwards that raised
after their commit (with none, some or all capture points run), and replays nobody
committed between steps; the stored records must be equal.
"""

from __future__ import annotations

import random

from dmi_sglang.domain.layout import BatchLayout

BUCKETS = (1, 2, 4, 8)
SELECTION = "resid_pre@0:last,final_logits:last"


def _serve(make_driver, seed: int, *, graphs: bool) -> list[tuple[str, str, int, bytes]]:
    rng = random.Random(seed)
    d, sink = make_driver(SELECTION, max_graph_batch=8, max_requests=rng.choice([2, 4, 16]),
                          payload_bytes=1 << 20)
    d.skip = frozenset(f"r{i}" for i in range(0, 100, 5))  # requests left out
    if graphs:
        for bucket in BUCKETS:
            d.graph_capture(bucket)
    nxt: dict[str, int] = {}  # running request -> its next decode seq_len
    newest: dict[str, int] = {}  # -> the newest position forwarded
    order: list[str] = []
    made = 0
    for _ in range(50):
        roll = rng.random()
        if roll < 0.15 or not nxt:  # new requests arrive with their prefill
            rids = [f"r{made + i}" for i in range(rng.randint(1, 2))]
            made += len(rids)
            lens = [rng.randint(1, 5) for _ in rids]
            d.forward(BatchLayout.extend(rids, [0] * len(rids), lens))
            for rid, n in zip(rids, lens, strict=True):
                nxt[rid], newest[rid] = n + 1, n - 1
            order += rids
        elif roll < 0.2:  # a retracted request computed again from its start
            rid = rng.choice(sorted(nxt))
            d.forward(BatchLayout.extend([rid], [0], [nxt[rid] - 1]))
            newest[rid] = nxt[rid] - 2
        elif roll < 0.25:  # a request finishes (after the overlap's extra forward or not)
            rid = rng.choice(sorted(nxt))
            del nxt[rid]
            d.t.finish_request(rid, newest[rid] + rng.choice([0, 1]))
        elif roll < 0.3:
            bucket = rng.choice(BUCKETS)  # drawn in both runs: the histories stay equal
            if graphs:  # a replay nobody committed: the guard, then what it writes
                d.t.uncommitted_replay()
                d.graph_capture(bucket)
        else:
            _decode(d, rng, tuple(r for r in order if r in nxt), nxt, newest, graphs=graphs)
    for rid in nxt:
        d.t.finish_request(rid, newest[rid] + 1)
    d.t.stop()
    return sorted((r.request_id, r.act_name, r.start_token_idx, bytes(r.payload))
                  for r in sink.records)


def _decode(d, rng: random.Random, rids: tuple[str, ...], nxt: dict[str, int],
            newest: dict[str, int], *, graphs: bool) -> None:
    """One decode forward of ``rids`` (a graph replay when a bucket fits), sometimes
    raising after its commit."""
    bucket = next((b for b in BUCKETS if b >= len(rids)), None)
    padded = graphs and bucket is not None
    layout = BatchLayout.decode(rids, [nxt[r] for r in rids],
                                padded_batch_size=bucket if padded else None)
    moved = True
    if rng.random() < 0.1:  # the forward raises after its commit
        d.step += 1
        d.t.commit(d.plan(layout, padded=padded), step=d.step)
        ran = rng.random()
        pad = layout.padded_batch_size - layout.raw_batch_size
        if ran < 0.4:
            d.fire(layout, pad)
        elif ran < 0.7:
            d.fire(layout, pad, skip={("final_logits", -1)})
        d.t.abort()
        moved = rng.random() < 0.5  # SGLang may move on or forward it again
    else:
        d.forward(layout, padded=padded)
    if moved:
        for rid in rids:
            newest[rid] = nxt[rid] - 1
            nxt[rid] += 1


def test_graph_steps_store_what_eager_steps_store(make_driver) -> None:
    stored = 0
    for seed in range(40):
        graphs = _serve(make_driver, seed, graphs=True)
        assert graphs == _serve(make_driver, seed, graphs=False), f"seed {seed}"
        stored += bool(graphs)
    assert stored >= 30  # most histories store rows (some leave every request out)
