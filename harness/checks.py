"""The checks every harness command applies, and the bracketed throughput figures.

Each check returns ``{"ok": bool, "required": bool, ...}`` (see :mod:`harness.results`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.bounds import spread_of
from harness.results import Json

SOFTWARE_KEYS = ("python", "torch", "sglang", "device")


def outputs(runs: Sequence[Json], names: set[str] | None = None) -> list[Json]:
    """The outputs of workload results (of ``names`` only, when given)."""
    return [o | {"workload": r["name"]} for r in runs
            if names is None or r["name"] in names for o in r.get("outputs", [])]


def token_identity(reference: Sequence[Json], other: Sequence[Json], *,
                   required: bool = True) -> Json:
    """Output ids of ``other`` against ``reference``, request by request (by key)."""
    ref = {o["key"]: o for o in reference}
    got = {o["key"]: o for o in other}
    diverged = []
    for key, out in ref.items():
        mine = got.get(key)
        if mine is None or mine["output_ids"] == out["output_ids"]:
            continue
        a, b = out["output_ids"], mine["output_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
        diverged.append({"key": key, "first_diff": first})
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    return {"ok": bool(ref) and not diverged and not missing and not extra,
            "required": required, "compared": len(ref), "diverged_count": len(diverged),
            "diverged": diverged[:20], "missing": missing[:20], "unexpected": extra[:20]}


def same_software(a: Json, b: Json) -> Json:
    """Both engines ran the same Python, torch, SGLang and device, with equal KV pools
    (a value neither engine reported counts as a difference)."""
    ea, eb = a.get("env_info") or {}, b.get("env_info") or {}
    compared = {k: [ea.get(k), eb.get(k)] for k in SOFTWARE_KEYS}
    compared["max_total_num_tokens"] = [a.get("max_total_num_tokens"),
                                        b.get("max_total_num_tokens")]
    differ = {k: v for k, v in compared.items()
              if v[0] != v[1] or (v[0] is None and k != "device")}
    return {"ok": not differ, "required": True, "compared": compared, "differ": differ}


def bracketed_throughput(units: Sequence[Json]) -> dict[str, Json]:
    """Per timed workload, over bracketed units (``stock_before``, ``measured``,
    ``stock_after`` workload results): measured and stock tokens/s, the ratio of each
    measured run to the mean of the stock runs around it, and the spreads (max/min - 1)
    of those ratios and of every stock run."""
    per: dict[str, dict[str, list[float]]] = {}
    for unit in units:
        runs = {k: {w["name"]: w for w in unit[k] if w["timed"]}
                for k in ("stock_before", "stock_after")}
        for w in unit["measured"]["workloads"]:
            if not w["timed"] or not w["seconds"]:
                continue
            stock = [r[w["name"]] for r in runs.values() if w["name"] in r]
            rates = [s["output_tokens"] / s["seconds"] for s in stock if s["seconds"]]
            if not rates:
                continue
            tok_s = w["output_tokens"] / w["seconds"]
            entry = per.setdefault(w["name"], {"measured": [], "stock": [], "ratio": []})
            entry["measured"].append(tok_s)
            entry["stock"].extend(rates)
            entry["ratio"].append(tok_s / statistics.fmean(rates))
    return {name: {"measured_tok_s": statistics.median(v["measured"]),
                   "stock_tok_s": statistics.median(v["stock"]),
                   "ratio": statistics.median(v["ratio"]),
                   "ratio_spread": spread_of(v["ratio"]), "stock_spread": spread_of(v["stock"]),
                   "ratios": v["ratio"], "stock_rates": v["stock"],
                   "stock_runs": len(v["stock"])}
            for name, v in per.items()}


def read_back(store: Path, run_id: str, request_ids: Sequence[str]) -> Json:
    """What completeness needs, read through the public reading API: the run's status,
    per request what is missing and its manifest counts, the requests stored and the
    totals per hook."""
    from dmi_sglang import open_store

    captures = open_store(f"chdb://{store}")
    started = time.perf_counter()
    missing: dict[str, list[str]] = {}
    manifests: dict[str, list[Any]] = {}
    with captures.session():
        run = captures.run(run_id)
        for rid in request_ids:
            if gap := captures.handle(run_id, rid).missing:
                missing[rid] = list(gap)
            manifest = captures.manifest(run_id, rid)
            if manifest is not None:
                manifests[rid] = [manifest.prompt_tokens, manifest.completion_tokens,
                                  manifest.overlap_extra_forward]
        stored = [r.request_id for r in captures.requests(run_id)] if run else []
        totals = {t.act_name: [t.rows, t.bytes] for t in captures.hook_totals(run_id)} \
            if run else {}
    return {"run_status": run.status.value if run is not None else None,
            "missing": missing, "manifests": manifests, "stored_requests": stored,
            "hook_totals": totals, "read_s": time.perf_counter() - started}


def rows_complete(outs: Sequence[Json], back: Json) -> Json:
    """Every request sent is stored, complete, with SGLang's token counts, nothing more,
    and the run committed."""
    problems = []
    if back["run_status"] != "committed":
        problems.append(f"run status {back['run_status']!r}, not 'committed'")
    sent = {str(o["id"]) for o in outs}
    stored = set(back["stored_requests"])
    if sent - stored:
        problems.append(f"{len(sent - stored)} requests have no rows in the store")
    if stored - sent:
        problems.append(f"{len(stored - sent)} unexpected request ids in the store")
    if back["missing"]:
        problems.append(f"{len(back['missing'])} requests incomplete (handle.missing)")
    wrong = [str(o["id"]) for o in outs if (back["manifests"].get(str(o["id"])) or [None])[:2]
             != [o["prompt_tokens"], o["completion_tokens"]]]
    if wrong:
        problems.append(f"{len(wrong)} manifests disagree with SGLang's token counts")
    return {"ok": not problems and bool(outs), "required": True, "requests": len(outs),
            "problems": problems, "incomplete_examples": dict(list(back["missing"].items())[:5]),
            "manifest_mismatch_examples": wrong[:5], "read_s": back["read_s"]}


def stored_as_expected(stored: dict[str, list[int]], expected: dict[str, list[int]],
                       retractions: int) -> Json:
    """Rows and bytes stored per hook equal what the manifests imply (informational: a
    retracted request legitimately stores superseded rows too)."""
    return {"ok": stored == expected, "required": False,
            "stored_bytes": sum(v[1] for v in stored.values()),
            "expected_bytes": sum(v[1] for v in expected.values()),
            "stored_rows": sum(v[0] for v in stored.values()),
            "expected_rows": sum(v[0] for v in expected.values()),
            "retractions": retractions}


def bytes_stored_equal_captured(events: Json, totals: dict[str, list[int]]) -> Json:
    """Payload bytes the transport handed to the sink (``dmi.stopped``) = bytes the sink
    inserted (``store.closed``) = bytes the store holds for the run (hook totals)."""
    captured = (events.get("dmi.stopped") or {}).get("bytes")
    inserted = (events.get("store.closed") or {}).get("bytes_stored")
    held = sum(v[1] for v in totals.values())
    return {"ok": captured is not None and captured == inserted == held, "required": True,
            "captured": captured, "inserted": inserted, "held": held}
