"""``dmi-sglang plan``: what a hook selection moves per token and which stage limits it.

Needs no GPU and no SGLang: the model's ``config.json`` gives the row shapes, the domain's
bandwidth plan (:mod:`dmi_sglang.domain.bandwidth`) does the arithmetic, with the stage
rates given on the command line (documented defaults: the H200 host's measured rates).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dmi_sglang.app.composition import model_rows
from dmi_sglang.domain.bandwidth import DEFAULT_RATES, GB, BandwidthPlan, Rates, plan_bandwidth
from dmi_sglang.domain.capacity import (
    MIB,
    RingCapacity,
    chunks_held,
    prefill_ring_bytes,
    ring_advice,
)
from dmi_sglang.domain.hooks import parse_selection
from dmi_sglang.domain.sampling import RequestSample
from dmi_sglang.domain.settings import Settings
from dmi_sglang.errors import (
    ConfigurationError,
    SelectionError,
    UnsupportedConfigurationError,
    UsageError,
)

__all__ = ["add_plan_parser", "plan"]


RATE_MAX = 1e12
"""The largest rate ``plan`` takes (GB/s, tokens/s): beyond it the plan's products of
rates and sizes would leave the floats (``inf`` in the table)."""


def _positive_float(text: str) -> float:
    """An argparse type: a positive number up to :data:`RATE_MAX`."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= RATE_MAX:
        msg = f"{text!r} is not a positive (finite) number up to {RATE_MAX:g}"
        raise argparse.ArgumentTypeError(msg)
    return value


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                    positive: Callable[[str], int]) -> None:
    """The ``plan`` subcommand's arguments (``positive``: the CLI's positive-int type)."""
    p = sub.add_parser(
        "plan", help="bytes a hook selection moves per token, and the stage that limits it "
        "(no GPU)", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="The bandwidth plan of a hook selection: bytes per prompt token and per "
        "generated token for requests of --prompt-len + --output-len tokens, and the most "
        "generated tokens per second that the device-to-host copies, the store's ingest and "
        "the disk can follow (and the bound at --tok-s). An upper bound from bandwidth alone: "
        "the capture's own work per step costs serving speed too (docs/benchmarks.md). The "
        "rates default to what was measured on an H200 host; give yours.")
    p.add_argument("--model", required=True, type=Path,
                   help="model directory (its config.json)")
    p.add_argument("--hooks", default=None,
                   help="hook selection; unset: $DMX_HOOK_SELECTION, else sglang-full")
    p.add_argument("--tok-s", type=_positive_float, default=None,
                   help="generated tokens per second to check the plan against")
    p.add_argument("--prompt-len", type=positive, default=256, help="prompt tokens a request")
    p.add_argument("--output-len", type=positive, default=128,
                   help="generated tokens a request")
    p.add_argument("--prefill-tokens", type=positive, default=8192,
                   help="positions of one prefill chunk: the engine's chunked_prefill_size "
                   "(the ring's advice)")
    p.add_argument("--request-sample", type=_fraction, default=None,
                   help="share of requests captured (0 to 1); unset: $DMX_REQUEST_SAMPLE, "
                   "else 1")
    p.add_argument("--no-store", action="store_true",
                   help="capture without storing (DMX_DB_URL=none): only D2H applies")
    p.add_argument("--d2h-gbps", type=_positive_float, default=DEFAULT_RATES.d2h_bps / GB,
                   help="page-locked device-to-host GB/s")
    p.add_argument("--store-gbps", type=_positive_float, default=DEFAULT_RATES.store_bps / GB,
                   help="the store's ingest, GB/s of captured bytes")
    p.add_argument("--disk-gbps", type=_positive_float, default=DEFAULT_RATES.disk_bps / GB,
                   help="the disk's synced write GB/s")
    p.add_argument("--compression", type=_positive_float, default=DEFAULT_RATES.compression,
                   help="captured bytes / bytes on disk")


def _fraction(text: str) -> float:
    """An argparse type: a request sample rate, as the domain's :class:`RequestSample`
    takes it (a number from 0 to 1)."""
    try:
        return RequestSample(float(text)).rate
    except ValueError:
        msg = f"{text!r} is not a number from 0 to 1"
        raise argparse.ArgumentTypeError(msg) from None


def _config(model: Path) -> dict[str, Any]:
    path = model / "config.json"
    if not model.is_dir():
        what = "does not exist" if not model.exists() else "is not a directory"
        msg = f"--model {str(model)!r} {what}: give a model directory (with config.json)"
        raise UsageError(msg)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        msg = f"--model {str(model)!r} has no config.json: give a model directory"
        raise UsageError(msg) from None
    except json.JSONDecodeError as exc:
        msg = f"{path} is not JSON: {exc}"
        raise UsageError(msg) from None
    if not isinstance(raw, dict):
        msg = f"{path} holds no JSON object"
        raise UsageError(msg)
    return raw


def check_selection(model: Path, text: str) -> None:
    """Refuse a hook selection the model at ``model`` (its ``config.json``) cannot have:
    a layer it lacks, ``topk(K)`` beyond its vocabulary, a hook without a row shape
    here; before a GPU is looked for or anything starts.

    A model this cannot read (an architecture without a hooked model, sizes missing
    from its ``config.json``) is left to the engine, which refuses it with the support
    matrix's reasons.

    Raises:
        UsageError: the model directory, its ``config.json`` or the selection.
    """
    try:
        hooks, shape = model_rows(_config(model))
    except (UnsupportedConfigurationError, UsageError):
        return
    try:
        selection = parse_selection(text).resolve(hooks)
        for hook, layer in selection.captures():
            shape.capture_row(selection, hook, layer)
    except (SelectionError, ConfigurationError) as exc:
        msg = f"hook selection {text!r} on {model}: {exc}"
        raise UsageError(msg) from None


def plan(args: argparse.Namespace) -> int:
    """Print the plan; 0, or a usage error for a bad model directory or selection."""
    hooks, shape = model_rows(_config(args.model))
    text = args.hooks if args.hooks is not None else Settings.from_env().hook_selection
    selection = parse_selection(text).resolve(hooks)
    captures = selection.captures()
    rates = Rates(args.d2h_gbps * GB, args.store_gbps * GB, args.disk_gbps * GB,
                  args.compression)
    sample = (args.request_sample if args.request_sample is not None else Settings.from_env(
        {k: v for k, v in os.environ.items() if k == "DMX_REQUEST_SAMPLE"}).request_sample)
    result = plan_bandwidth(selection, shape, prompt_tokens=args.prompt_len,
                            completion_tokens=args.output_len, tok_s=args.tok_s,
                            stored=not args.no_store, rates=rates, sample=sample)
    print(f"selection {text} on {hooks.architecture} ({shape.num_layers} layers, hidden "
          f"{shape.hidden}, {shape.activation_dtype.value.removeprefix('torch.')}): "
          f"{len(captures)} tensors a forward")
    if selection.omitted:
        print(f"omitted (the model lacks them): {', '.join(selection.omitted)}")
    if sample < 1:
        print(f"a share {sample:g} of the requests is captured: the rates and bounds below "
              "count only those")
    for line in _lines(result, args.compression):
        print(line)
    env = Settings.from_env({k: v for k, v in os.environ.items()  # the ring's alone
                             if k in ("DMX_RING_PAYLOAD_MB", "DMX_RING_PINNED_MB")})
    capacity = RingCapacity.from_mb(env.ring_payload_mb, env.ring_pinned_mb,
                                    env.ring_task_entries)
    d2h = next((s.bound for s in result.stages if s.stage == "d2h"), None)
    print(_ring_line(capacity, args.prefill_tokens,
                     prefill_ring_bytes(selection, shape, args.prefill_tokens),
                     copies_behind=d2h is not None and d2h < 1.0))
    return 0


def _ring_line(capacity: RingCapacity, tokens: int, chunk_bytes: int, *,
               copies_behind: bool) -> str:
    """Whether one prefill chunk fits the ring (DMX_RING_*), and what helps when not;
    ``copies_behind``: the device-to-host copies cannot follow the asked rate, so the
    ring fills whatever its size."""
    head = (f"a prefill chunk of {tokens:,} tokens takes {_bytes(chunk_bytes)} of the ring "
            f"({capacity.effective_bytes // MIB:,} MiB)")
    if chunk_bytes <= capacity.effective_bytes:
        return f"{head}: it fits"
    advised = ring_advice(capacity, chunk_bytes)
    helps = (f"DMX_RING_PAYLOAD_MB={advised} DMX_RING_PINNED_MB={advised} hold "
             f"{chunks_held(advised, chunk_bytes)} (device memory taken from the KV cache, "
             "and page-locked host memory)"
             if advised is not None else "a smaller --chunked-prefill-size makes it fit")
    behind = ("; at this rate the copies fall behind, so a ring of any size fills and "
              "prefills still wait for the drain: a larger one absorbs bursts only"
              if copies_behind and advised is not None else "")
    return f"{head}: it commits piecewise, in parts waiting for the drain; {helps}{behind}"


def _lines(p: BandwidthPlan, compression: float) -> list[str]:
    head = (f"a request of {p.prompt_tokens} prompt + {p.completion_tokens} generated tokens: "
            f"{_bytes(p.bytes_per_request)}; {_bytes(p.bytes_per_prompt_token)} per prompt "
            f"token, {_bytes(p.bytes_per_generated_token)} per generated token (prompt "
            "included)")
    at = f"bound at {p.tok_s:,.0f} tok/s" if p.tok_s else "bound"
    rows = [("stage", "GB/s", "max tok/s", at)]
    for s in p.stages:
        rate = f"{s.limit_bps / GB:.2f}" + (f" (x{compression:g})" if s.stage == "disk" else "")
        rows.append((s.stage, rate, "-" if s.max_tok_s is None else f"{s.max_tok_s:,.0f}",
                     "-" if s.bound is None else f"{s.bound:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    tail = [f"limited by {p.limiting.stage}: {p.limiting.max_tok_s:,.0f} generated tok/s "
            "at most" if p.limiting.max_tok_s is not None
            else "nothing is captured at these lengths: no stage limits the serving"]
    if p.tok_s and p.needed_bps is not None:
        tail.append(f"at {p.tok_s:,.0f} tok/s the capture needs {p.needed_bps / GB:.2f} GB/s"
                    + ("" if p.bound is None or p.bound >= 1.0
                       else f": it keeps up with {p.bound:.0%} of that rate"))
    return [head, *table, *tail]


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
