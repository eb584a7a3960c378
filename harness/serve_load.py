"""Serving load benchmark: ``dmi-sglang serve`` against stock SGLang over HTTP, driven by
SGLang's own client ``python -m sglang.bench_serving``.

    python -m harness serve-load --out FILE [--modes "resid_pre:last;hidden-states"]
        [--model demo|0.6b] [--num-prompts 320] [--input-len 256] [--output-len 128]
        [--range-ratio 0.5] [--max-concurrency 64] [--api-key KEY] [--server-flags "..."]
    python -m harness serve-load --dry-run --out FILE

One stock server (``python -m sglang.launch_server``), then one ``dmi-sglang serve
--hooks MODE --request-sample 1 --db chdb:///WORK/store-MODE`` per mode (``--modes``, ``;``
between modes: a selection holds commas), all with the same flags (:data:`SERVER_FLAGS`,
the seed, a free port, ``--server-flags``), one at a time. Each server gets the same load:

* a warm-up (:data:`WARMUP_REQUESTS` concurrent ``/generate``, mixed lengths);
* ``bench_serving --backend sglang --dataset-name random-ids --tokenize-prompt``: streamed
  native ``/generate`` requests of mixed lengths (``--random-range-ratio``) from
  ``--max-concurrency`` clients; random ids need no data set, so it runs offline;
* alongside it, from the moment bench_serving's main run starts, a cancelling client
  (:data:`CANCEL_SHARE` of the request count): streamed ``/generate`` requests aborted
  through ``POST /abort_request`` after :data:`CANCEL_EVENTS` events, while the stream is
  open, and read to their ``abort`` finish;
* then a deterministic subset, one request at a time: :data:`SUBSET_PROMPTS` fixed
  ``input_ids``, greedy, ``ignore_eos``, :data:`SUBSET_NEW_TOKENS` tokens, output ids
  kept.

A monitored server is then asked over HTTP, while its run still captures, for ``GET
/dmi/status``, ``GET /dmi/runs/RUN/requests`` and, per subset request, ``GET
/dmi/runs/RUN/requests/ID`` and its ``/safetensors``; then ``POST /dmi/stop``, the list
again, and each subset request that was not complete before the stop fetched again
(every subset request must read complete before the stop: per-request commit); then SIGINT, and
after its exit the store is read directly (``dmi_sglang.open_store``).

Checks: every bench request of every server succeeded; subset output ids equal stock's,
request by request; the HTTP readback equals the direct read for every tensor (shape,
dtype, positions, values); every request that finished is complete and every cancelled
one is not, and the store holds every bench's completed requests and warm-up; the run is
committed; every server runs until its SIGINT and then exits with status 0. Figures per server
(from bench_serving's output file): request throughput, output tokens/s, TTFT / ITL / E2E
p50, p90, p99; per mode the ratios to stock; per bench the CPU seconds each process of the
server used during its main run (``/proc``: the HTTP main process, the scheduler, the
detokenizer), which shows where a monitored server's extra work, or an export's, lands.
One stock run, not bracketed: the ratios carry the run-to-run noise of one server start.
``--export-gb N``: after its bench, a monitored server runs two more, the first while a
client downloads up to N GB of the run's safetensors files: its throughput against the
plain benches' before and after it is the export's cost. ``--export-rounds R`` repeats
that pair R times (export, plain, export, plain, ...; each export bench bracketed by the
plain benches on either side); the cost is the median of the rounds', with their spread.

Model (``--model``): the machine is offline and the Qwen3 shapes of :mod:`harness.models`
come without a tokenizer, which bench_serving and SGLang's text output need. So the model
is dmi-sglang's demo checkpoint (:mod:`dmi_sglang.adapters.demo_model`, the one
``tests/gpu`` serves): ``demo`` (default) is its 4-layer size, ``0.6b`` the same code with
Qwen3-0.6B's geometry (random weights, 1.5 GB written first, about 15-30 s on CPU).

``--dry-run`` runs the whole flow on CPU with no GPU and no SGLang server: the servers are
a fake of SGLang's HTTP API and dmi-sglang's endpoints (:mod:`harness.serve_fake`,
started with the very argument lists the real servers would get, writing a real embedded
store), driven by the real bench_serving client; first it checks that
SGLang's own argument parser accepts every server flag and that ``dmi-sglang serve``
accepts its arguments (it answers "needs an NVIDIA GPU" with CUDA hidden).

Exit status: 0 every check passed; 1 a check failed or a server could not be measured;
3 nothing failed but a mode did not fit before the deadline (``DMI_HARNESS_DEADLINE_S``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import importlib.util
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from harness import checks
from harness.constants import (
    BENCH_MAIN_WAIT_S,
    BENCH_READY_S,
    BENCH_S,
    CANCEL_EVENTS,
    CANCEL_INTERVAL_S,
    CANCEL_NEW_TOKENS,
    CANCEL_SHARE,
    CANCEL_WORKERS,
    COMMIT_WAIT_S,
    DEFAULT_MODES,
    EXIT_S,
    HTTP_S,
    INPUT_LEN,
    MAX_CONCURRENCY,
    MODE_TAIL_EST_S,
    NUM_PROMPTS,
    OUTPUT_LEN,
    RANGE_RATIO,
    RESERVE_S,
    SEED,
    SERVER_FLAGS,
    START_S,
    START_WARM_EST_S,
    STOP_WAIT_S,
    SUBSET_LEN_STEP,
    SUBSET_MIN_LEN,
    SUBSET_NEW_TOKENS,
    SUBSET_PROMPTS,
    TRITON_CACHE_DIR,
    WARMUP_NEW_TOKENS,
    WARMUP_REQUESTS,
)
from harness.engine import cpu_between, group_alive, group_cpu, kill_leftovers, track_group
from harness.models import MODELS, STOCK_ENV
from harness.results import (
    REPO,
    Deadline,
    Json,
    finish,
    masked,
    result,
    state_dir,
    write_json,
)
from harness.serving import slug

if TYPE_CHECKING:
    import torch

# -- constants local to this benchmark (the others: harness/constants.py) -------------------
MODE_SEPARATOR = ";"
"""Between the modes of ``--modes`` (a selection itself holds commas)."""
HOST = "127.0.0.1"
BENCH_MAIN_MARK = "Starting main benchmark run"
"""What bench_serving prints once its warm-up request is done."""
LOG_TAIL = 3000
"""Characters of a log kept in the JSON when something failed."""
EXIT_NO_GPU = 3
"""``dmi-sglang serve``'s exit status without a GPU (the dry run's preflight expects it)."""
PGID_MARKERS = (b"sglang.launch_server", b"dmi_sglang", b"harness.serve_fake")
"""A recorded process group is killed as a leftover only while its leader's command line
holds one of these (its id was not reused)."""

LATENCIES = {"ttft_ms": ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"),
             "itl_ms": ("median_itl_ms", "p90_itl_ms", "p99_itl_ms"),
             "e2e_ms": ("median_e2e_latency_ms", "p90_e2e_latency_ms", "p99_e2e_latency_ms")}
"""bench_serving output fields of each latency figure (p50, p90, p99)."""
RATES = {"request_throughput": "request_throughput", "output_tok_s": "output_throughput",
         "input_tok_s": "input_throughput"}
"""Our figure -> bench_serving's output field, for the rates."""
PERCENTILES = ("p50", "p90", "p99")
BENCH_WARMUP_REQUESTS = 1
"""bench_serving's ``--warmup-requests``: sent before its main run, captured as the rest."""
UNFINISHED_OUTCOMES = ("cancelled", "server_abort", "error")
"""Outcomes of the cancelling client's requests that need not read complete (one that
``finished`` or whose abort was ignored ran to its end, as any other)."""


class DeadlineReachedError(RuntimeError):
    """Too little time is left before the deadline for the next step."""


class ServerError(RuntimeError):
    """A server did not start, answered wrongly or died."""


# -- plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What one invocation runs (from the command line)."""

    modes: tuple[str, ...] = DEFAULT_MODES
    model: str = "demo"
    num_prompts: int = NUM_PROMPTS
    input_len: int = INPUT_LEN
    output_len: int = OUTPUT_LEN
    range_ratio: float = RANGE_RATIO
    max_concurrency: int = MAX_CONCURRENCY
    api_key: str | None = None
    extra_flags: tuple[str, ...] = ()
    dry_run: bool = False
    export_gb: float = 0.0
    export_rounds: int = 1

    @property
    def cancel_requests(self) -> int:
        """Requests of the cancelling client (at least one)."""
        return max(1, round(self.num_prompts * CANCEL_SHARE))

    def settings(self) -> Json:
        """What decides the results (the JSON's ``settings``; the API key only as set)."""
        return {"dry_run": self.dry_run, "model": self.model, "modes": list(self.modes),
                "num_prompts": self.num_prompts, "input_len": self.input_len,
                "output_len": self.output_len, "range_ratio": self.range_ratio,
                "max_concurrency": self.max_concurrency,
                "cancel_requests": self.cancel_requests, "subset_prompts": SUBSET_PROMPTS,
                "subset_new_tokens": SUBSET_NEW_TOKENS, "warmup_requests": WARMUP_REQUESTS,
                "server_flags": masked([*SERVER_FLAGS, *self.extra_flags]), "seed": SEED,
                "export_gb": self.export_gb, "export_rounds": self.export_rounds,
                "api_key": self.api_key is not None}


def parse_modes(text: str) -> tuple[str, ...]:
    """``"resid_pre:last;hidden-states"`` -> the selections, each checked as ``dmi-sglang
    serve --hooks`` checks it; duplicates dropped.

    Raises:
        ValueError: an empty list or a selection dmi-sglang refuses (its message).
    """
    from dmi_sglang.domain.settings import Settings
    from dmi_sglang.errors import ConfigurationError

    modes: list[str] = []
    for mode in filter(None, (m.strip() for m in text.split(MODE_SEPARATOR))):
        try:
            Settings.from_kwargs({"dmx_hook_selection": mode}, env={})
        except ConfigurationError as exc:
            msg = f"mode {mode!r}: {exc}"
            raise ValueError(msg) from None
        if mode not in modes:
            modes.append(mode)
    if not modes:
        msg = f"no mode in {text!r} (modes are separated by {MODE_SEPARATOR!r})"
        raise ValueError(msg)
    return tuple(modes)


# -- command lines -----------------------------------------------------------------------------
def server_flags(plan: Plan, port: int) -> list[str]:
    """SGLang flags shared by the stock and monitored servers of one invocation."""
    graphs = -(-(plan.max_concurrency + CANCEL_WORKERS) // 8) * 8  # every client's batch
    key = ["--api-key", plan.api_key] if plan.api_key else []
    return ["--host", HOST, "--port", str(port), *SERVER_FLAGS,
            "--cuda-graph-max-bs-decode", str(graphs), "--random-seed", str(SEED), *key,
            *plan.extra_flags]


def stock_argv(plan: Plan, model_dir: Path, port: int, python: str = sys.executable) -> list[str]:
    """The stock server: ``python -m sglang.launch_server`` with the shared flags."""
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_dir),
            *server_flags(plan, port)]


def monitored_argv(plan: Plan, model_dir: Path, port: int, mode: str, *, store_url: str,
                   run_id: str, python: str = sys.executable) -> list[str]:
    """The monitored server: ``dmi-sglang serve`` capturing ``mode`` of every request into
    ``store_url``, with the shared flags."""
    return [python, "-m", "dmi_sglang", "serve", "--model-path", str(model_dir),
            "--hooks", mode, "--request-sample", "1", "--run-id", run_id,
            "--db", store_url, *server_flags(plan, port)]


def serve_own_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` of a server less its program and ``dmi-sglang serve``'s own options: what
    SGLang's parser receives."""
    own = {"--hooks", "--request-sample", "--run-id", "--db"}
    start = argv.index("--model-path")
    out: list[str] = []
    skip = False
    for arg in argv[start:]:
        if skip:
            skip = False
        elif arg in own:
            skip = True
        else:
            out.append(arg)
    return out


def bench_argv(plan: Plan, port: int, tokenizer: Path, out_file: Path,
               launcher: Sequence[str] = (sys.executable, "-m", "sglang.bench_serving"),
               ) -> list[str]:
    """SGLang's benchmark client: random ids (no data set), streamed native ``/generate``
    with exact prompt lengths, ``--max-concurrency`` clients, the result appended to
    ``out_file`` as one JSON line."""
    return [*launcher, "--backend", "sglang", "--host", HOST, "--port", str(port),
            "--dataset-name", "random-ids", "--tokenizer", str(tokenizer), "--tokenize-prompt",
            "--random-input-len", str(plan.input_len),
            "--random-output-len", str(plan.output_len),
            "--random-range-ratio", str(plan.range_ratio),
            "--num-prompts", str(plan.num_prompts),
            "--max-concurrency", str(plan.max_concurrency),
            "--seed", str(SEED), "--warmup-requests", str(BENCH_WARMUP_REQUESTS),
            "--ready-check-timeout-sec", str(BENCH_READY_S),
            "--output-file", str(out_file), "--output-details", "--disable-tqdm"]


def child_env(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: ``base`` without ``DMX_*`` settings or API keys (the
    command line says everything), Triton's cache kept, output unbuffered, then ``extra``."""
    env = {k: v for k, v in base.items()
           if not k.startswith("DMX_") and k not in ("OPENAI_API_KEY", "API_KEY")}
    env.setdefault("TRITON_CACHE_DIR", TRITON_CACHE_DIR)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# -- prompts -----------------------------------------------------------------------------------
def first_id() -> int:
    """The first token id of a word (the demo tokenizer's special tokens come first)."""
    from dmi_sglang.adapters.demo_model import SPECIAL_TOKENS

    return len(SPECIAL_TOKENS)


def subset_prompts(vocab: int, n: int = SUBSET_PROMPTS, seed: int = SEED) -> list[list[int]]:
    """The deterministic subset's prompts: ``n`` fixed id lists of growing length, no
    special token."""
    rng = random.Random(seed)
    low = first_id()
    return [[rng.randrange(low, vocab) for _ in range(SUBSET_MIN_LEN + SUBSET_LEN_STEP * i)]
            for i in range(n)]


def mixed_prompts(vocab: int, n: int, max_len: int, seed: int) -> list[list[int]]:
    """``n`` random id lists of lengths spread over ``[max_len / 4, max_len]``."""
    rng = random.Random(seed)
    low = first_id()
    return [[rng.randrange(low, vocab) for _ in range(rng.randint(max(1, max_len // 4),
                                                                 max_len))]
            for _ in range(n)]


def generate_body(ids: Sequence[int], rid: str, new_tokens: int, *, stream: bool = False) -> Json:
    """A native ``/generate`` body: greedy, ``ignore_eos``, our request id."""
    return {"input_ids": list(ids), "rid": rid, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                "ignore_eos": True}}


# -- bench_serving's result ---------------------------------------------------------------------
def read_bench_line(text: str) -> Json:
    """The last JSON object of bench_serving's output file (it appends one line per run).

    Raises:
        ValueError: no JSON object in ``text``.
    """
    for line in reversed(text.splitlines()):
        if not line.strip():
            continue
        data = json.loads(line)
        if isinstance(data, dict):
            return data
    msg = "bench_serving wrote no result line"
    raise ValueError(msg)


_FIELD = re.compile(r"(#[a-z-]+|gen throughput \(token/s\)|cuda graph): ([0-9.]+|True|False)")


def scheduler_activity(log_text: str) -> Json:
    """What SGLang's scheduler logged (``--log-level info``) during a bench's main run:
    its prefill batches (``Prefill batch, #new-seq: N, #new-token: T, ...``) and its
    decode log lines (``Decode batch, #running-req: R, ... cuda graph: True, gen
    throughput (token/s): G, #queue-req: Q``, one per ``--decode-log-interval`` decode
    steps: a sample, so fast steps are over-represented in medians). The share of forwards
    that were prefills, the batch the decode steps ran at and whether they replayed a CUDA
    graph say whether the model or the traffic bounds a server."""
    prefills: list[dict[str, float]] = []
    decodes: list[dict[str, float]] = []
    for line in log_text.splitlines():
        kind = prefills if "Prefill batch" in line else decodes if "Decode batch" in line else None
        if kind is not None:
            kind.append({k: float(v == "True") if v in ("True", "False") else float(v)
                         for k, v in _FIELD.findall(line)})

    def median(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
        values = sorted(r[key] for r in rows if key in r)
        return values[len(values) // 2] if values else None

    return {"prefill_batches": len(prefills),
            "prefill_seqs": int(sum(r.get("#new-seq", 0.0) for r in prefills)),
            "prefill_tokens": int(sum(r.get("#new-token", 0.0) for r in prefills)),
            "decode_log_lines": len(decodes),
            "decode_running_p50": median(decodes, "#running-req"),
            "decode_running_max": max((r.get("#running-req", 0.0) for r in decodes),
                                      default=None),
            "decode_gen_tok_s_p50": median(decodes, "gen throughput (token/s)"),
            "decode_lines_eager": sum(1 for r in decodes if r.get("cuda graph") == 0.0),
            "queued_max": max((r.get("#queue-req", 0.0) for r in prefills + decodes),
                              default=None)}


def bench_figures(raw: Mapping[str, Any]) -> Json:
    """Our figures of one bench_serving result: rates, completed requests, duration and
    the TTFT / ITL / E2E percentiles in ms.

    Raises:
        ValueError: a field is missing (the client's output changed).
    """
    missing = [k for k in [*RATES.values(), "completed", "duration",
                           *(f for fs in LATENCIES.values() for f in fs)] if k not in raw]
    if missing:
        msg = f"bench_serving's result lacks {', '.join(missing)}"
        raise ValueError(msg)
    out: Json = {ours: float(raw[theirs]) for ours, theirs in RATES.items()}
    out |= {"completed": int(raw["completed"]), "duration_s": float(raw["duration"]),
            "total_output_tokens": raw.get("total_output_tokens"),
            "max_concurrency": raw.get("max_concurrency")}
    for name, fields in LATENCIES.items():
        out[name] = {p: float(raw[f]) for p, f in zip(PERCENTILES, fields, strict=True)}
    return out


BENCH_DETAILS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
                 "server_info")
"""Per-request fields of ``--output-details`` (and the server's info): not kept."""


def split_details(raw: Mapping[str, Any]) -> tuple[Json, Json]:
    """(the result without its per-request details, the failed requests: how many and the
    first errors)."""
    errors = [str(e) for e in raw.get("errors") or [] if e]
    kept = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in raw.items() if k not in BENCH_DETAILS}  # request_rate inf: strict JSON
    return kept, {"failed": len(errors), "first": [e[-500:] for e in errors[:3]]}


def _ratio(a: Any, b: Any) -> float | None:
    return float(a) / float(b) if isinstance(a, int | float) and isinstance(b, int | float) \
        and b else None


def ratios(stock: Mapping[str, Any], monitored: Mapping[str, Any]) -> Json:
    """Monitored / stock for every rate (below 1: slower) and latency (above 1: slower)."""
    out: Json = {k: _ratio(monitored.get(k), stock.get(k)) for k in RATES}
    for name in LATENCIES:
        s, m = stock.get(name) or {}, monitored.get(name) or {}
        out[name] = {p: _ratio(m.get(p), s.get(p)) for p in PERCENTILES}
    return out


# -- checks (pure) -----------------------------------------------------------------------------
def check_bench(bench: Mapping[str, Any] | None, num_prompts: int) -> Json:
    """Every bench_serving request succeeded."""
    figures = (bench or {}).get("figures") or {}
    completed = figures.get("completed")
    return {"ok": completed == num_prompts, "required": True, "completed": completed,
            "expected": num_prompts, "returncode": (bench or {}).get("returncode"),
            "error": (bench or {}).get("error")}


def check_tokens(stock: Sequence[Json] | None, monitored: Sequence[Json]) -> Json:
    """Subset output ids of the monitored server equal stock's, request by request."""
    if stock is None:
        return {"ok": False, "required": True, "error": "no stock subset to compare with"}
    return checks.token_identity(stock, monitored)


def check_status(answer: Mapping[str, Any], run_id: str, headers: Sequence[str | None]) -> Json:
    """``GET /dmi/status`` before the stop: 200, ``capturing``, our run; every subset
    response named the run in ``X-DMI-Run-Id``."""
    body = answer.get("body") or {}
    wrong = sorted({str(h) for h in headers if h != run_id})
    ok = answer.get("status") == 200 and isinstance(body, dict) and \
        body.get("state") == "capturing" and body.get("run_id") == run_id and not wrong
    return {"ok": ok, "required": True, "http_status": answer.get("status"), "answer": body,
            "run_id": run_id, "other_run_id_headers": wrong[:5]}


def check_before_stop(complete: Mapping[str, bool]) -> Json:
    """Every subset request read complete over HTTP while the run was still capturing (a
    request is committed when it finishes, before the run's stop)."""
    return {"ok": bool(complete) and all(complete.values()), "required": True,
            "complete": sum(complete.values()), "requests": len(complete)}


def check_stop(stop: Mapping[str, Any]) -> Json:
    """``POST /dmi/stop`` reached ``stopped``."""
    return {"ok": stop.get("state") == "stopped", "required": True, **stop}


def listed_ids(body: Any) -> set[str]:
    """Request ids in a ``GET /dmi/runs/RUN/requests`` answer: a list, or an object
    holding one under ``requests`` (or ``data``), of ids or objects with ``request_id``
    (or ``id``)."""
    items = body.get("requests", body.get("data", [])) if isinstance(body, dict) else body
    out: set[str] = set()
    for item in items if isinstance(items, list) else []:
        if isinstance(item, str):
            out.add(item)
        elif isinstance(item, dict):
            rid = item.get("request_id", item.get("id"))
            if rid is not None:
                out.add(str(rid))
    return out


def check_listing(answer: Mapping[str, Any], subset_ids: Sequence[str],
                  stored: Sequence[str] | None) -> Json:
    """``GET /dmi/runs/RUN/requests`` answered and lists every subset request; whether it
    lists exactly the requests the store holds is reported beside."""
    ids = listed_ids(answer.get("body"))
    absent = [r for r in subset_ids if r not in ids]
    same = None if stored is None else ids == set(stored)
    return {"ok": answer.get("status") == 200 and not absent and bool(subset_ids),
            "required": True, "http_status": answer.get("status"), "listed": len(ids),
            "subset_absent": absent[:10], "equals_store_listing": same,
            "stored": None if stored is None else len(stored)}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def compare_tensor(meta: Mapping[str, Any], web: torch.Tensor | None,
                   direct: torch.Tensor | None, positions: Sequence[int] | None) -> list[str]:
    """Why one listed tensor's HTTP copy differs from its listing or from the direct read
    (empty: equal)."""
    import torch

    name = meta.get("name")
    if web is None:
        return [f"{name}: not in the safetensors file"]
    if direct is None:
        return [f"{name}: not read from the store"]
    problems = []
    if list(web.shape) != list(meta.get("shape") or []):
        problems.append(f"{name}: shape {list(web.shape)}, listed {meta.get('shape')}")
    if dtype_name(web.dtype) != dtype_name(meta.get("dtype")):
        problems.append(f"{name}: dtype {dtype_name(web.dtype)}, listed {meta.get('dtype')}")
    if positions is not None and list(meta.get("positions") or []) != list(positions):
        problems.append(f"{name}: positions {meta.get('positions')}, store {list(positions)}")
    if web.dtype != direct.dtype or web.shape != direct.shape or \
            not torch.equal(web, direct):
        problems.append(f"{name}: values differ from the direct read "
                        f"({dtype_name(web.dtype)}{list(web.shape)} vs "
                        f"{dtype_name(direct.dtype)}{list(direct.shape)})")
    return problems


def check_readback(subset_ids: Sequence[str], web: Mapping[str, Json],
                   http_tensors: Mapping[str, Mapping[str, torch.Tensor]],
                   direct: Mapping[str, Any]) -> Json:
    """Per subset request: its listing answered, complete, with tensors; the safetensors
    file holds exactly the listed tensors; each equals its listing and the direct read."""
    problems: list[str] = []
    compared = 0
    for rid in subset_ids:
        got = web.get(rid) or {}
        raw = got.get("listing")
        listing: Json = raw if isinstance(raw, dict) else {}
        if got.get("status") != 200 or got.get("safetensors_status") != 200:
            problems.append(f"{rid}: listing answered {got.get('status')}, safetensors "
                            f"{got.get('safetensors_status')}")
            continue
        if listing.get("complete") is not True or listing.get("missing"):
            problems.append(f"{rid}: listed incomplete ({listing.get('missing')})")
        metas = [t for t in listing.get("tensors") or [] if isinstance(t, dict)]
        tensors = http_tensors.get(rid) or {}
        if not metas or set(tensors) != {t.get("name") for t in metas}:
            problems.append(f"{rid}: {len(metas)} tensors listed, file holds "
                            f"{sorted(tensors)[:5]}")
        read = (direct.get("tensors") or {}).get(rid) or {}
        where = (direct.get("positions") or {}).get(rid) or {}
        for meta in metas:
            name = str(meta.get("name"))
            problems += compare_tensor(meta, tensors.get(name), read.get(name), where.get(name))
            compared += 1
    errors = direct.get("errors") or {}
    problems += [f"{rid}: direct read of {name}: {why}" for rid, per in errors.items()
                 for name, why in per.items()]
    return {"ok": not problems and compared > 0, "required": True,
            "requests": len(subset_ids), "tensors_compared": compared,
            "problems": problems[:20], "problem_count": len(problems)}


def cancelled_ids(outcomes: Sequence[Json]) -> list[str]:
    """Request ids the cancelling client closed mid-stream."""
    return [o["rid"] for o in outcomes if o.get("outcome") == "cancelled"]


def check_complete(direct: Mapping[str, Any], *, cancels: Sequence[Json],
                   known: Sequence[str], bench_completed: int | None) -> Json:
    """Every stored request but those the cancelling client did not let finish, and
    every ``known`` request (warm-up, subset), is complete; at least as many bench
    requests are stored as ``bench_completed`` (every bench's completed requests and its
    own warm-up)."""
    missing: Mapping[str, Sequence[str]] = direct.get("missing") or {}
    cancel_ids = {str(o["rid"]) for o in cancels}
    unfinished = {str(o["rid"]) for o in cancels if o.get("outcome") in UNFINISHED_OUTCOMES}
    stored = set(direct.get("stored") or [])
    expected = (stored - unfinished) | set(known)
    unread = sorted(r for r in expected if r not in missing)
    incomplete = {r: list(missing[r])[:2] for r in sorted(expected) if missing.get(r)}
    bench = len(stored - cancel_ids - set(known))
    problems = []
    if unread:
        problems.append(f"{len(unread)} requests not read back: {unread[:5]}")
    if incomplete:
        problems.append(f"{len(incomplete)} requests incomplete")
    if bench_completed is None or bench < bench_completed:
        problems.append(f"{bench} bench requests stored, bench_serving completed "
                        f"{bench_completed}")
    return {"ok": not problems, "required": True, "expected_complete": len(expected),
            "bench_stored": bench, "bench_completed": bench_completed,
            "incomplete_examples": dict(list(incomplete.items())[:5]), "problems": problems}


def check_cancelled(direct: Mapping[str, Any], cancels: Sequence[Json]) -> Json:
    """At least one request was cancelled mid-stream, none of those reads complete, and no
    abort was ignored (a stream that finished normally after its abort was sent)."""
    missing: Mapping[str, Sequence[str]] = direct.get("missing") or {}
    ids = cancelled_ids(cancels)
    complete = [r for r in ids if r in missing and not missing[r]]
    unread = [r for r in ids if r not in missing]
    outcomes: dict[str, int] = {}
    for o in cancels:
        outcomes[str(o.get("outcome"))] = outcomes.get(str(o.get("outcome")), 0) + 1
    ignored = outcomes.get("abort_ignored", 0)
    return {"ok": bool(ids) and not complete and not unread and not ignored,
            "required": True, "cancelled": len(ids), "outcomes": outcomes,
            "abort_ignored": ignored, "read_complete_count": len(complete),
            "read_complete": complete[:10], "not_read": unread[:10]}


def check_export_benches(rounds: Sequence[Json], num_prompts: int) -> Json:
    """Every request of both benches of every export round succeeded, as
    :func:`check_bench` judges the main bench (the export bench's throughput is the
    export's cost figure)."""
    short = [f"round {i} {k}: {c['completed']} completed"
             for i, r in enumerate(rounds, 1) for k in ("bench", "after")
             if not (c := check_bench({"figures": r.get(k)}, num_prompts))["ok"]]
    return {"ok": bool(rounds) and not short, "required": True, "expected": num_prompts,
            "short": short}


def check_committed(direct: Mapping[str, Any]) -> Json:
    """The run reads ``committed`` once the server is gone."""
    status = direct.get("run_status")
    return {"ok": status == "committed", "required": True, "run_status": status,
            "error": direct.get("error")}


def check_exit(stopped: Mapping[str, Any] | None) -> Json:
    """The server was running until the SIGINT, then exited by itself with status 0 (its
    group was not killed for it; ``serve`` exits 4 when its final stop was not durable)."""
    s = stopped or {}
    return {"ok": bool(s) and not s.get("killed") and not s.get("exited_before_stop")
            and s.get("returncode") == 0, "required": True, **s}


# -- summary -----------------------------------------------------------------------------------
def overall_status(checks_: Mapping[str, Mapping[str, Any]], skipped: Sequence[str]) -> str:
    """``failed`` when a required check failed (or there is none), else ``skipped`` when a
    mode did not fit, else ``passed``."""
    required = [c for c in checks_.values() if c.get("required", True)]
    if not required or not all(c.get("ok") for c in required):
        return "failed"
    return "skipped" if skipped else "passed"


EXIT_STATUS = {"passed": 0, "skipped": 3}


def table_rows(figures: Mapping[str, Json], stock: str = "stock") -> list[Json]:
    """One row per measured server: its figures and, for a mode, its ratios to stock."""
    base = figures.get(stock)
    return [{"server": name, "figures": fig,
             "ratios": ratios(base, fig) if base and name != stock else None}
            for name, fig in figures.items()]


def render(rows: Sequence[Json], checks_: Mapping[str, Mapping[str, Any]]) -> str:
    """The figures as a table (ratios to stock beneath each mode) and every check."""
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def trio(d: Any, fmt: str) -> str:
        d = d or {}
        return "/".join(num(d.get(p), fmt) for p in PERCENTILES)

    head = (f"{'server':<24} {'req/s':>8} {'out tok/s':>10} {'TTFT p50/90/99 ms':>22} "
            f"{'ITL p50/90/99 ms':>20} {'E2E p50/90/99 ms':>24}")
    lines = [head, "-" * len(head)]
    for row in rows:
        f = row["figures"] or {}
        lines.append(f"{row['server']:<24} {num(f.get('request_throughput'), '.2f'):>8} "
                     f"{num(f.get('output_tok_s'), '.0f'):>10} "
                     f"{trio(f.get('ttft_ms'), '.1f'):>22} {trio(f.get('itl_ms'), '.2f'):>20} "
                     f"{trio(f.get('e2e_ms'), '.0f'):>24}")
        r = row["ratios"]
        if r:
            lines.append(f"{'  x stock':<24} {num(r.get('request_throughput'), '.3f'):>8} "
                         f"{num(r.get('output_tok_s'), '.3f'):>10} "
                         f"{trio(r.get('ttft_ms'), '.2f'):>22} {trio(r.get('itl_ms'), '.2f'):>20} "
                         f"{trio(r.get('e2e_ms'), '.2f'):>24}")
    lines.append("")
    lines += [f"{'PASS' if c.get('ok') else 'FAIL'}  {name}" if c.get("required", True) else
              f"info  {name}: {'yes' if c.get('ok') else 'no'}" for name, c in checks_.items()]
    return "\n".join(lines)


# -- processes ---------------------------------------------------------------------------------
class Reply(NamedTuple):
    """One HTTP answer: status, body, headers (lower-case names)."""

    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        """The body as JSON, or its text when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return self.body.decode(errors="replace")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The key as SGLang reads it (``Authorization: Bearer``) and as ``X-API-Key``."""
    return {"Authorization": f"Bearer {api_key}", "X-API-Key": api_key} if api_key else {}


def free_port() -> int:
    """A TCP port free on :data:`HOST` now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class GroupRecord:
    """The process groups this benchmark started and has not ended yet, in a file, so
    that the next invocation ends what a cut-off one left (:meth:`kill_leftovers`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def add(self, pgid: int) -> None:
        """Record ``pgid``."""
        with self.lock:
            track_group(self.path, pgid, add=True)

    def remove(self, pgid: int) -> None:
        """Forget ``pgid``."""
        with self.lock:
            track_group(self.path, pgid, add=False)

    def kill_leftovers(self) -> list[int]:
        """Kill every recorded group whose leader is still one of ours; the groups."""
        with self.lock:
            return kill_leftovers(self.path, PGID_MARKERS)


class Server:
    """One HTTP server child (stock SGLang, ``dmi-sglang serve``, or the dry run's fake) in
    its own process group, its log, and HTTP calls to it."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], *, port: int,
                 log: Path, api_key: str | None, groups: GroupRecord | None = None) -> None:
        self.name, self.argv, self.env, self.port = name, list(argv), dict(env), port
        self.log, self.api_key, self.groups = log, api_key, groups
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT``."""
        return f"http://{HOST}:{self.port}"

    @property
    def pgid(self) -> int:
        """The child's process group (it leads its own); -1 before :meth:`start`."""
        return self.proc.pid if self.proc is not None else -1

    def start(self, timeout_s: float) -> float:
        """Start the child and wait until ``GET /v1/models`` answers 200; the seconds.

        Raises:
            ServerError: it exited, or did not answer within ``timeout_s``.
        """
        t0 = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=REPO, start_new_session=True)
        if self.groups is not None:
            self.groups.add(self.proc.pid)
        while True:
            if self.proc.poll() is not None:
                msg = f"{self.name}: exited with {self.proc.returncode} while starting"
                raise ServerError(msg + self.tail())
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self.call("GET", "/v1/models", timeout_s=5.0).status == 200:
                    break
            if time.monotonic() - t0 > timeout_s:
                msg = f"{self.name}: not up after {timeout_s:.0f} s"
                raise ServerError(msg + self.tail())
            time.sleep(1.0)
        self.start_s = time.monotonic() - t0
        return self.start_s

    def call(self, method: str, path: str, body: Any = None, *,
             timeout_s: float = HTTP_S) -> Reply:
        """One HTTP call (with the API key); an HTTP error status is an answer.

        Raises:
            OSError: no connection, or no answer within ``timeout_s``.
        """
        req = urllib.request.Request(
            self.url + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **auth_headers(self.api_key)})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return Reply(resp.status, resp.read(),
                             {k.lower(): v for k, v in resp.headers.items()})
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, exc.read(), {k.lower(): v for k, v in exc.headers.items()})

    def answer(self, method: str, path: str, body: Any = None, *,
               timeout_s: float = HTTP_S) -> Json:
        """``{"status", "body"}`` of one call (``body`` parsed as JSON where it is)."""
        reply = self.call(method, path, body, timeout_s=timeout_s)
        return {"status": reply.status, "body": reply.json()}

    def stop(self, grace_s: float) -> Json:
        """SIGINT to the server, up to ``grace_s`` for its exit, then its whole group
        killed (``killed``: the server itself had to be; ``leftover``: only processes it
        left behind)."""
        if self.proc is None:
            return {}
        t0 = time.monotonic()
        killed = False
        exited_before = self.proc.poll() is not None
        if not exited_before:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=max(grace_s, 1.0))
            except subprocess.TimeoutExpired:
                killed = True
        exit_s = time.monotonic() - t0
        leftover = self._end_group()
        return {"exit_s": round(exit_s, 2), "returncode": self.proc.returncode,
                "killed": killed, "leftover": leftover, "exited_before_stop": exited_before}

    def _end_group(self) -> bool:
        """Wait briefly for the group to empty, then kill what is left; whether any was."""
        assert self.proc is not None
        pgid = self.proc.pid
        for _ in range(20):
            if not group_alive(pgid):
                break
            time.sleep(0.5)
        alive = group_alive(pgid)
        if alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            time.sleep(2.0)  # let the driver release the GPU memory
        if self.groups is not None:
            self.groups.remove(pgid)
        return alive

    def tail(self, chars: int = LOG_TAIL) -> str:
        """The end of the server's log, introduced by its path."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"\n--- {self.log}\n{text[-chars:]}"


def stream_and_close(server: Server, body: Json, events: int, timeout_s: float) -> Json:
    """POST a streamed ``/generate``, cancel it after ``events`` events with SGLang's
    ``POST /abort_request`` while the stream is still open, and read the stream to its
    end (within ``timeout_s`` in all): ``cancelled`` when its last event reports an
    ``abort`` finish after the abort was sent, ``server_abort`` when the server aborted
    it before (a refusal, not a cancel), ``abort_ignored`` when the abort was sent and the
    request finished otherwise, ``finished`` when it ended before the abort, ``error``
    when the stream broke, reported an error or did not end in time.

    The abort is sent before the connection closes because SGLang 0.5.19 forgets a
    streamed request whose client went away (``TokenizerManager.generate_request``
    drops its state on the cancellation) while its scheduler runs it on to its end; an
    abort after the close is then a no-op. Its own abort 2 s after a disconnect
    (``create_abort_task``) is a no-op for the same reason."""
    req = urllib.request.Request(
        server.url + "/generate", method="POST", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth_headers(server.api_key)})
    seen, abort_status, last = 0, None, None
    end = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            while True:
                line = resp.readline()
                if not line or line.strip() == b"data: [DONE]":
                    break
                if time.monotonic() > end:
                    msg = f"the stream did not end within {timeout_s:g} s"
                    raise TimeoutError(msg)
                if line.startswith(b"data: {"):
                    seen += 1
                    last = json.loads(line[len(b"data: "):])
                    if "error" in last:
                        raise ValueError(f"the stream reported {last['error']!r}")
                if seen == events and abort_status is None:
                    abort_status = server.answer("POST", "/abort_request",
                                                 {"rid": body["rid"]},
                                                 timeout_s=timeout_s)["status"]
    except Exception as exc:  # a refused, broken or failed stream is this request's outcome
        return {"rid": body["rid"], "outcome": "error", "events": seen, "error": repr(exc)}
    reason = ((last or {}).get("meta_info") or {}).get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    outcome = ("server_abort" if kind == "abort" and abort_status is None else
               "cancelled" if kind == "abort" else
               "finished" if abort_status is None else "abort_ignored")
    return {"rid": body["rid"], "outcome": outcome, "events": seen,
            "abort_status": abort_status, "finish": kind}


class Exporter:
    """One client downloading the safetensors files of ``ids`` (round and round, at most
    ``target_bytes``) from :meth:`start` to :meth:`stop`: a file still downloading at the
    stop finishes, but counts apart (``bytes_after_stop``), so ``bytes`` and ``seconds``
    are the export within the window."""

    def __init__(self, server: Server, run_id: str, ids: Sequence[str], target_bytes: int,
                 timeout_s: float) -> None:
        self.server, self.ids = server, list(ids)
        self.target, self.timeout_s = target_bytes, timeout_s
        self.run_q = urllib.parse.quote(run_id, safe="")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="serve-load-export", daemon=True)
        self._got = {"bytes": 0, "files": 0, "errors": 0, "bytes_after_stop": 0}
        self._t0 = self._t1 = 0.0
        self._last_file_end = 0.0

    def start(self) -> None:
        """Begin downloading."""
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self, timeout_s: float) -> Json:
        """Start no more files, wait up to ``timeout_s`` for the one in flight; the
        figures of the window."""
        self._t1 = time.monotonic()
        self._stop.set()
        if self._thread.ident is None:  # never started (the bench failed before its run)
            self._t0 = self._t1
        else:
            self._thread.join(timeout_s)
        window = max(self._t1 - self._t0, 1e-9)
        busy = max(min(self._last_file_end, self._t1) - self._t0, 0.0)
        return {**self._got, "target_bytes": self.target, "seconds": round(window, 2),
                "mb_s": round(self._got["bytes"] / 1e6 / window, 1),
                "target_reached_s": round(busy, 2) if self._got["bytes"] >= self.target
                else None}

    def _work(self) -> None:
        k = 0
        while self.ids and not self._stop.is_set() and self._got["bytes"] < self.target:
            rid = urllib.parse.quote(self.ids[k % len(self.ids)], safe="")
            reply = self.server.call(
                "GET", f"/dmi/runs/{self.run_q}/requests/{rid}/safetensors",
                timeout_s=self.timeout_s)
            k += 1
            if reply.status != 200:
                self._got["errors"] += 1
            elif self._stop.is_set():
                self._got["bytes_after_stop"] += len(reply.body)
            else:
                self._got["bytes"] += len(reply.body)
                self._got["files"] += 1
                self._last_file_end = time.monotonic()


class Canceller:
    """The cancelling client: :data:`CANCEL_WORKERS` threads sending streamed requests
    that each abort after :data:`CANCEL_EVENTS` events (:func:`stream_and_close`)."""

    def __init__(self, server: Server, prompts: Sequence[Sequence[int]],
                 interval_s: float = CANCEL_INTERVAL_S, *, prefix: str = "cancel") -> None:
        self.server, self.prompts, self.interval_s = server, list(prompts), interval_s
        self.prefix = prefix
        """Request ids are ``PREFIX-NNNNN``: one prefix per bench, so that no bench on a
        server reuses another's ids."""
        self.outcomes: list[Json] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"cancel-{i}")
                         for i in range(CANCEL_WORKERS)]
        self.started_at: float | None = None

    def start(self) -> None:
        """Start sending (once)."""
        if self.started_at is None:
            self.started_at = time.monotonic()
            for t in self._threads:
                t.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i = self._next
                self._next += 1
            if i >= len(self.prompts):
                return
            # fixed width: SGLang aborts every request whose id starts with the one named
            body = generate_body(self.prompts[i], f"{self.prefix}-{i:05d}", CANCEL_NEW_TOKENS,
                                 stream=True)
            outcome = stream_and_close(self.server, body, CANCEL_EVENTS, HTTP_S)
            with self._lock:
                self.outcomes.append(outcome)
            self._stop.wait(self.interval_s)

    def join(self, timeout_s: float) -> list[Json]:
        """Wait up to ``timeout_s`` for every request, then stop sending; the outcomes."""
        end = time.monotonic() + timeout_s
        for t in self._threads:
            if t.is_alive():
                t.join(max(end - time.monotonic(), 0.0))
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(5.0)
        with self._lock:
            return sorted(self.outcomes, key=lambda o: int(o["rid"].split("-")[-1]))


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_span(path: Path, start: int, end: int) -> str:
    """The text of ``path`` between byte offsets ``start`` and ``end`` ("" without it)."""
    if end <= start or not path.exists():
        return ""
    with path.open("rb") as fh:
        fh.seek(start)
        return fh.read(end - start).decode(errors="replace")


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether ``text`` appeared in ``path`` before ``proc`` exited or ``timeout_s`` passed."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def load_safetensors(blob: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes."""
    from safetensors.torch import load

    tensors: dict[str, torch.Tensor] = load(blob)
    return tensors


def direct_read(url: str, run_id: str, ids: Sequence[str],
                listings: Mapping[str, Json]) -> Json:
    """The store read directly (the server is gone): the run's status, the requests it
    holds, what each of those and of ``ids`` misses, and every tensor the ``listings``
    name (``handle.get(hook, layer)``) with its positions."""
    from dmi_sglang import open_store

    store = open_store(url)
    t0 = time.monotonic()
    out: Json = {"tensors": {}, "positions": {}, "errors": {}}
    with store.session():
        run = store.run(run_id)
        out["run_status"] = run.status.value if run is not None else None
        out["stored"] = [r.request_id for r in store.requests(run_id)] if run else []
        out["missing"] = {rid: list(store.handle(run_id, rid).missing)
                          for rid in sorted({*out["stored"], *ids})}
        for rid, listing in listings.items():
            handle = store.handle(run_id, rid)
            for meta in listing.get("tensors") or []:
                name, hook, layer = str(meta.get("name")), str(meta.get("hook")), \
                    meta.get("layer")
                try:
                    out["tensors"].setdefault(rid, {})[name] = handle.get(hook, layer)
                    where = handle.positions(hook, layer)
                    out["positions"].setdefault(rid, {})[name] = [where.start, where.stop,
                                                                  where.step]
                except Exception as exc:  # reported by the readback check
                    out["errors"].setdefault(rid, {})[name] = f"{type(exc).__name__}: {exc}"
    out["read_s"] = round(time.monotonic() - t0, 2)
    return out


# -- one invocation ----------------------------------------------------------------------------
@dataclass
class ServerRun:
    """What one server did: its command, timings, bench, subset and (monitored) readback."""

    name: str
    mode: str | None
    detail: Json = field(default_factory=dict)
    figures: Json | None = None
    subset: list[Json] | None = None
    checks: dict[str, Json] = field(default_factory=dict)


class ServeLoad:
    """The servers of one invocation, in order (stock first), and the result."""

    def __init__(self, plan: Plan, work: Path, deadline: Deadline,
                 groups: GroupRecord | None) -> None:
        self.plan, self.work, self.deadline, self.groups = plan, work, deadline, groups
        self.model_dir: Path | None = None
        self.vocab = 0
        self.terminating = False
        self.stock_s: float | None = None
        self.mode_s: float | None = None
        self.out: Path | None = None

    # time ----------------------------------------------------------------------------
    def limit(self, cap: float) -> float:
        """``cap`` seconds, or what is left before the deadline less :data:`RESERVE_S`.

        Raises:
            DeadlineReachedError: nothing is left.
        """
        left = self.deadline.left() - RESERVE_S
        if left <= 1.0:
            msg = f"the deadline ({os.environ.get('DMI_HARNESS_DEADLINE_S')} s) is reached"
            raise DeadlineReachedError(msg)
        return min(cap, left)

    def soft_limit(self, cap: float) -> float:
        """``cap``, or what is left before the deadline (at least a second): for cleanup,
        which must not raise."""
        return max(min(cap, self.deadline.left() - 5.0), 1.0)

    def mode_estimate(self) -> float:
        """Seconds one monitored server should take: the last one's, else from the stock
        server's load."""
        if self.mode_s is not None:
            return 1.2 * self.mode_s
        load = self.stock_s if self.stock_s is not None else 120.0
        # export: two benches more per round
        benches = 1.5 + (2.0 * self.plan.export_rounds if self.plan.export_gb > 0 else 0.0)
        return START_WARM_EST_S + benches * load + MODE_TAIL_EST_S

    # commands ------------------------------------------------------------------------
    def wrap(self, argv: list[str]) -> list[str]:
        """A server command as run: itself, or in a dry run the fake server given the
        same arguments."""
        if not self.plan.dry_run:
            return argv
        return [argv[0], "-m", "harness.serve_fake", "fake-server", *argv[1:]]

    def bench_launcher(self) -> list[str]:
        """How bench_serving is started (a dry run without the ``datasets`` package, which
        bench_serving imports and random ids never use, goes through a stub)."""
        if self.plan.dry_run and importlib.util.find_spec("datasets") is None:
            return [sys.executable, "-m", "harness.serve_fake", "bench-shim"]
        return [sys.executable, "-m", "sglang.bench_serving"]

    # phases --------------------------------------------------------------------------
    def prepare(self) -> None:
        """The model directory (with its tokenizer) and its vocabulary size."""
        from dmi_sglang.adapters.demo_model import write_demo_checkpoint

        root = self.work / "models"
        if self.plan.model == "demo":
            self.model_dir = write_demo_checkpoint(root / "qwen3-demo", layers=4)
        else:
            m = MODELS[self.plan.model]
            self.model_dir = write_demo_checkpoint(
                root / f"{m.name}-random", layers=m.layers, hidden=m.hidden, heads=m.heads,
                kv_heads=m.kv_heads, head_dim=m.head_dim, intermediate=m.intermediate,
                vocab=m.vocab)
        self.vocab = int(json.loads((self.model_dir / "config.json").read_text())["vocab_size"])

    def warm(self, server: Server) -> Json:
        """Concurrent warm-up requests of mixed lengths; the ids answered 200, the
        failures and the seconds.

        Raises:
            ServerError: none was answered 200.
        """
        prompts = mixed_prompts(self.vocab, WARMUP_REQUESTS, self.plan.input_len, SEED + 1)
        t0 = time.monotonic()
        replies: list[Reply | None] = [None] * len(prompts)

        errors: dict[int, str] = {}
        timeout_s = self.limit(HTTP_S)

        def send(i: int) -> None:
            try:
                replies[i] = server.call("POST", "/generate", generate_body(
                    prompts[i], f"warmup-{i}", WARMUP_NEW_TOKENS), timeout_s=timeout_s)
            except OSError as exc:
                errors[i] = repr(exc)

        threads = [threading.Thread(target=send, args=(i,), daemon=True)
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        end = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(end - time.monotonic(), 0.0))
        failed = {f"warmup-{i}": errors.get(i) if r is None else
                  f"{r.status}: {r.body[:300].decode(errors='replace')}"
                  for i, r in enumerate(replies) if r is None or r.status != 200}
        if len(failed) == len(prompts):
            msg = f"{server.name}: every warm-up request failed ({next(iter(failed.values()))})"
            raise ServerError(msg + server.tail())
        return {"ids": [f"warmup-{i}" for i in range(len(prompts))
                        if f"warmup-{i}" not in failed],
                "failed": failed, "seconds": round(time.monotonic() - t0, 2)}

    def bench(self, server: Server, name: str, exporter: Exporter | None = None) -> Json:
        """bench_serving against ``server`` with the cancelling client beside it (and
        ``exporter`` downloading during exactly its main run: its figures in ``export``)."""
        assert self.model_dir is not None
        out_file = self.work / f"bench-{slug(name)}.jsonl"
        log = self.work / f"bench-{slug(name)}.log"
        out_file.unlink(missing_ok=True)
        argv = bench_argv(self.plan, server.port, self.model_dir, out_file,
                          self.bench_launcher())
        env = child_env(os.environ, {"OPENAI_API_KEY": self.plan.api_key}
                        if self.plan.api_key else None)
        cancels = Canceller(server, mixed_prompts(self.vocab, self.plan.cancel_requests,
                                                  self.plan.input_len, SEED + 2),
                            prefix=f"cancel-{slug(name)}")
        info: Json = {"argv": masked(argv), "log": str(log)}
        t0 = time.monotonic()
        window = [0, 0]  # the server log's bytes written during the main run
        with log.open("w") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO, start_new_session=True)
        try:
            info["main_run_seen"] = _wait_for_text(log, BENCH_MAIN_MARK, proc,
                                                   self.limit(BENCH_MAIN_WAIT_S))
            window[0] = _size(server.log)
            cpu = group_cpu(server.pgid)
            cancels.start()
            if exporter is not None:
                exporter.start()
            info["returncode"] = proc.wait(timeout=self.limit(BENCH_S))
            window[1] = _size(server.log)
            info["cpu_seconds"] = cpu_between(cpu, group_cpu(server.pgid))
        except subprocess.TimeoutExpired:
            info["error"] = "bench_serving did not finish in time (killed)"
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            if exporter is not None:
                info["export"] = exporter.stop(self.soft_limit(HTTP_S))
            info["cancels"] = cancels.join(self.soft_limit(HTTP_S))
        info["seconds"] = round(time.monotonic() - t0, 2)
        info["scheduler"] = scheduler_activity(_read_span(server.log, *window))
        busy = ", ".join(f"{k} {v:.1f}" for k, v in (info.get("cpu_seconds") or {}).items()
                         if v >= 0.1)
        print(f"[serve-load] {name}: CPU seconds of the server's processes during the "
              f"bench: {busy or 'none read'}", flush=True)
        try:
            raw = read_bench_line(out_file.read_text() if out_file.exists() else "")
            info["figures"] = bench_figures(raw)
            info["raw"], info["request_errors"] = split_details(raw)
        except ValueError as exc:
            text = log.read_text(errors="replace") if log.exists() else ""
            info["error"] = f"{info.get('error') or ''} {exc}".strip()
            info["log_tail"] = text[-LOG_TAIL:]
        return info

    def subset(self, server: Server) -> list[Json]:
        """The deterministic subset, one request at a time; each one's output.

        Raises:
            ServerError: a request was not answered 200.
        """
        outs = []
        for i, ids in enumerate(subset_prompts(self.vocab)):
            reply = server.call("POST", "/generate",
                                generate_body(ids, f"subset-{i}", SUBSET_NEW_TOKENS),
                                timeout_s=self.limit(HTTP_S))
            body = reply.json()
            if reply.status != 200 or not isinstance(body, dict):
                msg = f"{server.name}: subset-{i} answered {reply.status}: {str(body)[:300]}"
                raise ServerError(msg)
            meta = body.get("meta_info") or {}
            outs.append({"key": f"subset-{i}", "id": str(meta.get("id")),
                         "output_ids": list(body.get("output_ids") or []),
                         "prompt_tokens": meta.get("prompt_tokens"),
                         "completion_tokens": meta.get("completion_tokens"),
                         "run_id_header": reply.headers.get("x-dmi-run-id")})
        return outs

    def stop_run(self, server: Server) -> Json:
        """``POST /dmi/stop``, then ``GET /dmi/status`` until the run is no longer
        stopping."""
        t0 = time.monotonic()
        first = server.answer("POST", "/dmi/stop", timeout_s=self.limit(STOP_WAIT_S))
        body = first["body"] if isinstance(first["body"], dict) else {}
        end = time.monotonic() + self.limit(STOP_WAIT_S)
        while body.get("state") in ("stopping", "capturing") and time.monotonic() < end:
            time.sleep(1.0)
            again = server.answer("GET", "/dmi/status", timeout_s=self.limit(HTTP_S))
            body = again["body"] if isinstance(again["body"], dict) else {}
        return {"http_status": first["status"], "state": body.get("state"),
                "reason": body.get("reason"), "seconds": round(time.monotonic() - t0, 3)}

    def fetch(self, server: Server, run: str, rid: str, file: Path) -> Json:
        """One request's listing and safetensors file (saved as ``file``)."""
        path = f"/dmi/runs/{run}/requests/{urllib.parse.quote(rid, safe='')}"
        listing = server.answer("GET", path, timeout_s=self.limit(HTTP_S))
        blob = server.call("GET", path + "/safetensors", timeout_s=self.limit(HTTP_S))
        file.write_bytes(blob.body)
        body = listing["body"]
        return {"status": listing["status"], "listing": body,
                "safetensors_status": blob.status, "bytes": len(blob.body), "file": str(file),
                "complete": isinstance(body, dict) and body.get("complete") is True
                and listing["status"] == 200 and blob.status == 200}

    def export_under_load(self, server: Server, run_id: str, run: ServerRun) -> Json:
        """``--export-rounds`` rounds of two benches: one during whose main run a client
        downloads the safetensors files of the run's committed requests (largest first,
        round and round, at most ``--export-gb`` GB), then one without it. Per round the
        bytes and the rate within the main run, and the export bench's throughput against
        the mean of the plain benches before and after it on the same server (bracketed so
        that a server warming up or slowing down over its benches does not count as the
        export's); overall the median of the rounds' ratios and their spread."""
        run_q = urllib.parse.quote(run_id, safe="")
        listed = server.answer("GET", f"/dmi/runs/{run_q}/requests",
                               timeout_s=self.limit(HTTP_S))["body"]
        rows = listed.get("requests", []) if isinstance(listed, dict) else []
        ids = [str(r["request_id"]) for r in sorted(
            (r for r in rows if isinstance(r, dict) and r.get("committed")),
            key=lambda r: -int(r.get("bytes") or 0))]
        before: Json | None = run.figures
        rounds: list[Json] = []
        for number in range(1, self.plan.export_rounds + 1):
            suffix = "" if self.plan.export_rounds == 1 else f"-{number}"
            exporter = Exporter(server, run_id, ids, int(self.plan.export_gb * 1e9),
                                self.limit(HTTP_S))
            bench = self.bench(server, f"{run.name}-export{suffix}", exporter)
            after = self.bench(server, f"{run.name}-after-export{suffix}")
            rounds.append(_export_round(bench, before, after))
            before = after.get("figures")
            print(f"[serve-load] {run.name}: round {number}: exported "
                  f"{rounds[-1].get('bytes', 0) / 1e6:,.0f} MB in {rounds[-1].get('files', 0)} "
                  f"files during a bench's main run: throughput "
                  f"x{rounds[-1]['throughput_ratio'] or 0:.3f} of the plain benches before "
                  "and after it", flush=True)
        ratios = [r["throughput_ratio"] for r in rounds if r["throughput_ratio"]]
        ratio = statistics.median(ratios) if len(ratios) == len(rounds) else None
        if ratio is not None and len(ratios) > 1:
            print(f"[serve-load] {run.name}: the export's cost {1 - ratio:.1%} (median of "
                  f"{len(ratios)} rounds; ratios {min(ratios):.3f}-{max(ratios):.3f})",
                  flush=True)
        return {"committed_requests": len(ids), "rounds": rounds,
                **{k: sum(int(r.get(k) or 0) for r in rounds)
                   for k in ("bytes", "files", "errors", "bytes_after_stop")},
                "cancels": [c for r in rounds for c in r["cancels"]],
                "throughput_ratio": ratio,
                "cost": None if ratio is None else round(1 - ratio, 4),
                "cost_spread": round(max(ratios) - min(ratios), 4)
                if ratio is not None else None}

    def wait_committed(self, server: Server, run: str, rids: Sequence[str]) -> float:
        """Seconds until every listed request read complete (a request commits shortly
        after it finished), at most :data:`COMMIT_WAIT_S`; the fetches after report
        what was not."""
        t0 = time.monotonic()
        left = list(rids)
        while left and time.monotonic() - t0 < COMMIT_WAIT_S:
            answer = server.answer("GET", f"/dmi/runs/{run}/requests/"
                                   f"{urllib.parse.quote(left[0], safe='')}",
                                   timeout_s=self.limit(HTTP_S))
            body = answer["body"]
            if answer["status"] == 200 and isinstance(body, dict) and body.get("complete"):
                left.pop(0)
            else:
                time.sleep(0.2)
        return round(time.monotonic() - t0, 3)

    def http_readback(self, server: Server, run_id: str, subset: Sequence[Json],
                      into: Path) -> Json:
        """While the run captures: its status, request list and each subset request's
        listing and safetensors file; then the stop; then the list again, and each subset
        request not complete before the stop fetched again (files saved under ``into``)."""
        into.mkdir(parents=True, exist_ok=True)
        run = urllib.parse.quote(run_id, safe="")
        out: Json = {"status": server.answer("GET", "/dmi/status", timeout_s=self.limit(HTTP_S))}
        listed = server.answer("GET", f"/dmi/runs/{run}/requests", timeout_s=self.limit(HTTP_S))
        out["list_before_stop"] = {"status": listed["status"],
                                   "listed": len(listed_ids(listed["body"]))}
        out["commit_wait_s"] = self.wait_committed(server, run, [o["id"] for o in subset])
        before = {o["id"]: self.fetch(server, run, o["id"], into / f"{slug(o['id'])}-before.st")
                  for o in subset}
        out["before_stop"] = {rid: r["complete"] for rid, r in before.items()}
        out["stop"] = self.stop_run(server)
        listed = server.answer("GET", f"/dmi/runs/{run}/requests", timeout_s=self.limit(HTTP_S))
        out["list"] = {"status": listed["status"], "ids": sorted(listed_ids(listed["body"])),
                       "body_head": json.dumps(listed["body"])[:500]}
        out["requests"] = {
            rid: (r | {"fetched": "before stop"}) if r["complete"] else
            self.fetch(server, run, rid, into / f"{slug(rid)}-after.st") | {
                "fetched": "after stop"}
            for rid, r in before.items()}
        return out

    def start_server(self, name: str, argv: list[str], env: Mapping[str, str]) -> Server:
        """A started server (``name``'s log in the work directory)."""
        server = Server(name, self.wrap(argv), env, port=int(argv[argv.index("--port") + 1]),
                        log=self.work / f"server-{slug(name)}.log", api_key=self.plan.api_key,
                        groups=self.groups)
        print(f"[serve-load] {name}: starting", flush=True)
        try:
            server.start(self.limit(START_S))
        except BaseException:
            server.stop(0.0)
            raise
        print(f"[serve-load] {name}: up after {server.start_s:.0f} s", flush=True)
        return server

    def grace(self) -> float:
        """How long a stopping server may take to exit."""
        if self.terminating:
            return 5.0
        return max(min(EXIT_S, self.deadline.left() - 5.0), 5.0)

    def load(self, server: Server, run: ServerRun) -> None:
        """Warm-up, bench with cancels, subset: into ``run``."""
        t0 = time.monotonic()
        run.detail["warmup"] = self.warm(server)
        bench = self.bench(server, run.name)
        run.detail["bench"] = bench
        run.figures = bench.get("figures")
        done = bench.get("figures") or {}
        print(f"[serve-load] {run.name}: bench {done.get('completed')} requests, "
              f"{done.get('output_tok_s', 0):.0f} out tok/s, "
              f"{len(cancelled_ids(bench['cancels']))} cancelled", flush=True)
        sched = bench["scheduler"]
        print(f"[serve-load] {run.name}: scheduler logged {sched['prefill_batches']} prefill "
              f"batches ({sched['prefill_seqs']} requests), decode at "
              f"{sched['decode_running_p50']} running requests (max "
              f"{sched['decode_running_max']}) and "
              f"{sched['decode_gen_tok_s_p50']} tok/s (p50 of "
              f"{sched['decode_log_lines']} lines, {sched['decode_lines_eager']} without a CUDA "
              f"graph), queue max {sched['queued_max']}",
              flush=True)
        run.subset = self.subset(server)
        run.detail["load_s"] = round(time.monotonic() - t0, 2)
        run.checks["bench_complete"] = check_bench(bench, self.plan.num_prompts)

    def run_stock(self, run: ServerRun) -> None:
        """The stock server and its load, into ``run``."""
        assert self.model_dir is not None
        argv = stock_argv(self.plan, self.model_dir, free_port())
        run.detail["argv"] = masked(argv)
        server = self.start_server("stock", argv, child_env(os.environ, STOCK_ENV))
        run.detail["start_s"] = round(server.start_s or 0.0, 2)
        try:
            self.load(server, run)
        finally:
            run.detail["exit"] = server.stop(self.grace())
            run.detail["log"] = str(server.log)
        run.checks["server_exit"] = check_exit(run.detail["exit"])
        self.stock_s = run.detail.get("load_s")

    def run_mode(self, run: ServerRun, stock: ServerRun) -> None:
        """One monitored server, into ``run``: load, HTTP readback, SIGINT, direct read,
        checks."""
        assert self.model_dir is not None
        assert run.mode is not None
        mode = run.mode
        store = self.work / f"store-{slug(mode)}"
        url = f"chdb://{store.resolve()}"
        run_id = f"serve-load-{slug(mode)}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        argv = monitored_argv(self.plan, self.model_dir, free_port(), mode, store_url=url,
                              run_id=run_id)
        run.detail |= {"argv": masked(argv), "run_id": run_id, "store": url}
        server = self.start_server(mode, argv, child_env(os.environ))
        run.detail["start_s"] = round(server.start_s or 0.0, 2)
        web: Json = {}
        try:
            self.load(server, run)
            if self.plan.export_gb > 0:
                run.detail["export"] = self.export_under_load(server, run_id, run)
            web = self.http_readback(server, run_id, run.subset or [],
                                      self.work / f"readback-{slug(mode)}")
        finally:
            run.detail["exit"] = server.stop(self.grace())
            run.detail["log"] = str(server.log)
        run.detail["http"] = {k: v for k, v in web.items() if k not in ("requests", "list")}
        self.check_mode(run, stock, web, url)

    def check_mode(self, run: ServerRun, stock: ServerRun, web: Json, url: str) -> None:
        """The monitored server's checks (tokens, endpoints, readback, store)."""
        subset = run.subset or []
        subset_ids = [o["id"] for o in subset]
        bench = run.detail.get("bench") or {}
        cancels = [*(bench.get("cancels") or []),  # every bench's: the export's two too
                   *((run.detail.get("export") or {}).get("cancels") or [])]
        warm_ids = (run.detail.get("warmup") or {}).get("ids") or []
        listings = {rid: (r.get("listing") if isinstance(r.get("listing"), dict) else {})
                    for rid, r in web["requests"].items()}
        try:
            direct = direct_read(url, run.detail["run_id"],
                                 [*subset_ids, *warm_ids, *(str(o["rid"]) for o in cancels)],
                                 listings)
        except Exception as exc:  # every store check below then fails, naming this
            direct = {"error": f"{type(exc).__name__}: {exc}"}
        tensors = {}
        for rid, r in web["requests"].items():
            with contextlib.suppress(Exception):  # a bad file: the readback check says so
                tensors[rid] = load_safetensors(Path(r["file"]).read_bytes())
        c = run.checks
        c["token_identity"] = check_tokens(stock.subset, subset)
        c["status_capturing"] = check_status(web["status"], run.detail["run_id"],
                                             [o.get("run_id_header") for o in subset])
        c["dmi_stop"] = check_stop(web["stop"])
        c["readable_before_stop"] = check_before_stop(web["before_stop"])
        c["http_listing"] = check_listing(web["list"] | {"body": web["list"]["ids"]},
                                          subset_ids, direct.get("stored"))
        c["readback_equal"] = check_readback(subset_ids, web["requests"], tensors, direct)
        rounds = (run.detail.get("export") or {}).get("rounds") or []
        benches = [run.figures, *(r.get(k) for r in rounds for k in ("bench", "after"))]
        completed = [n for f in benches if isinstance(n := (f or {}).get("completed"), int)]
        c["captures_complete"] = check_complete(  # each bench: its requests and warm-up
            direct, cancels=cancels, known=[*subset_ids, *warm_ids],
            bench_completed=sum(n + BENCH_WARMUP_REQUESTS for n in completed)
            if len(completed) == len(benches) else None)
        if rounds:
            c["export_benches_complete"] = check_export_benches(rounds, self.plan.num_prompts)
        c["cancelled_incomplete"] = check_cancelled(direct, cancels)
        c["run_committed"] = check_committed(direct)
        c["server_exit"] = check_exit(run.detail.get("exit"))
        run.detail["direct"] = {k: direct.get(k) for k in ("run_status", "read_s", "error")} | {
            "stored": len(direct.get("stored") or [])}
        run.detail["http"]["list"] = {"status": web["list"]["status"],
                                      "listed": len(web["list"]["ids"]),
                                      "body_head": web["list"]["body_head"]}
        run.detail["http"]["requests"] = {
            rid: {k: r.get(k) for k in ("status", "safetensors_status", "bytes", "fetched")} |
            {"tensors": len((r.get("listing") or {}).get("tensors") or [])
             if isinstance(r.get("listing"), dict) else None}
            for rid, r in web["requests"].items()}

    def guarded(self, name: str, fn: Callable[[ServerRun], None],
                mode: str | None) -> ServerRun:
        """A run ``fn`` filled; where it raised, what it had measured by then and a ``ran``
        check holding the error."""
        run = ServerRun(name, mode)
        try:
            fn(run)
        except Exception as exc:  # this server's result, with the error that stopped it
            run.detail["error"] = f"{type(exc).__name__}: {exc}"[-LOG_TAIL:]
            run.checks["ran"] = {"ok": False, "required": True, "error": run.detail["error"]}
            print(f"[serve-load] {name}: {run.detail['error'][:2000]}", flush=True)
        return run

    def run(self) -> tuple[Json, list[str]]:
        """Every server in order; the result object (unfinished) and the modes skipped."""
        runs: list[ServerRun] = []
        skipped: list[str] = []
        stock = self.guarded("stock", self.run_stock, None)
        runs.append(stock)
        self.save_partial(runs)
        for mode in self.plan.modes:
            need = self.mode_estimate()
            if not self.deadline.fits(need + RESERVE_S):
                print(f"[serve-load] {mode}: skipped (needs ~{need:.0f} s, "
                      f"{self.deadline.left():.0f} s left)", flush=True)
                skipped.append(mode)
                continue
            t0 = time.monotonic()
            runs.append(self.guarded(mode, functools.partial(self.run_mode, stock=stock), mode))
            self.mode_s = time.monotonic() - t0
            self.save_partial(runs)
        return self.assemble(runs, skipped), skipped

    def save_partial(self, runs: Sequence[ServerRun]) -> None:
        """Write what is done so far to the result file (status ``error``, "partial"), so
        that a cut-off invocation still leaves its figures; the end overwrites it."""
        if self.out is not None:
            data = self.assemble(runs, [])
            write_json(self.out, finish(data, "error", "partial: the invocation did not end"))

    def assemble(self, runs: Sequence[ServerRun], skipped: Sequence[str]) -> Json:
        """The result object of these runs."""
        name = "serve-load-dry-run" if self.plan.dry_run else "serve-load"
        data = result("serve-load", name, self.plan.settings())
        figures = {r.name: r.figures for r in runs if r.figures}
        rows = table_rows(figures)
        data["figures"] = {"servers": figures,
                           "ratios": {r["server"]: r["ratios"] for r in rows if r["ratios"]}}
        data["checks"] = {f"{r.name}.{k}": v for r in runs for k, v in r.checks.items()}
        data["servers"] = {r.name: r.detail | {"subset": r.subset} for r in runs}
        data["skipped_modes"] = list(skipped)
        data["work"] = str(self.work)
        data["table"] = render(rows, data["checks"])
        return data


# -- dry run: preflight and the fake server -----------------------------------------------------
def preflight(plan: Plan, model_dir: Path, store_url: str) -> dict[str, Json]:
    """What the dry run can check of the real commands without a GPU: SGLang's own parser
    accepts every server flag, and ``dmi-sglang serve`` accepts its arguments (with CUDA
    hidden it must answer that it needs a GPU, exit status 3)."""
    mode = plan.modes[0]
    stock = stock_argv(plan, model_dir, 30000)
    monitored = monitored_argv(plan, model_dir, 30001, mode, store_url=store_url,
                               run_id="preflight")
    out: dict[str, Json] = {}
    try:
        from sglang.srt.server_args import ServerArgs

        parsed = []
        for argv in (stock, monitored):
            parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
            ServerArgs.add_cli_args(parser)
            ns = parser.parse_args(serve_own_flags(argv))
            parsed.append({"port": ns.port, "disable_radix_cache": ns.disable_radix_cache,
                           "api_key_set": ns.api_key is not None})
        out["sglang_flags"] = {"ok": True, "required": True, "parsed": parsed}
    except (ImportError, argparse.ArgumentError, SystemExit) as exc:
        out["sglang_flags"] = {"ok": False, "required": True, "error": repr(exc)}
    env = child_env(os.environ, {"CUDA_VISIBLE_DEVICES": ""})
    try:
        done = subprocess.run(monitored, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=180, check=False)
        text = (done.stdout + done.stderr)[-1500:]
        out["serve_arguments"] = {"ok": done.returncode == EXIT_NO_GPU and "GPU" in text,
                                  "required": True, "returncode": done.returncode,
                                  "output": text}
    except subprocess.TimeoutExpired:
        out["serve_arguments"] = {"ok": False, "required": True, "error": "no answer in 180 s"}
    return out


# -- the command -------------------------------------------------------------------------------
@contextlib.contextmanager
def terminate_as_exit(load: ServeLoad | None = None) -> Iterator[None]:
    """SIGTERM (``timeout``, a cut-off) raises SystemExit so that servers are stopped in
    ``finally``; restored afterwards."""
    def handler(signum: int, _frame: Any) -> None:
        if load is not None:
            load.terminating = True
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _export_round(bench: Json, before: Json | None, after: Json) -> Json:
    """One export round's figures: the export bench's download (``bench["export"]``),
    throughput and CPU seconds, and its throughput against the mean of the plain benches
    ``before`` (figures) and ``after`` it."""
    plain: list[float | None] = [(f or {}).get("request_throughput")
                                 for f in (before, after.get("figures"))]
    exported = (bench.get("figures") or {}).get("request_throughput")
    known = [p for p in plain if p]
    ratio = exported / (sum(known) / 2) if exported and len(known) == 2 else None
    return {**(bench.get("export") or {}),
            "bench": bench.get("figures"), "after": after.get("figures"),
            "cancels": [*(bench.get("cancels") or []), *(after.get("cancels") or [])],
            "cpu_seconds": {"export": bench.get("cpu_seconds"),
                            "after": after.get("cpu_seconds")},
            "plain_request_throughputs": plain, "throughput_ratio": ratio,
            "cost": None if ratio is None else round(1 - ratio, 4)}


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Plan]:
    """The command line and its plan (exit 2 on anything the benchmark cannot run)."""
    p = argparse.ArgumentParser(prog="python -m harness serve-load", allow_abbrev=False,
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default=None, help="result JSON (default $OUT/serve-load.json)")
    p.add_argument("--modes", default=MODE_SEPARATOR.join(DEFAULT_MODES),
                   help=f"hook selections, separated by {MODE_SEPARATOR!r} (default %(default)s)")
    p.add_argument("--model", choices=("demo", "0.6b"), default="demo",
                   help="demo checkpoint size (module docstring)")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    p.add_argument("--export-gb", type=float, default=0.0,
                   help="per monitored server, a bench while a client exports this many GB "
                   "of committed requests' safetensors over HTTP, then a plain one "
                   "(0: none)")
    p.add_argument("--export-rounds", type=int, default=1,
                   help="with --export-gb: that pair of benches this many times (default 1)")
    p.add_argument("--input-len", type=int, default=INPUT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--range-ratio", type=float, default=RANGE_RATIO)
    p.add_argument("--max-concurrency", type=int, default=MAX_CONCURRENCY)
    p.add_argument("--api-key", default=None, help="started servers require it (optional)")
    p.add_argument("--server-flags", default="",
                   help="more SGLang flags for every server, one shell-quoted string")
    p.add_argument("--work", default=None, help="models, logs and stores (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true",
                   help="the whole flow on CPU against fake servers (module docstring)")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "max_concurrency",
                 "export_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    if not 0.0 <= args.range_ratio <= 1.0:
        p.error(f"--range-ratio {args.range_ratio}: expected 0..1")
    try:
        modes = parse_modes(args.modes)
        extra = tuple(shlex.split(args.server_flags))
    except ValueError as exc:
        p.error(str(exc))
    if not math.isfinite(args.export_gb) or args.export_gb < 0:
        p.error(f"--export-gb {args.export_gb}: a number of GB, 0 (no export phase) or more")
    plan = Plan(modes=modes, model=args.model, num_prompts=args.num_prompts,
                input_len=args.input_len, output_len=args.output_len,
                range_ratio=args.range_ratio, max_concurrency=args.max_concurrency,
                api_key=args.api_key, extra_flags=extra, dry_run=args.dry_run,
                export_gb=args.export_gb, export_rounds=args.export_rounds)
    return args, plan


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    args, plan = parse_args(argv)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or ".") / "serve-load.json"
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dmi-serve-load-"))
    work.mkdir(parents=True, exist_ok=True)
    groups = GroupRecord(state_dir(out.resolve().parent / ".state") / "serve-load.pgids")
    killed = groups.kill_leftovers()
    if killed:
        print(f"[serve-load] killed leftover process groups {killed}", flush=True)
    load = ServeLoad(plan, work, Deadline(), groups)
    load.out = out
    print(f"[serve-load] {'dry run, ' if plan.dry_run else ''}modes {list(plan.modes)}, "
          f"work {work}", flush=True)
    pre: dict[str, Json] = {}
    skipped: list[str] = []
    error = None
    with terminate_as_exit(load):
        try:
            load.prepare()
            assert load.model_dir is not None
            if plan.dry_run:
                pre = preflight(plan, load.model_dir,
                                f"chdb://{(work / 'store-preflight').resolve()}")
            data, skipped = load.run()
        except Exception as exc:  # the model or the preflight failed: a result with it
            error = f"{type(exc).__name__}: {exc}"
            data = load.assemble([], [])
    data["checks"] = {**{f"preflight.{k}": v for k, v in pre.items()}, **data["checks"]}
    data["table"] = render(table_rows(data["figures"]["servers"]), data["checks"])
    finish(data, "error" if error else overall_status(data["checks"], skipped), error)
    write_json(out, data)
    print(data["table"])
    print(f"[serve-load] {data['status']}{f' ({error})' if error else ''}; wrote {out}",
          flush=True)
    return EXIT_STATUS.get(data["status"], 1)
