"""Where a serving step's time goes: ``python -m harness profile``.

For each ``--modes`` entry (``stock``, or a serving mode such as ``transport:hidden-states``)
one engine serves the serving benchmark's workload (``--batch`` requests of
``--prompt-len`` + ``--output-len`` tokens, the same engine settings): a warm-up wave, one
untimed wave of the workload, then one more wave during which SGLang's own profiler
(``Engine.start_profile``: torch's profiler, CPU and GPU, Python stacks) records the
wave's first ``--steps`` forwards of the scheduler (its prefill, then decode steps; at
most ``--output-len - 2``, because SGLang writes the trace when forward N + 1 starts).
Each trace is summarized on the machine (:mod:`harness.trace`): the share of the window
the GPU was busy, forwards, per thread the seconds in Python, dmi_sglang's own seconds
(its library calls in, SGLang's code it wraps out, waits apart) and the seconds in CUDA
calls (where the thread holds no GIL) with the calls that took it longest (which thread
waits for events, whose launches grew), dmi_sglang's functions
and the torch operators they ran. The traces stay in ``--work``; the JSON and the table
hold the summaries. A diagnostic, not a benchmark: the profiler slows what it records, so
compare modes with each other, never with the serving benchmark's figures.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from harness.engine import EngineError, EngineProcess, kill_leftovers
from harness.models import MODELS, STOCK_ENV, engine_kwargs, monitored_env, write_model_dir
from harness.results import Deadline, Json, finish, result, state_dir, write_json
from harness.serving import parse_modes, slug, workloads

__all__ = ["main"]


def _modes(text: str) -> list[str]:
    """``--modes``: ``stock`` and serving modes, separated by commas."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        msg = f"{text!r}: expected stock and/or serving modes, e.g. stock,transport:hidden-states"
        raise argparse.ArgumentTypeError(msg)
    try:
        parse_modes(",".join(k for k in keys if k != "stock") or "transport:hidden-states")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return keys


def profile_mode(args: argparse.Namespace, key: str, work: Path, deadline: Deadline,
                 pgids: Path) -> Json:
    """One engine of mode ``key``: warm-up, its garbage collector frozen, a wave, a
    profiled wave; its summary."""
    model_dir = write_model_dir(work / "models", MODELS[args.model])
    kwargs = engine_kwargs(model_dir, graphs=True, max_bs=args.batch, chunked_prefill_size=0)
    mode = None if key == "stock" else parse_modes(key)[0]
    warm, main = workloads(args, mode)
    if mode is None:
        spec: Json = {"engine": kwargs, "env": STOCK_ENV, "factory": args.engine_class}
    else:
        store = work / "stores" / slug(key)
        spec = {"engine": kwargs, "factory": args.engine_class,
                "env": monitored_env(str(mode.preset), store if mode.kind == "store" else None,
                                     f"profile-{slug(key)}", dict(mode.env))}
    engine = EngineProcess(f"profile-{slug(key)}", spec, work / "engines", pgids)
    out: Json = {"mode": key}
    try:
        out["ready"] = engine.start(deadline.timeout())
        for wl, prefix in ((warm, "w-"), (main, "m-")):
            engine.request("run", deadline.timeout(),
                           workload={**wl.spec(prefix), "min_seconds": 0, "max_waves": 1})
            if wl is warm:  # as the serving benchmark's engines (harness.bracket)
                engine.request("freeze_gc", deadline.timeout())
        profiled = engine.request("profile", deadline.timeout(), workload=main.spec("p-"),
                                  steps=args.steps,
                                  dir=str(work / "traces" / slug(key)))
        out.update(profiled)
        if mode is not None:
            engine.request("stop", deadline.timeout())
    finally:
        engine.close()
    return out


def render(rows: Sequence[Json]) -> str:
    """The summaries as a table (a row per thread, at most three a mode), then each mode's
    dmi_sglang functions, the kernels, replay kernels and CUDA calls that grew most
    against stock's, and each thread's CUDA calls that took it longest."""
    head = (f"{'mode':<26} {'window s':>8} {'fwd':>4} {'GPU busy':>8} "
            f"{'thread':<36} {'python ms/fwd':>13} {'dmi ms/fwd':>10} "
            f"{'dmi wait':>8} {'CUDA calls':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r.get("summary") or {}
        fwd = max(int(s.get("forwards") or 0), 1)
        for i, t in enumerate((s.get("threads") or [])[:3]):
            lead = (f"{r['mode']:<26} {s['window_s']:>8.3f} {s['forwards']:>4} "
                    f"{(s['gpu_busy'] or 0):>8.1%}") if i == 0 else " " * 49
            label = _label(t)
            lines.append(f"{lead} {label:<36} {t['python_s'] / fwd * 1e3:>13.3f} "
                         f"{t['dmi_s'] / fwd * 1e3:>10.3f} {t['dmi_wait_s'] / fwd * 1e3:>8.3f} "
                         f"{t.get('cuda_s', 0.0) / fwd * 1e3:>10.3f}")
    for r in rows:
        s = r.get("summary") or {}
        fwd = max(int(s.get("forwards") or 0), 1)
        if "kernel_s" in s:
            lines.append(f"{r['mode']}: GPU ms per forward: kernels "
                         f"{s['kernel_s'] / fwd * 1e3:.3f}, copies {s['copy_s'] / fwd * 1e3:.3f}, "
                         f"both at once {s['copy_kernel_overlap_s'] / fwd * 1e3:.3f}")
        if s.get("dmi"):
            lines.append(f"\n{r['mode']}: dmi_sglang functions, own ms per forward (their "
                         "library calls in, SGLang's code they wrap out)")
            lines += [f"  {f['seconds'] / fwd * 1e3:8.3f}  {f['calls']:>6}  {f['function']}"
                      for f in s["dmi"]]
            lines.append("  torch operators inside them, ms per forward")
            lines += [f"  {o['seconds'] / fwd * 1e3:8.3f}  {o['op']}" for o in s["dmi_ops"][:10]]
    lines += _grown_over_stock(rows, "kernels", "kernel")
    lines += _grown_over_stock(rows, "graph_kernels", "kernel")
    lines += _grown_over_stock(rows, "runtime", "call")
    lines += _calls_by_thread(rows)
    return "\n".join(lines)


def _calls_by_thread(rows: Sequence[Json]) -> list[str]:
    """Per mode, each thread's CUDA calls that took it longest, µs and count per
    forward: which thread waits for events, which one's launches grew."""
    lines: list[str] = []
    for r in rows:
        s = r.get("summary") or {}
        fwd = max(int(s.get("forwards") or 0), 1)
        threads = [t for t in s.get("threads") or [] if t.get("cuda_calls")]
        if not threads:
            continue
        lines.append(f"\n{r['mode']}: CUDA calls by thread, µs and count per forward")
        for t in threads:
            calls = "; ".join(f"{c['call']} {c['seconds'] / fwd * 1e6:,.1f} x"
                              f"{c['count'] / fwd:.1f}" for c in t["cuda_calls"])
            lines.append(f"  {_label(t):<36} {calls}")
    return lines


def _label(thread: Json) -> str:
    """How the tables name a thread: its name in the trace (``thread 2340
    (sglang::schedul)``), else the Python frame it started in, else its id; at most 36
    characters."""
    return str(thread.get("name") or thread.get("entry") or f"thread {thread['tid']}")[-36:]


_TABLES = {
    "kernels": ("forwards", "gpu_s", "GPU µs per forward", "kernels"),
    "graph_kernels": ("graph_launches", "graph_gpu_s", "GPU µs per decode graph replay",
                      "kernels of the replays"),
    "runtime": ("forwards", "runtime_s", "host µs in CUDA calls per forward", "CUDA calls"),
}
"""Per table of a summary: what its figures are per (forwards or graph launches), its
total's key, and how the comparison names them."""


def _per_forward(summary: Json, key: str, name: str) -> dict[str, tuple[float, float]]:
    """Kernel (``key`` ``kernels``), decode graph kernel (``graph_kernels``: per replay) or
    CUDA call (``runtime``) name -> (µs, count) per forward of one mode's window."""
    fwd = max(int(summary.get(_TABLES[key][0]) or 0), 1)
    return {k[name]: (k["seconds"] / fwd * 1e6, k["count"] / fwd)
            for k in summary.get(key) or []}


def _grown_over_stock(rows: Sequence[Json], key: str, name: str) -> list[str]:
    """Per monitored mode: the kernels' GPU µs (``kernels``; ``graph_kernels``: per decode
    graph replay) or the CUDA calls' host µs (``runtime``) per forward against stock's,
    and those whose time per forward grew most (what the capture adds to the GPU, or to
    the launching thread). Nothing for a table stock's summary lacks or has empty."""
    stock = next((r.get("summary") for r in rows if r["mode"] == "stock"), None)
    per, total_key, *what = _TABLES[key]
    if not stock or not stock.get(key):
        return []
    base = _per_forward(stock, key, name)
    total0 = float(stock.get(total_key) or 0.0) / max(int(stock.get(per) or 0), 1) * 1e6
    lines: list[str] = []
    for r in rows:
        s = r.get("summary") or {}
        if r["mode"] == "stock" or not s:
            continue
        mine = _per_forward(s, key, name)
        total = float(s.get(total_key) or 0.0) / max(int(s.get(per) or 0), 1) * 1e6
        lines.append(f"\n{r['mode']}: {what[0]} {total:,.0f} (stock {total0:,.0f}); "
                     f"{what[1]} that grew most, µs and count per forward (stock's)")
        grew = sorted(mine, key=lambda k: -(mine[k][0] - base.get(k, (0.0, 0.0))[0]))
        for k in grew[:10]:
            us, n = mine[k]
            us0, n0 = base.get(k, (0.0, 0.0))
            lines.append(f"  {us - us0:+9.1f}  {us:9.1f} x{n:6.1f}  ({us0:9.1f} x{n0:6.1f})  {k}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); 0 when every mode was profiled."""
    p = argparse.ArgumentParser(prog="python -m harness profile",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--modes", type=_modes, default="stock,transport:hidden-states")
    p.add_argument("--model", choices=sorted(MODELS), default="0.6b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="forwards profiled per mode")
    p.add_argument("--out", default=None, help="result JSON ($OUT/profile.json)")
    p.add_argument("--work", default=None, help="engine logs, stores and traces (temp dir)")
    p.add_argument("--engine-class", default="sglang:Engine",
                   help="MODULE:NAME of the engine (default %(default)s)")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "output_len", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    if args.steps > args.output_len - 2:  # SGLang writes the trace when forward N + 1 starts
        p.error(f"--steps {args.steps}: at most --output-len - 2 = {args.output_len - 2}, so "
                "that the profiled wave runs the forwards the profiler waits for")
    args.min_seconds = 0.0
    args.env = {}  # serving.workloads reads the settings (a mode's own ones only here)
    args.out = args.out or str(Path(os.environ.get("OUT", ".")) / "profile.json")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dmi-profile-"))
    pgids = state_dir(Path(args.out).resolve().parent / ".state") / "profile.pgids"
    kill_leftovers(pgids)
    deadline = Deadline()
    data = result("profile", "profile", {k: v for k, v in vars(args).items() if k != "out"})
    rows: list[Json] = []
    for key in args.modes:
        try:
            rows.append(profile_mode(args, key, work, deadline, pgids))
        except (EngineError, TimeoutError) as exc:
            rows.append({"mode": key, "error": str(exc)[-3000:]})
    data["figures"] = {"modes": rows}
    failed = [r["mode"] for r in rows if "error" in r]
    finish(data, "failed" if failed else "passed",
           f"not profiled: {', '.join(failed)}" if failed else None)
    write_json(Path(args.out), data)
    print(render([r for r in rows if "summary" in r]))
    for r in rows:
        if "error" in r:
            print(f"{r['mode']}: {r['error'][-500:]}")
    return 1 if failed else 0
